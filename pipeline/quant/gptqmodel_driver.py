"""The GPTQModel driver shared by GPTQ, RTN and AWQ (pipeline/quant/methods/): load, quantize with a GPTQModel
config, save, and the in-memory model made runnable.

GPTQModel is tamed here, not by the user: `pipeline.base.env.tame()` has set its worker count and
caches before it is imported (api.py); dynamo is disabled around its calls only; it runs with
the working directory in a scratch folder inside out_dir so its `logs/` never lands in the
user's folder (the log is appended to out_dir/gptqmodel.log, then the scratch folder removed);
its console output is captured by the caller; our own bar counts layers via its layer callback.
"""
from __future__ import annotations

import contextlib
import csv
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import gptqmodel
import torch
from gptqmodel import GPTQModel
from gptqmodel.nn_modules.qlinear import BaseQuantLinear
from gptqmodel.nn_modules.qlinear.torch import TorchLinear
from gptqmodel.quantization.config import ExpertsRoutingOverride, MoEConfig
from gptqmodel.utils.model import convert_gptq_v1_to_v2_format
from gptqmodel.utils.threadx import _DeviceWorker

from pipeline.base.errors import StageError
from pipeline.model.compute import float32_matmuls
from pipeline.model.dtypes import torch_dtype
from pipeline.quant.common import LayerProgress, base_dtype, finish_checkpoint, quantized_in_blocks
from pipeline.quant.formats.ct_export import rewrite_in_place
from pipeline.quant.gptq_search import group_search_only
from pipeline.quant.shapes import skip_pattern

ENGINE = "gptqmodel"

# GPTQModel's logger redraws its progress bars as one line per step when not on a terminal
# (megabytes per run in the log file): draw one line per 1000 steps. Read once, at its first bar.
os.environ.setdefault("LOGBAR_PROGRESS_OUTPUT_INTERVAL", "1000")
os.environ.setdefault("LOGBAR_ANIMATION", "0")


def engine_version() -> str:
    return gptqmodel.__version__


def common_kwargs(variant, sym: bool | None = None) -> dict:
    """GPTQModel QuantizeConfig fields shared by GPTQ, RTN and AWQ (sym: AWQ's is `not zero_point`)."""
    skips = [e for e in variant.modules_to_skip if e != "lm_head"]
    return {
        "bits": variant.bits, "group_size": variant.group_size, "sym": variant.sym if sym is None else sym,
        "lm_head": "lm_head" not in variant.modules_to_skip,
        # "-:" = negative match: GPTQModel leaves the module in full precision
        "dynamic": {f"-:{skip_pattern(e)}": {} for e in skips} or None,
        # keep everything in memory: no random temp path in the saved config, no disk traffic
        "offload_to_disk": False,
        **moe_routing(variant),
    }


def moe_routing(variant) -> dict:
    """A variant's `moe_all_experts` as GPTQModel's MoE routing: every expert of a Mixture-of-Experts layer is
    calibrated on every token (its routers' top-k raised to the expert count while GPTQModel captures a layer's
    inputs; the replay that feeds the next layer keeps the model's own routing). Not ExpertsRoutingBypass: it needs
    `moe_lifecycle_hooks` in GPTQModel's definition, and on gpt_oss and granitemoe (none) it does nothing but log a
    warning. Absent when off, so a dense or routed variant's config is unchanged."""
    if not getattr(variant, "moe_all_experts", False):
        return {}
    return {"moe": MoEConfig(routing=ExpertsRoutingOverride(num_experts_per_tok="all"))}


def calibration_rows(calib_ids: torch.Tensor) -> list[dict]:
    """[n, seq_len] ids -> GPTQModel's pre-tokenized calibration format (no padding)."""
    return [{"input_ids": row.tolist(), "attention_mask": [1] * row.numel()} for row in calib_ids]


@contextlib.contextmanager
def session(out_dir: Path) -> Iterator[None]:
    """Around every GPTQModel call: cwd in a scratch folder (its logs/ goes there and is appended to
    out_dir/gptqmodel.log), dynamo off for its torch kernel (locally: restored on exit), and its worker threads'
    failures raised here (`worker_failures_raised`)."""
    scratch = Path(tempfile.mkdtemp(prefix=".gptqmodel-", dir=out_dir))
    try:
        with contextlib.chdir(scratch), torch._dynamo.config.patch(disable=True), worker_failures_raised():
            yield
    finally:
        _collect_logs(scratch, out_dir / f"{ENGINE}.log")


@contextlib.contextmanager
def worker_failures_raised() -> Iterator[None]:
    """GPTQModel's device thread pool ends the whole process with os._exit(1) when a task raises
    (threadx._DeviceWorker._abort_process): the run could record nothing (exit 1, report.json left at "running";
    seen with AWQ on Gemma 3's rotary embedding). Here the failure is kept instead: the task's future already holds
    the exception for whoever waits on it, and on leaving, the first one kept is raised as a RuntimeError naming it,
    so the variant fails with its error line and the run goes on."""
    failures: list[BaseException] = []
    original = _DeviceWorker._abort_process

    def keep(self, exc: BaseException) -> None:
        failures.append(exc)

    _DeviceWorker._abort_process = keep
    try:
        yield
    finally:
        _DeviceWorker._abort_process = original
    if failures:
        exc = failures[0]
        raise RuntimeError(f"a GPTQModel worker thread failed: {type(exc).__name__}: {exc}") from exc


def quantize_with(base_dir: Path, qcfg, calibration: list[dict] | None, console: IO[str], label: str,
                  dtype: str, device: str, backend=None, offload: Path | None = None):
    """Load base_dir in `dtype` and quantize it with GPTQModel config `qcfg`: the in-memory GPTQModel model.
    backend: the kernel GPTQModel packs for (None = its choice). offload: a scratch folder: GPTQModel builds the
    model on the meta device and reads one decoder layer at a time from base_dir's safetensors (its "lazy
    turtle"), writing finished layers to that folder; `save` scrubs the folder from the saved config."""
    if offload is not None:
        qcfg.offload_to_disk, qcfg.offload_to_disk_path = True, str(offload)
    n_layers = json.loads((base_dir / "config.json").read_text()).get("num_hidden_layers", 0)
    progress = LayerProgress(n_layers, label, console)
    try:
        model = GPTQModel.load(str(base_dir.resolve()), qcfg, device=device, dtype=torch_dtype(dtype))
        model.layer_callback = progress.layer_done
        # float32_matmuls: a 16-bit model on a CPU without 16-bit units (pipeline/model/compute.py);
        # group_search_only: GPTQ's mse search minus the whole-matrix round GPTQModel discards
        # (pipeline/quant/gptq_search.py; same bytes)
        with float32_matmuls(dtype, device), group_search_only():
            model.quantize(calibration, batch_size=1, **({"backend": backend} if backend is not None else {}))
        progress.finish()
    finally:
        progress.close()
    return model


def save(model, base_dir: Path, out_dir: Path, variant) -> dict:
    model.save(str(out_dir.resolve()))
    scrub_offload(out_dir)
    if getattr(variant, "moe_all_experts", False):
        check_all_experts(out_dir / "quant_log.csv")
    # per-module loss table with wall times: into the log, so the checkpoint itself is reproducible
    append_file(out_dir / "quant_log.csv", out_dir / f"{ENGINE}.log")
    qc = json.loads((out_dir / "config.json").read_text())["quantization_config"]
    extra = {}
    if getattr(variant, "format", "gptq") == "compressed-tensors":  # the same integers, rewritten (formats/ct_export)
        extra["gptq_config"], qc = qc, rewrite_in_place(out_dir)
    elif any(e != "lm_head" for e in variant.modules_to_skip):
        qc["modules_in_block_to_quantize"] = quantized_in_blocks(out_dir)
    dtype = variant.dtype or base_dtype(base_dir)
    finish_checkpoint(base_dir, out_dir, qc, dtype)
    return {"engine": ENGINE, "engine_version": engine_version(), "engine_config": qc, "dtype": dtype, **extra}


def check_all_experts(quant_log: Path) -> None:
    """moe_all_experts: every expert module GPTQModel quantized saw as many calibration tokens ("samples" in its
    quant_log.csv) as the layer's busiest module (its attention); a StageError naming the first one that did not,
    rather than a routed calibration reported as all-expert."""
    if not quant_log.is_file():
        return
    rows = list(csv.DictReader(quant_log.read_text().splitlines()))
    most: dict[str, int] = {}
    for r in rows:
        most[r["layer"]] = max(most.get(r["layer"], 0), int(r["samples"]))
    short = [r for r in rows if ".experts." in r["module"] and int(r["samples"]) < most[r["layer"]]]
    if short:
        r = short[0]
        raise StageError(f"moe_all_experts: GPTQModel calibrated layer {r['layer']} {r['module']} on {r['samples']} "
                         f"of {most[r['layer']]} tokens ({len(short)} expert module(s) short): its routing override "
                         "did not reach this architecture's routers")


def scrub_offload(out_dir: Path) -> None:
    """GPTQModel saves its disk-offload setting and scratch path in the checkpoint's quantization config: written
    as when nothing was offloaded (the scratch folder is gone; the weights are the same either way)."""
    for name in ("quantize_config.json", "config.json"):
        path = out_dir / name
        if not path.is_file():
            continue
        cfg = json.loads(path.read_text())
        qc = cfg.get("quantization_config", cfg) if name == "config.json" else cfg
        meta = qc.get("meta") if isinstance(qc, dict) else None
        if isinstance(meta, dict) and (meta.get("offload_to_disk") or meta.get("offload_to_disk_path")):
            meta["offload_to_disk"], meta["offload_to_disk_path"] = False, None
            path.write_text(json.dumps(cfg, indent=2) + "\n")


def inference_model(model):
    """GPTQModel's in-memory model after quantize(), made runnable: its packed modules hold the
    checkpoint's v1 zero points (zero - 1) while its torch kernels compute with v2 ones, which its
    loader converts on load; run as-is it is off by one quantization step. Same conversion here."""
    return convert_gptq_v1_to_v2_format(model.model, model.quantize_config, TorchLinear).eval()


def _collect_logs(scratch: Path, log_file: Path) -> None:
    for f in sorted(scratch.rglob("*.log")):
        append_file(f, log_file)
    shutil.rmtree(scratch, ignore_errors=True)


def append_file(src: Path, log_file: Path) -> None:
    if src.is_file():
        with open(log_file, "a") as out:
            out.write(f"\n===== {src.name} =====\n{src.read_text(errors='replace')}")
        src.unlink()


def dequantize_to_linear(model: torch.nn.Module) -> int:
    """Replace every GPTQModel quantized linear with a float32 `nn.Linear` holding its exactly dequantized
    weights (GPTQModel's own `dequantize_weight`). The model then computes what the checkpoint encodes in float32,
    with float32's row-independence: GPTQModel's CPU int4 kernel rounds scales and activations to bfloat16 and its
    results change with the number of tokens per call, which breaks token-exact greedy comparisons. Memory and
    speed become those of a float32 model. Call before any forward. Returns the number of modules replaced."""
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, BaseQuantLinear)]
    for name, m in targets:
        if getattr(m, "linear_mode", None) == "inference":
            raise RuntimeError(f"{name} is already packed for its CPU kernel: dequantize before any forward")
        with torch.no_grad():
            weight = m.dequantize_weight(num_itr=m.g_idx.shape[0] // m.in_features).to(torch.float32).t().contiguous()
        lin = torch.nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, dtype=torch.float32)
        with torch.no_grad():
            lin.weight.copy_(weight)
            if m.bias is not None:
                lin.bias.copy_(m.bias.float())
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        setattr(parent, name.rpartition(".")[2], lin)
    return len(targets)

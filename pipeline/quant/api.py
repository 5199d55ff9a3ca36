"""The one entry point the quantize stage calls: one variant in, one complete checkpoint folder out."""
from __future__ import annotations

import importlib
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path

import torch

from pipeline.base.env import tame
from pipeline.base.errors import StageError
from pipeline.base.memory import PeakMemory
from pipeline.budget.formulas import GiB, quantize_peak
from pipeline.model.architecture import architecture_of
from pipeline.model.compute import describe as describe_compute
from pipeline.quant.common import calibration_fingerprint, captured_output
from pipeline.quant.defuser_scope import transformers_restored
from pipeline.quant.experts import count_experts, experts_problem
from pipeline.quant.registry import method_of

# library loggers whose lines go to the variant's log file rather than the console
ENGINE_LOGGERS = ("logbar", "gptqmodel", "tokenicer", "transformers", "bitsandbytes", "optimum", "autoround")


def quantize_variant(base_dir: Path, variant, calib_ids: torch.Tensor | None, out_dir: Path,
                     log: logging.Logger, seed: int, device: str | None = None,
                     memory_limit: int | None = None) -> dict:
    """Quantize the HF checkpoint in base_dir as `variant` into out_dir (config, safetensors, tokenizer,
    generation config, the engine's log). Returns the manifest fields. Writes nothing outside out_dir
    except library caches (torch extensions, HF). memory_limit ([run] max_memory_gb in bytes): a method that can
    stream the model from disk does so when the plan predicts the in-memory way would exceed it."""
    c = method_of(variant)
    base_dir, out_dir = Path(base_dir).resolve(), Path(out_dir).resolve()  # engines may chdir
    calibrated = c.calibrates(variant)
    if calibrated and calib_ids is None:
        raise StageError(f"variant {variant.name!r} ({c.name}) needs calibration ids; none were given")
    if calib_ids is not None and (calib_ids.dim() != 2 or calib_ids.dtype != torch.long):
        raise StageError(f"calibration ids must be a LongTensor [n_samples, seq_len], got "
                         f"{calib_ids.dtype} {list(calib_ids.shape)}")
    rows = getattr(variant, "calibration_rows", None)
    if rows is not None and calib_ids is not None:
        if rows > calib_ids.shape[0]:
            raise StageError(f"variant {variant.name!r}: calibration_rows = {rows} exceeds the {calib_ids.shape[0]} "
                             "calibration rows given")
        calib_ids = calib_ids[:rows]
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    out_dir.mkdir(parents=True, exist_ok=True)
    tame()
    log_name = f"{c.engine}.log"
    log.info("quantize %s: %s (%s) on %s; engine log: %s", variant.name, c.name, c.engine, device, log_name)
    offload = None
    if c.offload and device == "cpu" and memory_limit is not None:
        need = quantize_peak(base_dir, calib_ids, offload=False)
        if need > memory_limit:
            offload = Path(tempfile.mkdtemp(prefix=".offload-", dir=out_dir))
            log.info("quantize %s: the model in memory would need about %.1f GiB, over the %.1f GiB limit "
                     "([run] max_memory_gb): streaming it from disk one layer at a time (about %.1f GiB)", variant.name,
                     need / GiB, memory_limit / GiB, quantize_peak(base_dir, calib_ids, offload=True) / GiB)
    config = json.loads((base_dir / "config.json").read_text())
    with captured_output(out_dir / log_name, ENGINE_LOGGERS) as console:
        impl = implementation(variant)  # its engine imported here: import-time memory is not the variant's
        torch.manual_seed(seed)
        try:
            # GPTQModel patches transformers for the process: undone once its model is saved (defuser_scope.py)
            with PeakMemory() as mem, impl.session(out_dir), transformers_restored(config):
                t0 = time.perf_counter()
                calib = calib_ids if calibrated else None
                model = (impl.quantize(base_dir, variant, calib, console, device) if offload is None else
                         impl.quantize(base_dir, variant, calib, console, device, offload=offload))
                details = impl.save(model, base_dir, out_dir, variant)
                elapsed = time.perf_counter() - t0
        # the engine's, with its log named (libraries also assert their own preconditions)
        except (RuntimeError, ValueError, OSError, NotImplementedError, AssertionError) as e:
            raise StageError(f"quantize {variant.name}: {c.engine} failed: {type(e).__name__}: {e} "
                             f"(its log: {out_dir / log_name})") from e
        finally:
            if offload is not None:
                shutil.rmtree(offload, ignore_errors=True)
    log.info("quantize %s: done in %.1f s, peak memory +%.0f MiB", variant.name, elapsed, mem.above_start_bytes / 2**20)
    experts = details.get("experts") or count_experts(out_dir, architecture_of(config))
    if experts is not None and c.checkpoint_format != "gguf":  # a GGUF file counts its own (its work module)
        problem = experts_problem(experts)
        if problem is not None:
            raise StageError(f"quantize {variant.name}: {problem}")
        log.info("quantize %s: %d/%d routed expert linears stored quantized", variant.name, experts["quantized"],
                 experts["declared"])
        details["experts"] = experts
    return {
        "method": c.name, "params": variant.model_dump(mode="json"), **details, "device": device, "seed": seed,
        "compute": describe_compute(details.get("dtype"), device), "offloaded": offload is not None,
        "time_s": round(elapsed, 3), "peak_rss_above_baseline_bytes": mem.above_start_bytes,
        "calibration": calibration_fingerprint(calib_ids) if calibrated else None,
        "log": log_name,
    }


def implementation(variant):
    """The variant's method (pipeline/quant/methods/), its engine and its work module (pipeline/quant/work/)
    imported: session(out_dir) context, quantize(base_dir, variant, calib_ids, console, device) -> in-memory model,
    save(model, base_dir, out_dir, variant) -> manifest details. A missing engine is one line naming it."""
    m = method_of(variant)
    for spec in (*m.engine_modules, m.engine):
        try:
            importlib.import_module(spec)
        except ImportError as e:
            raise StageError(f"{spec} cannot be imported ({e}); install the project's dependencies "
                             "(pip install -e .)") from e
    m.load_work()
    return m

"""AutoRound (Cheng et al. 2023) through auto-round, exported in the GPTQ format (auto-round's `auto_gptq` export).

auto-round tunes, decoder block by decoder block, each weight's rounding offset (in [-0.5, 0.5]) and each group's
min/max clipping by signed gradient descent so that the quantized block reproduces the full-precision block's
outputs on the calibration text (the shared calibration ids, as they are: no dataset of its own). The export is
a GPTQ checkpoint (qweight/qzeros/scales/g_idx, `quant_method: gptq`), so transformers, GPTQModel and vLLM load it
with their GPTQ kernels, with the same kernel rules. auto-round writes into a subfolder it names itself; it runs in
a scratch folder inside out_dir and save() moves the checkpoint up.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import IO, Iterator, Literal, NamedTuple, Optional

from pydantic import Field

from pipeline.base.problem import Problem
from pipeline.quant.gptq_format import GPTQFormatMethod, lm_head_rule
from pipeline.quant.method import QuantMethod, missing_package
from pipeline.quant.shapes import Arch
from pipeline.quant.variant import Calibrated, GPTQFormat
from pipeline.model.dtypes import torch_dtype

ENGINE = "auto_round"
EXPORT_FORMAT = "auto_gptq"
AUTOROUND_PIN = "auto-round==0.16.1"
_SCRATCH = ".autoround-"


class AutoRoundVariant(Calibrated, GPTQFormat):
    """AutoRound through auto-round: per block, the rounding offsets and the min/max clipping are tuned by signed
    gradient descent to reproduce the block's full-precision outputs on the calibration text; GPTQ format."""

    method: Literal["autoround"]
    iters: int = Field(200, ge=0, description="tuning steps per decoder block (auto-round's default 200; 0 = its "
                                              "optimized RTN)")
    lr: Optional[float] = Field(None, gt=0, description="learning rate of the signed gradient steps; None = 1/iters")
    batch_size: int = Field(8, ge=1, description="calibration rows per tuning step (at most num_samples)")
    torch_compile: bool = Field(True, description="torch.compile auto-round's tuning step (its own option, on by "
                                                  "default on Linux): on a CPU it needs a C++ compiler (g++, or "
                                                  "$CXX); a SmolLM2 block of 200 one-row steps: 11.5 s against 32 s "
                                                  "eager on 2 cores. Compiled kernels round differently, so the "
                                                  "bytes differ from false")


class AutoRoundMethod(GPTQFormatMethod, QuantMethod):
    name = "autoround"
    variant = AutoRoundVariant
    engine = ENGINE
    hub_tag_names = ("autoround", "gptq")  # a GPTQ-format checkpoint: found under both tags
    made = " (tuned by auto-round, exported in the GPTQ format)"
    made_by = " (tuned by auto-round)"
    dtypes = ("float32", "bfloat16", "float16")
    needs_calibration = True
    note = ("AutoRound (Cheng et al. 2023): rounding and min/max tuned by signed gradient descent per block, "
            "through auto-round; GPTQ checkpoint format")

    def check(self, variant, arch: Arch, device: str) -> list[Problem]:
        problems = missing_package(AUTOROUND_PIN, "auto_round", "autoround") + lm_head_rule(variant, "AutoRound")
        problems += super().check(variant, arch, device)  # the checkpoint format's rules (gptq_format.py)
        if variant.bits == 8 and not variant.sym:
            problems.append(Problem("sym", "autoround-asymmetric-8-bit",
                                    "bits = 8 with sym = false: auto-round refuses to export asymmetric 8-bit in the "
                                    "GPTQ format; set sym = true"))
        if variant.torch_compile and device == "cpu" and cpp_compiler() is None:
            problems.append(Problem("torch_compile", "autoround-no-cpp-compiler",
                                    "torch_compile = true: torch.compile on a CPU builds C++ kernels, and no C++ "
                                    f"compiler was found ({os.environ.get('CXX') or 'g++'} not on PATH): install one "
                                    "(apt install g++) or set torch_compile = false (about 2.8x slower on a CPU)"))
        return problems

    def session(self, out_dir: Path):
        return session(out_dir)

    def quantize(self, base_dir: Path, variant, calib_ids, console: IO[str], device: str, offload: Path | None = None):
        return tune(base_dir, variant, calib_ids, console, device)

    def save(self, model, base_dir: Path, out_dir: Path, variant) -> dict:
        return finish(model, base_dir, out_dir, variant)


def cpp_compiler() -> str | None:
    """The compiler torch inductor would call on a CPU ($CXX, else g++), or None if it is not on PATH."""
    return shutil.which(os.environ.get("CXX") or "g++")


def _engine_version() -> str:
    # late: torch and the engine load only to quantize; `compress check` imports this file for its declarations
    import auto_round

    return auto_round.__version__


@contextlib.contextmanager
def session(out_dir: Path) -> Iterator[None]:
    """cwd in a scratch folder inside out_dir (auto-round writes relative paths), removed on exit."""
    scratch = Path(tempfile.mkdtemp(prefix=_SCRATCH, dir=out_dir))
    try:
        with contextlib.chdir(scratch):
            yield
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


class Tuned(NamedTuple):
    folder: Path  # auto-round's export, in the scratch folder
    torch_compile: bool  # whether the tuning step was compiled


def compiles(variant, dtype: str, device: str) -> bool:
    """Whether auto-round's tuning step is torch.compile'd: as the variant asks, except where float32_matmuls
    upcasts half-precision matmuls (a CPU without bf16/fp16 units): its torch function mode and swapped F.linear
    have not been tried under dynamo, so that path stays eager (the manifest's torch_compile says which ran)."""
    # late: torch and the engine load only to quantize; `compress check` imports this file for its declarations
    from pipeline.model.compute import upcasts

    return variant.torch_compile and not upcasts(dtype, device)


def tune(base_dir: Path, variant, calib_ids, console: IO[str], device: str) -> Tuned:
    """Tune and export into a scratch folder (finish() moves it into out_dir)."""
    # late: torch and the engine load only to quantize; `compress check` imports this file for its declarations
    import torch
    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.model.compute import float32_matmuls
    from pipeline.quant.common import base_dtype, skipped_linears

    dtype = variant.dtype or base_dtype(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch_dtype(dtype), device_map={"": device})
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    n, seq_len = calib_ids.shape
    compiled = compiles(variant, dtype, device)
    layer_config = {name: {"bits": 16} for name in skipped_linears(base_dir, variant.modules_to_skip)
                    if name != "lm_head"}
    ar = AutoRound(model, tokenizer=tokenizer, scheme="W4A16", bits=variant.bits, group_size=variant.group_size,
                   sym=variant.sym, iters=variant.iters, lr=variant.lr, nsamples=n, seqlen=seq_len,
                   batch_size=min(variant.batch_size, n), dataset=[row.unsqueeze(0) for row in calib_ids],
                   layer_config=layer_config or None, device_map=device, seed=torch.initial_seed(),
                   enable_torch_compile=compiled)
    export = Path(tempfile.mkdtemp(prefix="export-", dir=Path.cwd()))
    with _block_bar_on(console), float32_matmuls(dtype, device):  # pipeline/model/compute.py
        ar.quantize_and_save(str(export), format=EXPORT_FORMAT)
    return Tuned(_checkpoint_folder(export), compiled)


@contextlib.contextmanager
def _block_bar_on(console: IO[str]) -> Iterator[None]:
    """auto-round's per-block tqdm bar (it names the block being tuned) drawn on the console instead of into the
    engine log, where every other line of the library goes."""
    # late: torch and the engine load only to quantize; `compress check` imports this file for its declarations
    from unittest import mock  # (unittest.mock imports asyncio: tens of ms on every check)

    import auto_round.compressors.orchestrator as orchestrator

    real = getattr(orchestrator, "tqdm", None)
    if real is None:  # another auto-round layout: its bar stays in the log
        yield
        return

    def bar(*args, **kwargs):
        return real(*args, **{**kwargs, "file": console, "unit": "block", "mininterval": 0.5, "dynamic_ncols": True})

    with mock.patch.object(orchestrator, "tqdm", bar):
        yield


def _checkpoint_folder(export: Path) -> Path:
    found = sorted(p.parent for p in export.rglob("config.json"))
    if len(found) != 1:
        raise RuntimeError(f"auto-round's export in {export} holds {len(found)} checkpoints, expected one")
    return found[0]


def finish(tuned: Tuned, base_dir: Path, out_dir: Path, variant) -> dict:
    # late: torch and the engine load only to quantize; `compress check` imports this file for its declarations
    from pipeline.quant.common import base_dtype, finish_checkpoint
    from pipeline.quant.gptqmodel_driver import quantized_in_blocks

    for f in tuned.folder.glob("*.safetensors*"):
        shutil.move(str(f), out_dir / f.name)
    qc = json.loads((tuned.folder / "config.json").read_text())["quantization_config"]
    extra = {}
    if variant.format == "compressed-tensors":  # the same integers, rewritten (pipeline/quant/ct_export.py)
        # late: torch and the engine load only to quantize; `compress check` imports this file for its declarations
        from pipeline.quant.ct_export import rewrite_in_place

        shutil.copyfile(tuned.folder / "config.json", out_dir / "config.json")
        extra["gptq_config"], qc = qc, rewrite_in_place(out_dir)
    elif any(e != "lm_head" for e in variant.modules_to_skip):  # as for GPTQ: the names transformers must quantize
        qc["modules_in_block_to_quantize"] = quantized_in_blocks(out_dir)
    dtype = variant.dtype or base_dtype(base_dir)
    finish_checkpoint(base_dir, out_dir, qc, dtype)
    return {"engine": ENGINE, "engine_version": _engine_version(), "engine_config": qc, "dtype": dtype,
            "torch_compile": tuned.torch_compile, **extra}


METHODS = (AutoRoundMethod(),)

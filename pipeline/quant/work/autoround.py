"""AutoRound's work (pipeline/quant/methods/autoround.py): tune with auto-round in a scratch folder, export in the
GPTQ format, move the checkpoint into out_dir."""
from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, NamedTuple
from unittest import mock  # (unittest.mock imports asyncio: tens of ms, here only, never on `compress check`)

import auto_round
import auto_round.compressors.orchestrator as orchestrator
import torch
from auto_round import AutoRound
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.base.fileio import atomic_write_json
from pipeline.model.compute import float32_matmuls, upcasts
from pipeline.model.dtypes import torch_dtype
from pipeline.quant.common import base_dtype, finish_checkpoint, quantized_in_blocks, skipped_linears
from pipeline.quant.formats.ct_export import linear_settings, rewrite_in_place
from pipeline.quant.methods.autoround import ENGINE
from pipeline.quant.mix.config import mix_units
from pipeline.quant.mix.plan import cache_beside, plan, summary
from pipeline.quant.shapes import linear_shapes_from_config

EXPORT_FORMAT = "auto_gptq"
_SCRATCH = ".autoround-"


def _engine_version() -> str:
    return auto_round.__version__


@contextlib.contextmanager
def session(out_dir: Path) -> Iterator[None]:
    """cwd in a scratch folder inside out_dir (auto-round writes relative paths), removed on exit; a [quantize.mix]
    sensitivity table is cached beside the variants' folders, as for GPTQ."""
    scratch = Path(tempfile.mkdtemp(prefix=_SCRATCH, dir=out_dir))
    try:
        with contextlib.chdir(scratch), cache_beside(out_dir):
            yield
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


class Tuned(NamedTuple):
    folder: Path  # auto-round's export, in the scratch folder
    torch_compile: bool  # whether the tuning step was compiled
    mix: dict | None = None  # the [quantize.mix] allocation record (pipeline/quant/mix/plan.py)


def mix_layer_config(base_dir: Path, variant, mix: dict) -> dict[str, dict]:
    """auto-round's layer_config for the allocation: each mixed linear's bits and group size."""
    arch = linear_shapes_from_config(json.loads((base_dir / "config.json").read_text()))
    units = mix_units(arch, variant.modules_to_skip, variant.mix.granularity)
    return {name: dict(mix["allocation"][u.name]) for u in units for name, _, _ in u.modules}


def compiles(variant, dtype: str, device: str) -> bool:
    """Whether auto-round's tuning step is torch.compile'd: as the variant asks, except where float32_matmuls
    upcasts half-precision matmuls (a CPU without bf16/fp16 units): its torch function mode and swapped F.linear
    have not been tried under dynamo, so that path stays eager (the manifest's torch_compile says which ran)."""
    return variant.torch_compile and not upcasts(dtype, device)


def quantize(base_dir: Path, variant, calib_ids, console: IO[str], device: str, offload: Path | None = None) -> Tuned:
    """Tune and export into a scratch folder (save() moves it into out_dir)."""
    dtype = variant.dtype or base_dtype(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch_dtype(dtype), device_map={"": device})
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    n, seq_len = calib_ids.shape
    compiled = compiles(variant, dtype, device)
    layer_config = {name: {"bits": 16} for name in skipped_linears(base_dir, variant.modules_to_skip)
                    if name != "lm_head"}
    mix = plan(base_dir, variant, calib_ids, console) if variant.mix is not None else None
    if mix is not None:
        layer_config.update(mix_layer_config(base_dir, variant, mix))
    ar = AutoRound(model, tokenizer=tokenizer, scheme="W4A16", bits=variant.bits, group_size=variant.group_size,
                   sym=variant.sym, iters=variant.iters, lr=variant.lr, nsamples=n, seqlen=seq_len,
                   batch_size=min(variant.batch_size, n), dataset=[row.unsqueeze(0) for row in calib_ids],
                   layer_config=layer_config or None, device_map=device, seed=torch.initial_seed(),
                   enable_torch_compile=compiled)
    export = Path(tempfile.mkdtemp(prefix="export-", dir=Path.cwd()))
    with _block_bar_on(console), float32_matmuls(dtype, device):  # pipeline/model/compute.py
        ar.quantize_and_save(str(export), format=EXPORT_FORMAT)
    return Tuned(_checkpoint_folder(export), compiled, mix)


@contextlib.contextmanager
def _block_bar_on(console: IO[str]) -> Iterator[None]:
    """auto-round's per-block tqdm bar (it names the block being tuned) drawn on the console instead of into the
    engine log, where every other line of the library goes."""
    real = getattr(orchestrator, "tqdm", None)
    if real is None:  # another auto-round layout: its bar stays in the log
        yield
        return

    def bar(*args, **kwargs):
        return real(*args, **{**kwargs, "file": console, "unit": "block", "mininterval": 0.5, "dynamic_ncols": True})

    with mock.patch.object(orchestrator, "tqdm", bar):
        yield


def own_overrides(qc: dict, ours: dict, folder: Path) -> dict:
    """`ours` (the allocation's GPTQModel overrides, pipeline/quant/mix/config.py) in place of auto-round's per-layer
    ones, after checking that both give every quantized linear of the export the same bits and group size."""
    names = []
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            names += [k.removesuffix(".qweight") for k in st.keys() if k.endswith(".qweight")]  # noqa: SIM118
    theirs = linear_settings(qc, names)
    mine = linear_settings({**qc, "dynamic": ours}, names)
    differ = [n for n in names if theirs[n] != mine[n]]
    if differ:
        raise RuntimeError(f"auto-round's export and the allocation disagree on {len(differ)} linears, e.g. "
                           f"{differ[0]}: {theirs[differ[0]]} against {mine[differ[0]]}")
    return ours


def _checkpoint_folder(export: Path) -> Path:
    found = sorted(p.parent for p in export.rglob("config.json"))
    if len(found) != 1:
        raise RuntimeError(f"auto-round's export in {export} holds {len(found)} checkpoints, expected one")
    return found[0]


def save(tuned: Tuned, base_dir: Path, out_dir: Path, variant) -> dict:
    for f in tuned.folder.glob("*.safetensors*"):
        shutil.move(str(f), out_dir / f.name)
    qc = json.loads((tuned.folder / "config.json").read_text())["quantization_config"]
    extra = {}
    if tuned.mix is not None:  # our overrides, which vLLM also finds under its fused names; checked equal first
        qc = {**qc, "dynamic": own_overrides(qc, tuned.mix["dynamic"], tuned.folder)}
        (tuned.folder / "config.json").write_text(json.dumps(
            {**json.loads((tuned.folder / "config.json").read_text()), "quantization_config": qc}, indent=2))
        atomic_write_json(out_dir / "mix.json", tuned.mix)
        extra["mix"] = summary(tuned.mix)
    if variant.format == "compressed-tensors":  # the same integers, rewritten (pipeline/quant/formats/ct_export.py)
        shutil.copyfile(tuned.folder / "config.json", out_dir / "config.json")
        extra["gptq_config"], qc = qc, rewrite_in_place(out_dir)
    elif any(e != "lm_head" for e in variant.modules_to_skip):  # as for GPTQ: the names transformers must quantize
        qc["modules_in_block_to_quantize"] = quantized_in_blocks(out_dir)
    dtype = variant.dtype or base_dtype(base_dir)
    finish_checkpoint(base_dir, out_dir, qc, dtype)
    return {"engine": ENGINE, "engine_version": _engine_version(), "engine_config": qc, "dtype": dtype,
            "torch_compile": tuned.torch_compile, **extra}

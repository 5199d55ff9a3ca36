"""A mixed-precision GPTQ variant's plan: its units and candidates (pipeline/quant/mix/config.py), their measured
sensitivity (pipeline/quant/mix/sensitivity.py, cached beside the quantize units), the exact allocation within the
budget (pipeline/quant/mix/alloc.py), and the GPTQModel `dynamic` overrides that carry it into the checkpoint; then
the record written beside the checkpoint (mix.json) and into the report."""
from __future__ import annotations

import contextlib
import contextvars
import json
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from pipeline.base.errors import StageError
from pipeline.quant.methods.gptq import act_group_aware
from pipeline.quant.mix.alloc import allocate
from pipeline.quant.mix.config import (
    Layout,
    MixConfig,
    bits_per_weight,
    budget_bytes,
    dynamic_overrides,
    mix_units,
    unit_cost,
)
from pipeline.quant.mix.sensitivity import Solver, measure
from pipeline.quant.shapes import linear_shapes_from_config

CACHE_DIR = ".mix-sensitivity"  # beside the variants' folders: artifacts/<run>/quantize/.mix-sensitivity/<key>.json
_cache_dir: contextvars.ContextVar[Path | None] = contextvars.ContextVar("mix_cache_dir", default=None)


@contextlib.contextmanager
def cache_beside(out_dir: Path) -> Iterator[None]:
    """While a variant is quantized into out_dir, sensitivity tables are cached in its parent's CACHE_DIR."""
    token = _cache_dir.set(Path(out_dir).parent / CACHE_DIR)
    try:
        yield
    finally:
        _cache_dir.reset(token)


def sensitivity_cache_dir() -> Path | None:
    """Where the variant being quantized caches sensitivity tables (cache_beside), or None."""
    return _cache_dir.get()


def plan(base_dir: Path, variant, calib_ids, console: IO[str]) -> dict:
    """The allocation record of a variant with [quantize.mix] (see the module docstring); record["dynamic"] goes into
    GPTQModel's QuantizeConfig."""
    mix: MixConfig = variant.mix
    arch = linear_shapes_from_config(json.loads((base_dir / "config.json").read_text()))
    if not arch.shapes_known:
        raise StageError(f"[quantize.mix] needs the model's linear shapes; {arch.model_type!r} is not a known family")
    units = mix_units(arch, variant.modules_to_skip, mix.granularity)
    cands = mix.candidates(variant.group_size)

    def say(line: str) -> None:
        console.write(f"{variant.name}: {line}\n")
        console.flush()

    solver = (Solver(mix.probe_weights, variant.sym, variant.damp_percent, variant.mse, act_group_aware(variant),
                     variant.desc_act) if mix.probe_weights == "gptq" else Solver("rtn", variant.sym))
    sens = measure(base_dir, calib_ids, units, cands, mix.probe_rows, mix.hessian_rows, solver, arch.layers,
                   _cache_dir.get(), say, mix.probe_group_size(variant.group_size))
    layout = Layout.of(variant)  # what the written checkpoint stores (format, zero points)
    cost = [[unit_cost(u, b, g, layout) for b, g in cands] for u in units]
    budget = budget_bytes(mix.budget, units)
    try:
        a = allocate(cost, sens["hessian" if mix.estimator == "hessian" else "kl"], budget)
    except ValueError as e:
        raise StageError(f"quantize {variant.name}: mix allocation: {e}") from e
    choice = [cands[j] for j in a.choice]
    say(f"allocation: {bits_per_weight(a.cost, units):.3f} bits per weight spent of "
        f"{bits_per_weight(budget, units):.3f} budgeted")
    predicted = {k: sum(sens[k][u][j] for u, j in enumerate(a.choice)) for k in ("kl", "hessian")}
    uniform = {f"w{b}g{g}": {k: sum(row[j] for row in sens[k]) for k in ("kl", "hessian")}
               for j, (b, g) in enumerate(cands)}
    return {
        "granularity": mix.granularity, "estimator": mix.estimator, "candidates": cands,
        "budget": {"bytes": budget, "bits_per_weight": round(bits_per_weight(budget, units), 4),
                   **mix.budget.model_dump(exclude_none=True)},
        "spent": {"bytes": a.cost, "bits_per_weight": round(bits_per_weight(a.cost, units), 4)},
        "allocation": {u.name: {"bits": b, "group_size": g} for u, (b, g) in zip(units, choice, strict=True)},
        "predicted": predicted, "predicted_uniform": uniform,
        "solver": {"kind": "dynamic program (multiple-choice knapsack)", "resolution_bytes": a.resolution_bytes,
                   "exact": a.exact},
        "sensitivity": {k: sens[k] for k in ("key", "units", "kl", "hessian", "probe", "time_s", "cached")},
        "dynamic": dynamic_overrides(units, choice, arch.layers, (variant.bits, variant.group_size)),
    }


def summary(record: dict) -> dict:
    """What the report keeps of a record (the tables stay in mix.json)."""
    sens = record["sensitivity"]
    return {**{k: v for k, v in record.items() if k not in ("sensitivity", "dynamic")},
            "sensitivity_time_s": sens["time_s"], "sensitivity_cached": sens["cached"], "probe": sens["probe"]}

"""Questions every reader of a report asks, answered once: the model rows, a variant's shown
settings, whether a draft was distilled."""
from __future__ import annotations

from typing import Any

from pipeline.base.stage_keys import UnitKey
from pipeline.results.schema import DraftEntry, ModelEntry, Report


def models(report: Report) -> list[tuple[str, ModelEntry]]:
    """("baseline", baseline) then each variant: the rows of the quality, size and speed tables."""
    rows = [("baseline", report.baseline)] if report.baseline is not None else []
    return rows + list(report.variants.items())


OFF_VALUES = {"gptaq_alpha": 0, "foem_beta": 0, "moe_all_experts": False}  # optional features: shown only when on


def shown_params(p: Any, hide: tuple[str, ...] = ("name", "method")) -> dict:
    """A variant's settings worth showing (report table, model card): set, and not an optional feature left off."""
    if not isinstance(p, dict):
        return {}
    return {k: v for k, v in p.items()
            if k not in hide and v is not None and not (k in OFF_VALUES and v == OFF_VALUES[k])}


def is_distilled(draft: DraftEntry | ModelEntry | None) -> bool:
    """Whether a draft's report entry says it was distilled ([draft.distill] steps = 0 uses it as initialised)."""
    distill = getattr(draft, "distill", None)
    return distill is None or distill.steps != 0


def planned(by_stage: dict, key: str):
    """The plan's value for a run stage: its own figure (UnitKey.plan_key: the plan names a model's quality unit
    "validate/<model>", pipeline/estimate.py)."""
    if key in by_stage:
        return by_stage[key]
    return by_stage.get(UnitKey.parse(key).plan_key)

"""A recipe's units in run order: what `compress run` executes, locally or as Ray tasks (pipeline/app/ray_executor.py
rebuilds them from the recipe on each worker)."""
from __future__ import annotations

from pipeline.base.unit import Unit
from pipeline.plan import stage_names
from pipeline.stages import calibrate, draft, export, load, quantize, validate
from pipeline.stages.kinds import Calibrate


def build_units(recipe) -> tuple[list[Unit], list[Unit]]:
    """(units up to validate, export units). Gates are applied between the two."""
    units = [load.unit(recipe)]
    if Calibrate.key() in stage_names(recipe):
        units.append(calibrate.unit(recipe))
    units += quantize.units(recipe)
    if recipe.draft is not None:
        units.append(draft.unit(recipe))
    val = validate.units(recipe)
    return units + val, export.units(recipe, [u.key for u in val])

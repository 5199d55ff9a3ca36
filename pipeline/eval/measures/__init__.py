"""The one list of plug-in measurements and what the generic code asks of them. Torch-free.

Each is a `Measurement` (pipeline/eval/measures/base.py) in pipeline/eval/measures/<name>.py, with
`MEASUREMENTS = (YourMeasurement(),)`; its name in pipeline/base/stage_keys.py MEASUREMENTS (the unit grammar, which
the layers below this one read too) imports it here, in that order.
"""
from __future__ import annotations

import importlib
from typing import Any

from pydantic import BaseModel, create_model

from pipeline.base.registry import Registry
from pipeline.base.stage_keys import MEASUREMENTS as NAMES
from pipeline.eval.measures.base import BASELINE, Measurement

PACKAGE = "pipeline.eval.measures"
MEASUREMENTS: Registry[Measurement] = Registry("measurement")
for _name in NAMES:
    for _measurement in importlib.import_module(f"{PACKAGE}.{_name}").MEASUREMENTS:
        MEASUREMENTS.register(_measurement.key)(_measurement)


def all_measurements() -> list[Measurement]:
    """The registered measurements, in MEASUREMENTS' order."""
    return [MEASUREMENTS.get(n) for n in NAMES if n in MEASUREMENTS]


def extend(model: type[BaseModel], fields: dict[str, tuple[Any, Any]]) -> type[BaseModel]:
    """`model` with the fields it does not type yet appended (same name and module; a field without a type: any
    value); `model` itself when it has them all. A field it types already must be the declared one when one is
    declared (two owners that disagree are refused at import)."""
    for name, (annotation, _) in fields.items():
        got = model.model_fields.get(name)
        if got is not None and annotation is not None and got.annotation != annotation:
            raise TypeError(f"{model.__name__}.{name} is {got.annotation}; a measurement declares {annotation}")
    new = {n: (Any if a is None else a, d) for n, (a, d) in fields.items() if n not in model.model_fields}
    if not new:
        return model
    return create_model(model.__name__, __base__=model, __module__=model.__module__, **new)  # type: ignore[call-overload]


def tables() -> dict[str, tuple[Any, Any]]:
    """The [validate] fields of the measurements' tables: {field: (table, its default)}."""
    return {m.table_field: (m.table, m.table()) for m in all_measurements()}


def sections() -> dict[str, tuple[Any, Any]]:
    """ModelEntry's fields that the measurements fill: {field: (its declared type or None, None)}."""
    return {f: (m.section.get(f), None) for m in all_measurements() for f in m.fields}


__all__ = ["BASELINE", "MEASUREMENTS", "Measurement", "all_measurements", "extend", "sections", "tables"]

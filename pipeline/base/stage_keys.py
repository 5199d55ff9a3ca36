"""Unit keys: the names of a run's units, which are also their folders in the run folder and their report.stages
entries. One grammar, built and parsed here only:

    load | calibrate | draft | quantize/<variant> | export/<name>
    validate/<model>/quality | speed | tasks | serve/<engine>      validate/draft/speculative

Pure (no imports from the rest of the package) so that results/ (the report's merge and render) can parse keys
below the stages, which build them (pipeline/stages/: one class per unit kind, using UnitKey). A key that is not in
the grammar is refused with UnitKeyError naming what is wrong, never matched to nothing.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass

SINGLE = ("load", "calibrate", "draft")  # one unit, no name
NAMED = ("quantize", "export")  # one unit per variant / export
VALIDATE = "validate"
STAGES = ("load", "calibrate", "quantize", "draft", VALIDATE, "export")
# the measurements that are plug-ins: each is one declaration, pipeline/eval/measures/<name>.py (a Measurement,
# pipeline/eval/measures/base.py); the registry (pipeline/eval/measures/__init__.py) imports them in this order
MEASUREMENTS = ("tasks",)
MEASURES = ("quality", "speed", *MEASUREMENTS, "serve", "speculative")  # validate/<model>/<measure>
DRAFT = "draft"  # the model validate/draft/speculative measures
GRAMMAR = ("load | calibrate | draft | quantize/<variant> | export/<name> | validate/<model>/quality|speed|tasks | "
           "validate/<model>/serve/<engine> | validate/draft/speculative")


class UnitKeyError(ValueError):
    """A unit key outside the grammar (a typo in code that builds or reads one)."""


def _near(word: str, choices) -> str:
    close = difflib.get_close_matches(word, choices, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


@dataclass(frozen=True)
class UnitKey:
    stage: str
    name: str | None = None  # quantize: the variant; export: the export; validate: the model measured
    measure: str | None = None  # validate only: one of MEASURES
    engine: str | None = None  # validate/<model>/serve/<engine> only

    def __post_init__(self) -> None:
        problem = self._problem()
        if problem:
            raise UnitKeyError(f"unit key {'/'.join(p for p in self.parts() if p is not None)!r}: {problem}; "
                               f"unit keys are {GRAMMAR}")

    def parts(self) -> tuple:
        return (self.stage, self.name, self.measure, self.engine)

    def _problem(self) -> str | None:
        if self.stage not in STAGES:
            return f"unknown stage {self.stage!r}{_near(self.stage, STAGES)}"
        if any(p == "" or (p is not None and "/" in p) for p in self.parts()):
            return "every part must be a non-empty name without '/'"
        if self.stage in SINGLE:
            return None if self.name is self.measure is self.engine is None else f"{self.stage} takes no name"
        if self.stage in NAMED:
            if self.name is None or self.measure is not None or self.engine is not None:
                return f"{self.stage} takes exactly one name: {self.stage}/<name>"
            return None
        if self.name is None or self.measure is None:
            return "validate takes a model and a measurement: validate/<model>/<measurement>"
        if self.measure not in MEASURES:
            return f"unknown measurement {self.measure!r}{_near(self.measure, MEASURES)}"
        if (self.measure == "serve") != (self.engine is not None):
            return "only serve names an engine: validate/<model>/serve/<engine>"
        if (self.measure == "speculative") != (self.name == DRAFT):
            return "the speculative measurement is validate/draft/speculative, and only it measures the draft"
        return None

    def __str__(self) -> str:
        return "/".join(p for p in self.parts() if p is not None)

    @classmethod
    def parse(cls, key: str) -> UnitKey:
        """The key's parts; UnitKeyError when it is not a unit key."""
        parts = str(key).split("/")
        if len(parts) > 4:
            raise UnitKeyError(f"unit key {key!r}: too many parts; unit keys are {GRAMMAR}")
        return cls(*parts)

    @property
    def plan_key(self) -> str:
        """The key of this unit's own figure in `compress check`'s plan (pipeline/estimate.py): the plan names a
        model's quality unit "validate/<model>" (that model's measurement); every other unit by its key."""
        return f"{VALIDATE}/{self.name}" if self.measure == "quality" else str(self)


def model_plan_key(model: str) -> str:
    """The plan's figure for measuring one model (its quality unit): "validate/<model>"."""
    return UnitKey(VALIDATE, model, "quality").plan_key

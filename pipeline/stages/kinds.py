"""One class per unit kind: its keys (built and parsed through pipeline/base/stage_keys.py, the grammar results/ reads
too), the plan figure that predicts its memory (pipeline/estimate.py writes the plan with these keys) and what it asks
of a Ray cluster. `kind_of(key)` finds the class of any key (UnitKeyError for a key outside the grammar);
plan.py, estimate.py and app/ ask it instead of matching key strings. The stage modules beside this one build the
units with these keys.

Kept apart from the stage modules on purpose: a unit's identity is the code it imports (pipeline/base/codehash.py),
so a stage that names another's key imports this small module, not the other stage's code."""
from __future__ import annotations

from typing import ClassVar

from pipeline.base.stage_keys import DRAFT, MEASUREMENTS, VALIDATE, UnitKey, UnitKeyError, model_plan_key


def _part(part: str | None) -> str:
    """A key part the grammar requires for the key's kind (UnitKey refuses a key without it)."""
    assert part is not None
    return part


class Stage:
    """A unit kind. Subclasses set `stage` (the key's first part) and, for validate's kinds, `measure`."""

    stage: ClassVar[str]
    measure: ClassVar[str | None] = None
    # Ray: a node of its own (never co-scheduled), for units whose figures are timings the gates read
    exclusive: ClassVar[bool] = False

    @classmethod
    def owns(cls, key: UnitKey) -> bool:
        return key.stage == cls.stage and key.measure == cls.measure

    @classmethod
    def parse(cls, key: str | UnitKey) -> UnitKey:
        """The key's parts; UnitKeyError when it is not a key of this kind."""
        k = key if isinstance(key, UnitKey) else UnitKey.parse(key)
        if not cls.owns(k):
            raise UnitKeyError(f"unit key {str(k)!r} is not a {cls.__name__} key")
        return k

    @classmethod
    def memory_keys(cls, key: UnitKey) -> tuple[str, ...]:
        """The entries of `compress check`'s plan.memory (pipeline/estimate.py) that predict this unit's peak, the
        first one present wins: by default its own figure."""
        return (key.plan_key,)

    @classmethod
    def planned_memory(cls, memory: dict, key: UnitKey) -> int | None:
        """This unit's predicted peak from plan.memory; None when the plan has no figure for it."""
        return next((memory[k] for k in (str(key),) + cls.memory_keys(key) if k in memory), None)


class Single(Stage):
    """A stage with one unit, keyed by the stage's name (load, calibrate, draft)."""

    @classmethod
    def key(cls) -> str:
        return str(UnitKey(cls.stage))


class Named(Stage):
    """A stage with one unit per name (quantize/<variant>, export/<name>)."""

    @classmethod
    def key(cls, name: str) -> str:
        return str(UnitKey(cls.stage, name))

    @classmethod
    def name_of(cls, key: str | UnitKey) -> str:
        return _part(cls.parse(key).name)


class Load(Single):
    """load: the model written once into the run folder."""

    stage = "load"


class Calibrate(Single):
    """calibrate: the calibration token windows every variant that needs them shares."""

    stage = "calibrate"


class Quantize(Named):
    """quantize/<variant>: one [[quantize]] variant's weights."""

    stage = "quantize"


class Draft(Single):
    """draft: the draft model, distilled against [draft].verifier."""

    stage = "draft"


class Export(Named):
    """export/<name>: one publishable folder (the baseline, a variant, the draft)."""

    stage = "export"


class Measure(Stage):
    """validate/<model>/<measure>: one measurement of one model (baseline or variant) in a fresh process. Without a
    figure of its own in the plan, a unit asks for its model's ("validate/<model>", the quality unit's): it loads
    the same checkpoint."""

    stage = VALIDATE

    @classmethod
    def key(cls, model: str) -> str:
        return str(UnitKey(cls.stage, model, cls.measure))

    @classmethod
    def model_of(cls, key: str | UnitKey) -> str:
        return _part(cls.parse(key).name)

    @classmethod
    def memory_keys(cls, key: UnitKey) -> tuple[str, ...]:
        return (key.plan_key, model_plan_key(_part(key.name)))


class Quality(Measure):
    """validate/<model>/quality: perplexity, KL and top-1 against the baseline, the smoke test."""

    measure = "quality"

    @staticmethod
    def plan_key(model: str) -> str:
        """The plan's figure for measuring `model`: "validate/<model>" (pipeline/estimate.py)."""
        return model_plan_key(model)


class Speed(Measure):
    """validate/<model>/speed: timings the gates read, so a node of its own; its own figure in the plan."""

    measure = "speed"
    exclusive = True


class Serve(Measure):
    """validate/<model>/serve/<engine>: the model served by one engine; throughput the gates read, so a node of its
    own."""

    measure = "serve"
    exclusive = True

    @classmethod
    def key(cls, model: str, engine: str) -> str:  # type: ignore[override]
        return str(UnitKey(cls.stage, model, cls.measure, engine))

    @classmethod
    def engine_of(cls, key: str | UnitKey) -> str:
        return _part(cls.parse(key).engine)


class Speculative(Measure):
    """validate/draft/speculative: acceptance and speed-up of the draft with its verifier; the speed-up is a timing
    the gates read, so a node of its own. It holds the verifier and the draft, as the draft unit does: without a
    figure of its own, it asks for the draft's."""

    measure = "speculative"
    exclusive = True

    @classmethod
    def key(cls, model: str = DRAFT) -> str:
        return str(UnitKey(cls.stage, model, cls.measure))

    @classmethod
    def memory_keys(cls, key: UnitKey) -> tuple[str, ...]:
        return (str(key), Draft.key())


def plugin_kind(name: str) -> type[Measure]:
    """validate/<model>/<name> of a plug-in measurement (pipeline/eval/measures/<name>.py, which declares the rest):
    a Measure named by its key alone. Its declaration is not imported here: every stage imports this module, and
    a producing stage's identity holds no measuring code (tests/unit/test_stage_identity.py)."""
    return type(name.title().replace("_", ""), (Measure,), {"measure": name, "__module__": __name__,
                                                          "__doc__": f"validate/<model>/{name}: a plug-in measurement"})


PLUGINS: dict[str, type[Measure]] = {name: plugin_kind(name) for name in MEASUREMENTS}
KINDS: tuple[type[Stage], ...] = (Load, Calibrate, Quantize, Draft, Quality, Speed, *PLUGINS.values(), Serve,
                                  Speculative, Export)
_BY_PARTS = {(k.stage, k.measure): k for k in KINDS}


def kind_of(key: str | UnitKey) -> type[Stage]:
    """The class of a unit key; UnitKeyError (naming what is wrong) for a key outside the grammar."""
    k = key if isinstance(key, UnitKey) else UnitKey.parse(key)
    return _BY_PARTS[(k.stage, k.measure)]

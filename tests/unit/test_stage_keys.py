"""Unit keys have one owner: pipeline/base/stage_keys.py (the grammar) and pipeline/stages/kinds.py (one class per
unit kind: its keys, its plan figure, its Ray policy). A mistyped key is refused, never matched to nothing."""
from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.base.stage_keys import UnitKey, UnitKeyError
from pipeline.recipe import load_recipe
from pipeline.stages import kinds
from pipeline.stages.kinds import (Calibrate, Draft, Export, Load, Quality, Quantize, Serve, Speculative, Speed,
                                   kind_of)

Tasks = kinds.PLUGINS["tasks"]  # a plug-in measurement's kind (pipeline/eval/measures/tasks.py declares the rest)

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny.toml"
ALL_ON = ["validate.speed.enabled=true", "validate.serve.enabled=true", "validate.tasks.enabled=true",
          'validate.tasks.tasks=["arc_easy"]']


@pytest.mark.parametrize("key, says", [
    ("validate/w4/sped", "did you mean 'speed'"),
    ("valdate/w4/quality", "did you mean 'validate'"),
    ("validate/w4/serve", "only serve names an engine"),
    ("validate/w4/speed/vllm", "only serve names an engine"),
    ("validate/w4/speculative", "validate/draft/speculative"),
    ("quantize", "quantize takes exactly one name"),
    ("quantize/", "non-empty name"),
    ("export/a/b", "export takes exactly one name"),
    ("load/x", "load takes no name"),
    ("validate/w4", "validate takes a model and a measurement"),
    ("validate/a/serve/b/c", "too many parts"),
])
def test_a_mistyped_key_is_refused_with_a_clear_message(key, says):
    with pytest.raises(UnitKeyError, match="unit key") as e:
        kind_of(key)
    assert says in str(e.value) and repr(key) in str(e.value)


def test_every_consumer_refuses_a_mistyped_key():
    """The report's merge, the report's plan column and Ray's resources: none matches a typo to nothing."""
    from pipeline.app.ray_nodes import options_for
    from pipeline.results import merge, schema
    from pipeline.results.render import planned

    report = schema.Report.model_validate({"run": {"name": "t", "recipe": "r.toml", "started": "2025-01-01T00:00:00",
                                                   "device": "cpu", "seed": 0}})
    with pytest.raises(UnitKeyError, match="'sped'"):
        merge.record(report, "validate/w4/sped", {"time_s": 1.0, "peak_rss_bytes": 1, "metrics": {}}, skipped=False)
    assert report.stages == {}, "nothing is recorded under a refused key"
    with pytest.raises(UnitKeyError):
        planned({}, "validate/w4/sped")
    with pytest.raises(UnitKeyError):
        options_for("validate/w4/sped", None, "cpu", 1)


def test_the_class_builders_and_parse_round_trip():
    built = {Load.key(): (Load, None), Calibrate.key(): (Calibrate, None), Draft.key(): (Draft, None),
             Quantize.key("w4"): (Quantize, "w4"), Export.key("w4"): (Export, "w4"),
             Quality.key("w4"): (Quality, "w4"), Speed.key("baseline"): (Speed, "baseline"),
             Tasks.key("w4"): (Tasks, "w4"), Serve.key("w4", "vllm"): (Serve, "w4"),
             Speculative.key(): (Speculative, "draft")}
    assert list(built) == ["load", "calibrate", "draft", "quantize/w4", "export/w4", "validate/w4/quality",
                           "validate/baseline/speed", "validate/w4/tasks", "validate/w4/serve/vllm",
                           "validate/draft/speculative"]
    for key, (cls, name) in built.items():
        k = UnitKey.parse(key)
        assert str(k) == key and kind_of(key) is cls and cls.parse(key) == k and k.name == name
    assert Serve.engine_of("validate/w4/serve/vllm") == "vllm" and Export.name_of("export/draft") == "draft"
    assert Quality.plan_key("w4") == "validate/w4" == UnitKey.parse("validate/w4/quality").plan_key
    with pytest.raises(UnitKeyError, match="not a Quantize key"):
        Quantize.name_of("export/w4")
    assert set(kinds.KINDS) == {kind_of(k) for k in built}, "every kind has a key here"


def test_every_unit_a_recipe_builds_round_trips_through_its_class():
    """tiny.toml with a draft, speed, serving and tasks: every unit's key parses back to itself, and its class builds
    that same key from its parts."""
    from pipeline.app.units import build_units

    head, exports = build_units(load_recipe(TINY, ALL_ON))
    keys = [u.key for u in head + exports]
    assert {kind_of(k) for k in keys} == set(kinds.KINDS), "the recipe makes a unit of every kind"
    for key in keys:
        k, cls = UnitKey.parse(key), kind_of(key)
        assert str(k) == key
        if cls is Serve:
            assert cls.key(k.name, k.engine) == key
        elif k.name is None:
            assert cls.key() == key
        else:
            assert cls.key(k.name) == key
        for dep in next(u for u in head + exports if u.key == key).deps:
            assert str(UnitKey.parse(dep)) == dep


def test_the_ray_policy_of_a_unit_comes_from_its_class(monkeypatch):
    from pipeline.app.ray_nodes import NODE_RESOURCE, SHARE, exclusive, options_for

    memory = {"validate/w4": 5, "draft": 7, "validate/w4/speed": 9}
    plan = type("Plan", (), {"memory": memory})
    for key in ("validate/w4/serve/vllm", "validate/draft/speculative", "validate/w4/speed"):
        assert kind_of(key).exclusive and exclusive(key)
        assert options_for(key, plan, "cpu", 1)["resources"] == {NODE_RESOURCE: 1}
    for key in ("load", "quantize/w4", "draft", "validate/w4/quality", "validate/w4/tasks", "export/w4"):
        assert not exclusive(key) and options_for(key, plan, "cpu", 1)["resources"] == {NODE_RESOURCE: SHARE}
    # memory: the serve and tasks units ask for their model's figure, the speculative unit for the draft's
    assert [options_for(k, plan, "cpu", 1).get("memory") for k in
            ("validate/w4/serve/vllm", "validate/w4/tasks", "validate/w4/quality", "validate/draft/speculative",
             "validate/w4/speed", "load")] == [5, 5, 5, 7, 9, None]
    monkeypatch.setattr(Serve, "exclusive", False)  # the class decides, nothing else matches the key
    assert options_for("validate/w4/serve/vllm", plan, "cpu", 1)["resources"] == {NODE_RESOURCE: SHARE}


def test_the_quality_worker_has_one_argument_builder():
    """`compress eval` and the validate stage build the quality job with the same function (and the same keys)."""
    import inspect

    from pipeline.app.commands import measure
    from pipeline.eval.config import PerplexityConfig, SmokeConfig
    from pipeline.eval.jobs import quality_args
    from pipeline.stages import validate

    assert "run_quality" in inspect.getsource(measure.eval.callback)
    assert "run_quality" in inspect.getsource(validate.quality)
    args = quality_args("/m/w4", "/o", PerplexityConfig(), SmokeConfig(), "cpu", reference=Path("/r"),
                        memory_limit=2**30)
    assert args["label"] == "w4" and args["reference"] == "/r" and args["memory_limit"] == 2**30
    assert list(args) == ["model_dir", "out", "perplexity", "smoke", "device", "reference", "label", "memory_limit"]

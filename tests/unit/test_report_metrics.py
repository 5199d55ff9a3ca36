"""The typed measurement sections (pipeline/results/metrics.py) write report.json exactly as the producers' dicts
did: the keys given, in their order, None kept, absent left absent, ints as ints, nan and inf as null."""
import json
import math

from pipeline.results.merge import record
from pipeline.results.metrics import Smoke, Speed
from pipeline.results.schema import ModelEntry, Report

RUN = {"name": "t", "recipe": "r.toml", "started": "now", "device": "cpu", "seed": 0}


def _dumped(entry: ModelEntry) -> dict:
    return json.loads(json.dumps(entry.model_dump(mode="json")))


def test_a_measurement_dumps_its_keys_in_the_order_given():
    speed = {"max_batch": 4, "skipped_not": None, "decode": {"4": {"tokens_per_s": {"n": 3, "median": 2}}, "1": {}},
             "device": "cpu", "extra": {"b": 1, "a": [1.5, float("nan")]}, "roofline_fraction": float("inf")}
    e = ModelEntry(speed=speed, perplexity={"protocol": "gptq", "value": 10})
    out = _dumped(e)
    assert list(out["speed"]) == list(speed) and list(out["speed"]["decode"]["4"]["tokens_per_s"]) == ["n", "median"]
    assert out["speed"]["decode"]["1"] == {} and out["speed"]["skipped_not"] is None
    assert out["speed"]["extra"] == {"b": 1, "a": [1.5, None]} and out["speed"]["roofline_fraction"] is None
    assert out["perplexity"] == {"protocol": "gptq", "value": 10} and isinstance(out["perplexity"]["value"], int)
    assert e.speed.decode_at(4).median == 2 and e.speed.decode_at(2) is None and e.speed.timed
    assert math.isinf(e.speed.roofline_fraction)  # the value itself is kept; only the JSON says null


def test_given_reads_like_dict_get_and_an_empty_measurement_is_falsy():
    s = Speed.model_validate({"device": None, "other": 1})
    assert s.given("device", "?") is None and s.given("device_name", "?") == "?" and s.given("other") == 1
    assert not Speed() and Speed(skipped="no") and not Speed(skipped="no").timed
    old = Smoke.model_validate({"prompt": "p", "text": "t", "ok": False})  # an old single-output smoke result
    assert [o.prompt for o in old.all_outputs()] == ["p"]


def test_report_round_trip_is_byte_identical():
    rep = Report.model_validate({"run": RUN})
    metrics = {"perplexity": {"value": 3.5, "nll": 1.0, "tokens": 7, "dataset": "d", "protocol": "gptq"},
               "smoke": {"ok": True, "outputs": [{"prompt": "p", "text": "t", "ok": True, "problem": None}]},
               "footprint_bytes": 10}
    record(rep, "validate/baseline/quality", {"time_s": 1.0, "peak_rss_bytes": 1, "metrics": metrics}, skipped=False)
    record(rep, "validate/baseline/serve/transformers", {"time_s": 1.0, "peak_rss_bytes": 1, "metrics": {
        "engine": "transformers", "levels": [{"concurrency": 1, "output_tok_s": 5.0, "errors": 0}]}}, skipped=False)
    text = json.dumps(rep.to_dict(), indent=2)
    again = json.dumps(Report.model_validate(json.loads(text)).to_dict(), indent=2)
    assert again == text
    base = json.loads(text)["baseline"]
    assert base["perplexity"] == metrics["perplexity"] and base["smoke"] == metrics["smoke"]
    assert rep.baseline.served["transformers"].levels[0].output_tok_s == 5.0

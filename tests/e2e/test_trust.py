"""Only what the completed run proved is ever planned for the Hub: the four repros of the "one owner for a
run's results" issue, each through the real CLI on the tiny recipe, each ending with what is and is not
planned. Plus: push during a run is refused (exit 3), SIGTERM is a status (143, "interrupted") and the
next run resumes, and `compress push` records its outcome in report.json."""
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest_hub import hub_env, hub_server  # noqa: F401
from tests.e2e.test_tiny_recipe import RECIPE, ROOT, compress, run_tiny  # noqa: F401

EXPORTS = {"gptq-w4g32", "rtn-w4g32", "draft"}
DRY = ("publish.org=me", "publish.dry_run=true")
FAILING = "validate.gates.max_ppl_ratio=0.5"  # random weights: every variant's ratio is far above 0.5


@pytest.fixture
def out(tiny_run, tmp_path):
    """A copy of the finished tiny run: tmp_path/tiny (so reruns of the same recipe skip every stage)."""
    shutil.copytree(tiny_run[0], tmp_path / "tiny", ignore=shutil.ignore_patterns(".lock"))
    return tmp_path


def report(run_dir: Path) -> dict:
    return json.loads((run_dir / "report.json").read_text())


def planned(section: dict) -> set[str]:
    return {i["name"] for i in section.get("items") or []}


def push(run_dir: Path, *args: str, rc: int) -> subprocess.CompletedProcess:
    return compress("push", run_dir, *args, check_rc=rc)


def test_a_warn_only_gate_never_blocks_publishing(out):
    run_dir = out / "tiny"
    p = run_tiny(out, FAILING, 'validate.gates.warn_only=["max_ppl_ratio"]', *DRY, rc=0)
    assert "0 failed" in p.stderr and "warnings" in p.stderr
    rep = report(run_dir)
    assert rep["run"]["status"] == "complete" and rep["publish"]["status"] == "dry-run"
    assert planned(rep["publish"]) == EXPORTS, "the in-run publish step plans every export"
    assert any(g["severity"] == "warn" and not g["passed"] for g in rep["gates"])
    push(run_dir, "--dry-run", rc=0)
    assert planned(report(run_dir)["publish"]) == EXPORTS, "compress push plans every export too"


def test_a_killed_rerun_after_failed_gates_publishes_nothing(out):
    run_dir = out / "tiny"
    run_tiny(out, FAILING, *DRY, rc=5)
    assert report(run_dir)["run"]["status"] == "gates_failed"
    p = push(run_dir, "--dry-run", rc=6)
    assert "gate(s) failed" in p.stderr
    # rerun with a setting that reruns validation, killed at its first stage
    run_tiny(out, FAILING, *DRY, "validate.perplexity.max_windows=1",
             env={"COMPRESS_FAULT": "validate/baseline/quality:start"}, rc=-signal.SIGKILL)
    rep = report(run_dir)
    assert rep["run"]["status"] == "running" and rep["gates"] == [] and rep["exports"] == {}
    for flags in (("--dry-run",), ("--dry-run", "--partial")):
        p = push(run_dir, *flags, rc=6)
        assert "did not finish (status running" in p.stderr and "Nothing was pushed" in p.stderr
        section = report(run_dir)["publish"]
        assert section["status"] == "refused" and planned(section) == set()


def test_an_export_of_a_renamed_variant_is_removed_and_never_planned(out):
    run_dir = out / "tiny"
    p = run_tiny(out, "quantize.1.name=rtn-b", *DRY, rc=0)
    assert f"removing {run_dir / 'export' / 'rtn-w4g32'}: not an export of this recipe" in p.stderr
    assert not (run_dir / "export" / "rtn-w4g32").exists()
    expected = {"gptq-w4g32", "rtn-b", "draft"}
    assert set(report(run_dir)["exports"]) == expected
    assert planned(report(run_dir)["publish"]) == expected
    push(run_dir, "--dry-run", rc=0)
    assert planned(report(run_dir)["publish"]) == expected


def test_sigterm_is_a_status_push_during_a_run_is_refused_and_the_rerun_completes(out):
    """The finished run's copy without its draft and exports (so the run goes on to them), paused at draft:start."""
    tmp_path, run_dir = out, out / "tiny"
    for made_again in ("draft", "export", "validate/draft"):
        shutil.rmtree(run_dir / made_again)
    args = [sys.executable, "-m", "pipeline.app.cli", "run", str(RECIPE), "--set",
            f"run.output_dir={json.dumps(str(tmp_path))}", *[a for s in DRY for a in ("--set", s)]]
    proc = subprocess.Popen(args, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1",
                                                 "COMPRESS_FAULT": "draft:start:pause"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        for line in proc.stderr:  # the run holds its lock at draft:start until it is signalled
            seen.append(line)
            if "fault injection: pausing at draft:start" in line:
                break
        else:
            pytest.fail("the run never reached draft:start:\n" + "".join(seen[-40:]))
        p = push(run_dir, "--dry-run", rc=3)
        assert "in use by another compress process" in p.stderr
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=120)
        stderr = "".join(seen) + rest
    finally:
        proc.kill()
    assert proc.returncode == 143, stderr[-3000:]
    assert "interrupted by SIGTERM" in stderr
    rep = report(run_dir)
    assert rep["run"]["status"] == "interrupted" and rep["run"]["exit_code"] == 143
    assert not (run_dir / "export").exists() and not (run_dir / "draft").exists(), "no unfinished stage looks complete"
    push(run_dir, "--dry-run", rc=6)
    rerun = run_tiny(tmp_path, *DRY, rc=0)
    assert "[load] up to date" in rerun.stderr and "[calibrate] up to date" in rerun.stderr
    rep = report(run_dir)
    assert rep["run"]["status"] == "complete" and planned(rep["publish"]) == EXPORTS


def test_push_flags_override_the_lock_both_ways(out):
    run_dir = out / "tiny"
    run_tiny(out, "publish.org=me", "publish.dry_run=true", "publish.partial=true", FAILING, rc=5)
    assert report(run_dir)["publish"]["status"] == "refused"  # partial: every variant failed, nothing left
    p = push(run_dir, "--no-partial", rc=6)  # not a dry run either: --no-partial alone still reads dry_run
    assert "use --partial" in p.stderr
    run_tiny(out, "publish.org=me", "publish.dry_run=true", rc=0)
    push(run_dir, "--dry-run", rc=0)
    assert report(run_dir)["publish"]["status"] == "dry-run"
    # a real push: no token and no Hub here, a clear error recorded in the report
    p = compress("push", run_dir, "--no-dry-run", env={"HF_TOKEN": "", "HF_ENDPOINT": "http://127.0.0.1:9"}, check_rc=6)
    assert report(run_dir)["publish"]["status"] == "failed"
    assert "error:" in p.stderr

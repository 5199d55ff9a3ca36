"""One-shot CUDA benchmark of our speed stage against a plain hand-written generate loop.

    python -m benchmarks.gpu.gpu_bench --device cuda --out "$OUT"        # on the GPU machine
    python -m benchmarks.gpu.gpu_bench --tiny --device cpu --out /tmp/gb  # rehearsal, ~1-2 min

In one process: the device's copy bandwidth; a randomly initialised model of SmolLM2-1.7B's
shape in bf16 (--tiny: a 2-layer toy); its bitsandbytes int8 and NF4 variants. Cells (8):
bf16 at batch 1 and 16 with the default (dynamic) and the static cache, int8 and NF4 at batch
1 and 16. Every figure of our stage (pipeline.eval.speed) is compared with the reference loop of
benchmarks/speed_vs_reference.py on the same model and prompts; the ratios must lie in 0.9-1.1.
Results go to OUT/gpu_bench.json and OUT/gpu_bench.md after each model (a timeout keeps what
was done). Exit 0 when it ran (1 with --strict if a ratio is outside 0.9-1.1), 2 on bad usage.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.speed_vs_reference import reference_decode, reference_prefill
from pipeline.eval.config import SpeedConfig
from pipeline.eval.measure import copy_bandwidth
from pipeline.eval.speed import Bench, measure_speed

# SmolLM2-1.7B (HuggingFaceTB/SmolLM2-1.7B config.json), random weights: speed does not need trained ones.
FULL_SHAPE = dict(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                  num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=8192,
                  rope_theta=130000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)
TINY_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=True)
BATCHES = [1, 16]
AGREE = {True: "yes", False: "NO", None: "n/a (includes generate set-up)"}


def speed_configs(tiny: bool) -> dict[str, SpeedConfig]:
    """bf16 gets more tokens and runs; bitsandbytes decode is slow, so fewer (keeps the script < ~8 min)."""
    prompt, new = (16, 8) if tiny else (128, 64)
    bf16 = SpeedConfig(prompt_len=prompt, new_tokens=new, batch_sizes=BATCHES, repeats=3 if tiny else 5,
                       warmup=1 if tiny else 2, bandwidth_mib=64 if tiny else 1024,
                       techniques=["kv_cache", "static_cache", "sdpa", "eager", "flash_attention_2"])
    bnb = bf16.model_copy(update={"new_tokens": new if tiny else 32, "repeats": 3, "warmup": 1, "techniques": []})
    return {"bf16": bf16, "int8": bnb, "nf4": bnb}


def build_bf16(tiny: bool, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**(TINY_SHAPE if tiny else FULL_SHAPE), pad_token_id=2, bos_token_id=1, eos_token_id=2)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    return model.eval()


def load_bnb(folder: str, kind: str, device: str):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    q = (BitsAndBytesConfig(load_in_8bit=True) if kind == "int8" else
         BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16))
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=q, dtype=torch.bfloat16,
                                                device_map=device).eval()


def reference(model, cfg: SpeedConfig, device: str) -> dict:
    """The hand-written loop's figures on the same prompts our stage uses (median of repeats after warm-up)."""
    bench = Bench(model, None, cfg, device)
    runs = [reference_prefill(model, *bench.batches[1], device) for _ in range(cfg.warmup + cfg.repeats)]
    out = {"prefill_tokens_per_s": statistics.median(cfg.prompt_len / s for s in runs[cfg.warmup:])}
    for b in cfg.batch_sizes:
        runs = [reference_decode(model, *bench.batches[b], cfg.new_tokens, device)
                for _ in range(cfg.warmup + cfg.repeats)][cfg.warmup:]
        out[f"decode_b{b}"] = statistics.median(b * (cfg.new_tokens - 1) / r["decode_s"] for r in runs)
        if b == 1:
            out["ttft_s"] = statistics.median(r["ttft_s"] for r in runs)
    return out


def time_model(name: str, model, cfg: SpeedConfig, device: str, static_b16: bool) -> dict:
    speed = measure_speed(model, None, cfg, device)
    cells = {f"b{b}": speed["decode"][str(b)]["tokens_per_s"]["median"] for b in cfg.batch_sizes}
    if static_b16:
        bench = Bench(model, None, cfg, device)
        cells["b1 static"] = speed["techniques"]["static_cache"]["decode_tokens_per_s"]["median"]
        cells["b16 static"] = bench.decode(16, cache_implementation="static",
                                           disable_compile=True)["tokens_per_s"]["median"]
    ref = reference(model, cfg, device)
    ours = {"prefill_tokens_per_s": speed["prefill_tokens_per_s"]["median"], "ttft_s": speed["ttft_s"]["median"],
            **{f"decode_b{b}": cells[f"b{b}"] for b in cfg.batch_sizes}}
    # TTFT of our stage includes generate()'s set-up (what a user waits for); the reference's is the
    # bare prefill: shown, not held to the 10% agreement.
    compare = [{"model": name, "metric": k, "ours": ours[k], "reference": ref[k], "ratio": ours[k] / ref[k],
                "agree_10pct": None if k == "ttft_s" else 0.9 <= ours[k] / ref[k] <= 1.1} for k in ours]
    return {"speed": speed, "cells": cells, "reference": ref, "compare": compare}


def markdown(result: dict) -> str:
    env = result["env"]
    lines = [f"# GPU speed benchmark ({'tiny rehearsal' if result['tiny'] else 'SmolLM2-1.7B shape, random init'})",
             "", f"{env['device_name']}; torch {env['torch']}, transformers {env['transformers']}, "
             f"bitsandbytes {env['bitsandbytes']}; copy bandwidth "
             f"{result['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s",
             "", "## Cells: decode tokens/s (all sequences), our speed stage", "",
             "| model | cell | tokens/s | roofline (b1) | peak memory MiB | footprint MiB |",
             "|---|---|---|---|---|---|"]
    for name, m in result["models"].items():
        if "error" in m or "skipped" in m:
            lines.append(f"| {name} | – | {m.get('error') or m.get('skipped')} | | | |")
            continue
        s = m["speed"]
        for cell, v in m["cells"].items():
            lines.append(f"| {name} | {cell} | {v:.4g} | {s['roofline_fraction']:.3f} | "
                         f"{s['peak_memory_bytes'] / 2**20:.0f} | {s['footprint_bytes'] / 2**20:.0f} |")
    lines += ["", "## Our stage vs the hand-written loop (ratio ours / reference; agreement: 0.9-1.1)", "",
              "| model | metric | ours | reference | ratio | within 10% |", "|---|---|---|---|---|---|"]
    for row in result["compare"]:
        lines.append(f"| {row['model']} | {row['metric']} | {row['ours']:.4g} | {row['reference']:.4g} | "
                     f"{row['ratio']:.3f} | {AGREE[row['agree_10pct']]} |")
    techniques = (result["models"].get("bf16") or {}).get("speed", {}).get("techniques", {})
    if techniques:
        lines += ["", "## Technique rows (bf16, batch 1)", "", "| technique | decode tok/s | vs KV cache | note |",
                  "|---|---|---|---|"]
        for t, r in techniques.items():
            tok, vs = r.get("decode_tokens_per_s", {}).get("median"), r.get("speedup_vs_kv_cache")
            lines.append(f"| {t} | {f'{tok:.4g}' if tok else '–'} | {f'{vs:.3f}' if vs else '–'} | "
                         f"{r.get('skipped') or r.get('error') or r.get('note', '')} |")
    return "\n".join(lines) + f"\n\nwall {result['wall_s']:.0f} s\n"


def env_info(device: str) -> dict:
    import transformers

    try:
        import bitsandbytes
        bnb = bitsandbytes.__version__
    except ImportError:
        bnb = None
    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    return {"device": device, "device_name": name, "torch": torch.__version__,
            "transformers": transformers.__version__, "bitsandbytes": bnb}


def save(result: dict, out: Path, t0: float) -> None:
    result["wall_s"] = time.perf_counter() - t0
    result["compare"] = [row for m in result["models"].values() for row in m.get("compare", [])]
    (out / "gpu_bench.json").write_text(json.dumps(result, indent=2))
    (out / "gpu_bench.md").write_text(markdown(result))


def run(args) -> dict:
    t0 = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfgs = speed_configs(args.tiny)
    result = {"tiny": args.tiny, "env": env_info(args.device), "models": {}, "compare": []}
    result["copy_bandwidth_bytes_per_s"] = copy_bandwidth(args.device, cfgs["bf16"].bandwidth_mib, 10)
    print(f"copy bandwidth {result['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s", flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu_bench_") as tmp:
        model = build_bf16(args.tiny, args.device)
        result["models"]["bf16"] = time_model("bf16", model, cfgs["bf16"], args.device, static_b16=True)
        save(result, out, t0)
        model.save_pretrained(tmp)  # the bitsandbytes variants quantize these weights while loading
        del model
        gc.collect()
        if torch.device(args.device).type == "cuda":
            torch.cuda.empty_cache()
        for kind in ("int8", "nf4"):
            if time.perf_counter() - t0 > args.budget_s:
                result["models"][kind] = {"skipped": f"time budget {args.budget_s:.0f} s spent"}
                continue
            try:
                model = load_bnb(tmp, kind, args.device)
                result["models"][kind] = time_model(kind, model, cfgs[kind], args.device, static_b16=False)
            except Exception as exc:  # noqa: BLE001 - report the variant's failure, keep the others
                result["models"][kind] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
            model = None
            gc.collect()
            save(result, out, t0)
            print(f"{kind} done at {time.perf_counter() - t0:.0f} s", flush=True)
    save(result, out, t0)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="2-layer toy model: rehearse the script on CPU")
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_bench_out"))
    parser.add_argument("--budget-s", type=float, default=420.0, help="skip the remaining variants after this")
    parser.add_argument("--strict", action="store_true", help="exit 1 if a ratio is outside 0.9-1.1")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: 1 with --device cpu, steadiest on a shared machine)")
    args = parser.parse_args()
    threads = args.threads or (1 if torch.device(args.device).type == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print("--device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    result = run(args)
    print(markdown(result))
    bad = [r for r in result["compare"] if r["agree_10pct"] is False]
    return 1 if args.strict and bad else 0


if __name__ == "__main__":
    sys.exit(main())

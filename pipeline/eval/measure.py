"""Measurement primitives shared by the speed stage and the benchmarks: synchronized clocks,
median/min/max, copy bandwidth, weight bytes per token, roofline. Peak memory: pipeline/base/memory.py."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


# ---------------------------------------------------------------- small pure helpers
def summarize(samples: list[float]) -> dict[str, float]:
    """Median, min and max of timed runs (the spread is the min-max range)."""
    if not samples:
        raise ValueError("summarize() needs at least one sample")
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def roofline_fraction(weight_bytes: int, seconds_per_token: float, bandwidth: float | None) -> float | None:
    """Fraction of copy bandwidth reached by streaming the weights once per decoded token."""
    if not bandwidth or seconds_per_token <= 0:
        return None
    return (weight_bytes / seconds_per_token) / bandwidth


def sync(device: str | torch.device) -> None:
    """Wait for queued kernels so that a clock read measures finished work."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed_runs(fn: Callable[[], Any], warmup: int, repeats: int) -> list[Any]:
    """Call fn `warmup` times (discarded), then `repeats` times; return the timed results."""
    for _ in range(warmup):
        fn()
    return [fn() for _ in range(repeats)]


# ---------------------------------------------------------------- weights and bandwidth
def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights a batch-1 decode step reads: every parameter and buffer once
    (quantized storage as stored, plus bitsandbytes' scales kept as tensor attributes), except an untied input
    embedding table, of which a step reads one row."""
    seen: set[tuple[int, int]] = set()
    total = 0
    hf: Any = model  # a transformers model (get_*_embeddings), or any module without them
    emb = hf.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    out = hf.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    skip = None
    if emb is not None and (out is None or out.weight.data_ptr() != emb.weight.data_ptr()):
        skip = emb.weight.data_ptr()
    for t in list(model.parameters()) + list(model.buffers()):
        state = getattr(t, "quant_state", None)  # bitsandbytes Params4bit: absmax (and nested absmax)
        extras = (getattr(state, "absmax", None), getattr(getattr(state, "state2", None), "absmax", None),
                  getattr(t, "SCB", None))  # bitsandbytes Int8Params: per-row scales
        for x in (t, *extras):
            if not isinstance(x, torch.Tensor):
                continue
            key = (x.data_ptr(), x.nbytes)
            if key in seen or x.data_ptr() == skip:
                continue
            seen.add(key)
            total += x.nbytes
    return total


def copy_bandwidth(device: str, mib: int, repeats: int = 5) -> float:
    """Device copy bandwidth in bytes/s: (read + written bytes) / median time of dst.copy_(src)."""
    n = mib * 2**20 // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)

    def one() -> float:
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        return time.perf_counter() - t0

    seconds = statistics.median(timed_runs(one, warmup=2, repeats=max(repeats, 5)))
    return 2 * src.nbytes / seconds

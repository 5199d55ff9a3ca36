"""Measurement primitives shared by the speed stage and the benchmarks: synchronized clocks,
median/min/max, peak memory above a baseline, copy bandwidth, weight bytes per token, roofline."""
from __future__ import annotations

import gc
import re
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from pipeline.errors import StageError


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


# ---------------------------------------------------------------- memory
class PeakMemory:
    """Peak memory above a baseline taken at `start()`.

    CPU: resets the kernel's RSS high-water mark (write "5" to /proc/self/clear_refs) and reads
    VmHWM; where that is refused or has no effect, samples RSS in a thread every 2 ms (an allocation
    freed within a few milliseconds can then be missed). CUDA: max_memory_allocated.
    """

    def __init__(self, device: str):
        self.device = torch.device(device)
        self.kind = "cuda_max_allocated" if self.device.type == "cuda" else "rss_hwm"
        self._base = 0
        self._sampled = 0
        self._stop: threading.Event | None = None

    def start(self) -> "PeakMemory":
        if self.device.type == "cuda":
            sync(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            return self
        gc.collect()  # garbage freed mid-measurement would hide the allocations that follow it under the base
        self._base = _proc_status_kib("VmRSS") * 1024
        try:
            Path("/proc/self/clear_refs").write_text("5")
            # a kernel (or sandbox) that accepts the write without resetting keeps an old, higher mark
            reset = _proc_status_kib("VmHWM") * 1024 <= _proc_status_kib("VmRSS") * 1024 + 2**20
        except OSError:
            reset = False
        if not reset:
            self.kind = "rss_sampled"
            self._stop = threading.Event()
            self._sampled = self._base
            threading.Thread(target=self._sample, daemon=True).start()
        return self

    def _sample(self) -> None:
        assert self._stop is not None
        while not self._stop.wait(0.002):
            self._sampled = max(self._sampled, _proc_status_kib("VmRSS") * 1024)

    def peak_above_base(self) -> int:
        if self.device.type == "cuda":
            sync(self.device)
            return int(torch.cuda.max_memory_allocated(self.device) - self._base)
        if self.kind == "rss_sampled":
            self._sampled = max(self._sampled, _proc_status_kib("VmRSS") * 1024)
            return max(0, self._sampled - self._base)
        return max(0, _proc_status_kib("VmHWM") * 1024 - self._base)


def _proc_status_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+)\s+kB", Path("/proc/self/status").read_text(), re.M)
    if match is None:
        raise StageError(f"cannot read {field} from /proc/self/status (peak memory needs Linux)")
    return int(match.group(1))


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights a batch-1 decode step reads: every parameter and buffer once
    (quantized storage as stored, plus bitsandbytes' scales kept as tensor attributes), except an untied input
    embedding table, of which a step reads one row."""
    seen: set[tuple[int, int]] = set()
    total = 0
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    skip = None
    if emb is not None and (out is None or out.weight.data_ptr() != emb.weight.data_ptr()):
        skip = emb.weight.data_ptr()
    for t in list(model.parameters()) + list(model.buffers()):
        state = getattr(t, "quant_state", None)  # bitsandbytes Params4bit: absmax (and nested absmax)
        extras = (getattr(state, "absmax", None), getattr(getattr(state, "state2", None), "absmax", None),
                  getattr(t, "SCB", None))  # bitsandbytes Int8Params: per-row scales
        for x in (t, *extras):
            key = (x.data_ptr(), x.nbytes) if isinstance(x, torch.Tensor) else None
            if key is None or key in seen or x.data_ptr() == skip:
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

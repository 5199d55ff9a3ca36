"""Measurement primitives shared by the speed stage and the benchmarks: synchronized clocks,
median/min/max, copy bandwidth, weight bytes per token, roofline; the prompts and the generate clock
(prefill, TTFT, decode) every timing process uses. Peak memory: pipeline/base/memory.py."""
from __future__ import annotations

import inspect
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import LogitsProcessorList

from pipeline.base.errors import StageError


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


# ---------------------------------------------------------------- prompts and generate clocks
_PROMPT_TEXT = (
    "The history of measurement is the history of agreeing on what to count. Merchants weighed "
    "grain against stones, builders paced out foundations, and astronomers timed the transit of "
    "stars across a wire. Each method traded precision for convenience, and each was trusted only "
    "as far as it could be repeated by someone else, on another day, with other hands. "
)


# ---------------------------------------------------------------- prompts and clocks
def make_batch(tokenizer: Any, vocab_size: int, prompt_len: int, batch: int, device: str
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch` prompts of lengths prompt_len, prompt_len - step, ... left-padded into one batch.

    Text from the tokenizer when there is one, else fixed pseudo-random ids (seeded)."""
    if tokenizer is not None:
        ids = tokenizer(_PROMPT_TEXT * (1 + prompt_len // 8), add_special_tokens=False)["input_ids"]
        base = torch.tensor(ids[:prompt_len], dtype=torch.long)
        base = base.repeat(math.ceil(prompt_len / max(1, len(base))))[:prompt_len]
    else:
        gen = torch.Generator().manual_seed(0)
        base = torch.randint(3, vocab_size, (prompt_len,), generator=gen)
    step = max(1, prompt_len // (2 * batch)) if batch > 1 else 0
    ids = torch.zeros(batch, prompt_len, dtype=torch.long)
    mask = torch.zeros(batch, prompt_len, dtype=torch.long)
    for i in range(batch):
        n = max(1, prompt_len - i * step)
        ids[i, prompt_len - n:] = base[:n]
        mask[i, prompt_len - n:] = 1
    return ids.to(device), mask.to(device)


class StepClock:
    """Logits processor that stamps the (synchronized) clock after every forward of generate."""

    def __init__(self, device: str):
        self.device = device
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        sync(self.device)
        self.stamps.append(time.perf_counter())
        return scores


def time_prefill(model, ids: torch.Tensor, mask: torch.Tensor, device: str) -> float:
    """Seconds for one forward over the prompt, as generate runs it: KV cache built, logits of the
    last position only (where the model supports `logits_to_keep`)."""
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, use_cache=True, **extra)
    sync(device)
    return time.perf_counter() - t0


def time_generate(model, ids, mask, new_tokens: int, device: str, pad_id: int, **gen_kwargs) -> dict:
    """One greedy generate of exactly `new_tokens` tokens -> ttft_s and decode_s (N-1 steps)."""
    clock = StepClock(device)
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, pad_token_id=pad_id,
                       logits_processor=LogitsProcessorList([clock]), **gen_kwargs)
    if len(clock.stamps) != new_tokens:
        raise StageError(f"generate ran {len(clock.stamps)} steps, expected {new_tokens}")
    return {"ttft_s": clock.stamps[0] - t0, "decode_s": clock.stamps[-1] - clock.stamps[0]}

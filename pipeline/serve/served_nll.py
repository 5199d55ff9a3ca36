"""Perplexity scored by a serving engine (vLLM's OpenAI server): each evaluation window sent as token ids with
`prompt_logprobs = 0` (vLLM's extension: the log-probability of every prompt token given the ones before it) and
`max_tokens = 1`; the NLL of the window's scored tokens summed as pipeline/eval/perplexity.py sums them. The same
windows and ids as the quality stage, so the two figures compare: what the engine computes (its kernels, its
precision, its KV cache) against what our stage computed for the same checkpoint."""
from __future__ import annotations

import json
import math
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pipeline.base.errors import StageError


class Window(Protocol):
    """A window of pipeline/eval/perplexity.py (serve and eval are siblings: neither imports the other)."""

    @property
    def begin(self) -> int: ...

    @property
    def end(self) -> int: ...

    @property
    def score_from(self) -> int: ...


@dataclass(frozen=True)
class ServedNLL:
    nll: float
    tokens: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens)


def window_nll(prompt_logprobs: list, ids: list[int], first: int) -> tuple[float, int]:
    """NLL of ids[first:] from vLLM's prompt_logprobs (one entry per prompt token, None for the first; each a
    {token id: {"logprob": ...}} holding at least the prompt's own token)."""
    total = 0.0
    for pos in range(first, len(ids)):
        entry = prompt_logprobs[pos]
        if entry is None or str(ids[pos]) not in entry:
            raise ValueError(f"the server returned no log-probability for prompt token {pos} (id {ids[pos]})")
        total -= float(entry[str(ids[pos])]["logprob"])
    return total, len(ids) - first


def served_nll(url: str, model: str, ids: list[int], windows: Sequence[Window], timeout_s: float = 600,
               progress: Callable[[int], None] | None = None) -> ServedNLL:
    """Total NLL and tokens scored over the windows, from the server at url (…/v1/completions)."""
    total, count = 0.0, 0
    for w in windows:
        prompt = ids[w.begin: w.end]
        body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
        req = urllib.request.Request(url.rstrip("/") + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            choice = json.loads(r.read())["choices"][0]
        nll, n = window_nll(choice["prompt_logprobs"], prompt, w.score_from - w.begin)
        total, count = total + nll, count + n
        if progress is not None:
            progress(1)
    return ServedNLL(total, count)


def served_vs_in_process(url: str, model: str, ids: list[int], windows: Sequence[Window], in_process: dict,
                         label: str, timeout_s: float = 600, progress: Callable[[int], None] | None = None) -> dict:
    """The windows scored through the server beside the quality stage's figure for the same ids and windows
    (in_process: its perplexity record, {"value", "tokens", ...}): {"value", "nll", "tokens", "windows",
    "in_process", "ratio", "time_s"}. StageError when the two scored different token counts."""
    t0 = time.perf_counter()
    got = served_nll(url, model, ids, windows, timeout_s, progress)
    if got.tokens != in_process["tokens"]:
        raise StageError(f"serve {label}: the server scored {got.tokens} tokens, the quality stage "
                         f"{in_process['tokens']}")
    return {"value": got.perplexity, "nll": got.nll, "tokens": got.tokens, "windows": len(windows),
            "in_process": in_process["value"], "ratio": got.perplexity / in_process["value"],
            "time_s": round(time.perf_counter() - t0, 1)}

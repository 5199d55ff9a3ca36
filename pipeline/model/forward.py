"""The cache keyword of a model's forward, across the transformers versions we meet.

transformers 5.24 (our pin) names a forward's KV-cache argument `cache` and still accepts `past_key_values` with a
deprecation warning (removed in 5.40); 5.17 (the lent GPU machine's image) knows only `past_key_values` and
silently drops an unknown `cache` into **kwargs, so every forward would run without its cache. Seen there: an
identical draft accepted 61% of its tokens instead of 100% and greedy speculative output still matched plain
greedy, because both ran cacheless. Asking the signature avoids both the warning and the silent drop.

    logits = model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True).logits
"""
from __future__ import annotations

import functools
import inspect
from typing import Any


@functools.cache
def _cache_name(forward_owner: type[Any]) -> str:
    params = inspect.signature(forward_owner.forward).parameters
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    raise TypeError(f"{forward_owner.__name__}.forward takes neither `cache` nor `past_key_values`: "
                    "this transformers version is not supported")


def cache_kwargs(model: Any, cache: Any) -> dict:
    """{"cache": cache} or {"past_key_values": cache}, whichever `model`'s forward declares."""
    owner: type = type(model)  # declared `type`: mypy takes no type[X] for lru_cache's Hashable argument
    return {_cache_name(owner): cache}

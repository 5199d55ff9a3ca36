"""What each stage measured, as typed report sections (pipeline/results/schema.py holds them).

Every model here is a `Measured`: the fields the report, the cards, the plots and the gates read are typed; any
other key a producer writes is kept as it came (extra="allow"). A measurement is written back with exactly the
keys it was given, in the order it was given them, None included and absent left absent, non-finite floats as
null: report.json is byte-for-byte what the producers' dicts gave before these sections were typed.
"""
from __future__ import annotations

import math
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    PrivateAttr,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

Real = float | int  # a figure as its producer wrote it: an int stays an int, a float a float (report.json unchanged)


def _finite(v: Any) -> Any:
    """What a JSON dump of an untyped payload gives: nan and ±inf as None, inside lists and dicts too."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_finite(x) for x in v]
    return v


class Measured(BaseModel):
    """A measurement payload: typed where read, any other key kept; dumped as it was given (see the module)."""
    model_config = ConfigDict(extra="allow")
    _keys: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _remember_order(cls, data: Any, handler: Any) -> Any:
        made = handler(data)
        if isinstance(data, dict) and made is not data:
            made._keys = tuple(data)
        return made

    def __bool__(self) -> bool:
        """False when nothing was written, as the empty dict it replaces was."""
        return bool(self.model_fields_set or self.__pydantic_extra__)

    def given(self, key: str, default: Any = None) -> Any:
        """A field as the producer wrote it (None included), `default` when it did not write it: dict.get's answer."""
        if key in self.model_fields_set:
            return getattr(self, key)
        return (self.__pydantic_extra__ or {}).get(key, default)

    @model_serializer(mode="wrap")
    def _as_given(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> dict[str, Any]:
        dumped = handler(self)
        given = self.model_fields_set | set(self.__pydantic_extra__ or {})
        order = [k for k in self._keys if k in given] + [k for k in dumped if k in given and k not in self._keys]
        out = {k: dumped[k] for k in order if k in dumped}
        return _finite(out) if info.mode_is_json() else out


# ---------------------------------------------------------------- validate/<model>/quality
class Perplexity(Measured):
    """pipeline/eval/perplexity.py: the strided-window perplexity, and for a variant KL and top-1 vs the baseline."""
    value: Real | None = None
    nll: Real | None = None
    tokens: Real | None = None
    windows: Real | None = None
    window: Real | None = None
    stride: Real | None = None
    dataset: str | None = None
    protocol: str | None = None
    tokens_available: Real | None = None
    kl: Real | None = None
    top1: Real | None = None
    kl_top_k: Real | None = None


class SmokeOutput(Measured):
    prompt: str | None = None
    text: str | None = None
    ok: bool | None = None
    problem: str | None = None


class Smoke(SmokeOutput):
    """The smoke test: each prompt's output (`outputs`); an old single-prompt result is its own one output."""
    outputs: list[SmokeOutput] | None = None
    chat_template: bool | None = None

    def all_outputs(self) -> list[SmokeOutput]:
        return list(self.outputs or [self])


class Offload(Measured):
    """Set when a model's perplexity streamed weights from disk (the memory limit)."""
    in_memory_bytes: Real | None = None
    limit_bytes: Real | None = None


# ---------------------------------------------------------------- validate/<model>/speed
class Stat(Measured):
    """The summary of repeated timings."""
    median: Real | None = None
    min: Real | None = None
    max: Real | None = None
    n: Real | None = None


class DecodeRun(Measured):
    batch: Real | None = None
    tokens_per_s: Stat | None = None
    per_sequence_tokens_per_s: Real | None = None
    ttft_s: Stat | None = None


class Technique(Measured):
    """One batch-1 technique row (KV cache, no KV cache, an attention kernel, torch.compile), or why not."""
    decode_tokens_per_s: Stat | None = None
    prefill_tokens_per_s: Stat | None = None
    note: str | None = None
    speedup_vs_kv_cache: Real | None = None
    skipped: str | None = None
    error: str | None = None


class Speed(Measured):
    """pipeline/eval/speed.py (schema "speed/1"), or {"skipped": why} when the model was not timed."""
    skipped: str | None = None
    device: str | None = None
    device_name: str | None = None
    threads: Real | None = None
    dtype: str | None = None
    prompt_len: Real | None = None
    new_tokens: Real | None = None
    repeats: Real | None = None
    warmup: Real | None = None
    footprint_bytes: Real | None = None
    prefill_tokens_per_s: Stat | None = None
    ttft_s: Stat | None = None
    decode: dict[str, DecodeRun] | None = None  # by batch size, "1" first
    decode_tokens_per_s_b1: Real | None = None
    max_batch: Real | None = None
    decode_tokens_per_s_max_batch: Real | None = None
    techniques: dict[str, Technique] | None = None
    kv_cache_speedup: Real | None = None
    peak_memory_bytes: Real | None = None
    copy_bandwidth_bytes_per_s: Real | None = None
    roofline_fraction: Real | None = None

    @property
    def timed(self) -> bool:
        return self.skipped is None

    def decode_at(self, batch: Any) -> Stat | None:
        """The decode tokens/s summary at one batch size, or None."""
        run = (self.decode or {}).get(str(batch))
        return run.tokens_per_s if run else None


# ---------------------------------------------------------------- validate/<model>/serve/<engine>
class Equality(Measured):
    """Greedy output of the server vs transformers generate on the same prompts."""
    prompts: Real | None = None
    identical: Real | None = None
    dtype: str | None = None
    exact: bool | None = None
    compared: str | None = None


class Level(Measured):
    """One concurrency level of the load test."""
    concurrency: Real
    requests: Real | None = None
    completed: Real | None = None
    errors: Real | None = None
    output_tok_s: Real | None = None
    requests_s: Real | None = None
    ttft_p50_s: Real | None = None
    ttft_p99_s: Real | None = None
    itl_p50_s: Real | None = None
    itl_p99_s: Real | None = None
    server_peak_rss_bytes: Real | None = None
    server_processes: list[dict[str, Any]] | None = None  # {"process", "peak_rss_bytes"}: the memory per rank


class ServedPerplexity(Measured):
    """The quality stage's windows scored through the server (pipeline/stages/validate.py served_perplexity)."""
    value: Real | None = None
    tokens: Real | None = None
    windows: Real | None = None
    in_process: Real | None = None
    ratio: Real | None = None
    time_s: Real | None = None
    skipped: str | None = None  # why it was not scored (a window longer than the model's context)


class Served(Measured):
    """One engine serving one model (pipeline/serve/measure.py), or {"engine", "skipped": why}."""
    engine: str | None = None
    versions: dict[str, Any] | None = None
    device: str | None = None
    skipped: str | None = None
    refused: str | None = None  # the engine would not load the model (its own line)
    kernels: list[str] | None = None
    equality: Equality | None = None
    levels: list[Level] | None = None
    perplexity: ServedPerplexity | None = None
    int8_activations: bool | None = None  # vLLM's CPU W4A8 path ran (4-bit weights x int8 activations), else W4A16
    tensor_parallel_size: Real | None = None  # [validate.serve]'s, when the engine split the model over ranks
    pipeline_parallel_size: Real | None = None
    # [validate.tasks] engines: the tasks scored through this server (lm-eval local-completions) on the in-process
    # unit's items, and a variant's recovery against the baseline's in-process items (the in-process shape)
    tasks: dict[str, TaskScore] | None = None
    task_recovery: dict[str, Any] | None = None

    @property
    def engine_name(self) -> str:
        return str(self.engine or "?").split(" ")[0]  # "transformers (continuous batching)" -> "transformers"


# ---------------------------------------------------------------- validate/<model>/tasks
class TaskScore(Measured):
    """One [validate.tasks] task's score (pipeline/eval/tasks.py)."""
    metric: str | None = None
    score: Real | None = None
    stderr: Real | None = None
    n: Real | None = None
    split: str | None = None
    time_s: Real | None = None


# ---------------------------------------------------------------- draft and validate/draft/speculative
class Distill(Measured):
    """The draft stage's record (pipeline/speculative): distillation figures and what the draft is."""
    steps: Real | None = None
    dataset: str | None = None


class SpeculativeRow(Measured):
    """One (draft, temperature) row of the speculative measurement (results/merge.py speculative_modes)."""
    alpha: Real | None = None
    tokens_per_target_forward: Real | None = None
    speedup: Real | None = None
    accepted_by_position: list[Real] | None = None
    drafted_by_position: list[Real] | None = None
    tokens_per_s: Real | None = None
    c_d: Real | None = None
    c_v: Real | None = None
    break_even_alpha: Real | None = None
    repetition_rate: Real | None = None
    gamma: Real | None = None

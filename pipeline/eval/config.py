"""Recipe sections owned by evaluation: `[validate.speed]` and `[validate.gates]`.

Torch-free on purpose: `compress check` validates a recipe without importing torch.
The recipe loader (pipeline/recipe.py) embeds these models; their defaults are the
recipe's defaults (the CLI never repeats them).
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Technique = Literal[
    "kv_cache", "no_kv_cache", "static_cache", "compile", "sdpa", "eager", "flash_attention_2"
]
TECHNIQUES: tuple[str, ...] = Technique.__args__  # type: ignore[attr-defined]


class SpeedConfig(BaseModel):
    """How each model is timed (pipeline/eval/speed.py). Every model runs in a fresh process."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    prompt_len: int = Field(128, ge=1, description="prompt tokens for prefill, TTFT and decode")
    new_tokens: int = Field(32, ge=2, description="tokens generated per timed decode run")
    batch_sizes: list[int] = Field(
        default_factory=lambda: [1, 8],
        description="decode batch sizes; 1 is required (roofline, gates); larger ones are "
        "prompts of different lengths left-padded into one batch",
    )
    repeats: int = Field(3, ge=1, description="timed runs per cell; the median is reported")
    warmup: int = Field(1, ge=0, description="untimed runs before each cell")
    techniques: list[Technique] = Field(
        default_factory=lambda: ["kv_cache", "no_kv_cache"],
        description="named technique rows, timed at batch 1",
    )
    technique_models: Literal["all"] | list[str] = Field(
        default_factory=lambda: ["baseline"],
        description="models that get the technique rows (they are about the runtime, and slow)",
    )
    roofline: bool = Field(True, description="measure copy bandwidth and the roofline fraction")
    bandwidth_mib: int = Field(256, ge=8, description="size of the buffer copied to measure bandwidth")
    models: Literal["all"] | list[str] = Field(
        "all", description='"all", or names among "baseline", variant names and the draft name'
    )
    timeout_s: float = Field(1800.0, gt=0, description="limit for one model's timing process")

    @field_validator("batch_sizes")
    @classmethod
    def _batches(cls, v: list[int]) -> list[int]:
        if not v or any(b < 1 for b in v):
            raise ValueError("batch_sizes must be a non-empty list of positive integers")
        if 1 not in v:
            raise ValueError("batch_sizes must include 1 (batch-1 decode feeds the roofline and the gates)")
        if len(set(v)) != len(v):
            raise ValueError(f"batch_sizes has duplicates: {v}")
        return sorted(v)

    @field_validator("techniques")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"techniques has duplicates: {v}")
        return v

    def times(self, model: str) -> bool:
        """Whether `model` ("baseline", a variant or the draft name) is timed at all."""
        return self.enabled and (self.models == "all" or model in self.models)

    def for_model(self, model: str) -> "SpeedConfig":
        """The config to time `model` with: technique rows only for `technique_models`."""
        if self.technique_models == "all" or model in self.technique_models:
            return self
        return self.model_copy(update={"techniques": []})


class GateBounds(BaseModel):
    """Bounds; None = gate off. Names say the direction: max_* fails above, min_* below."""

    model_config = ConfigDict(extra="forbid")

    max_ppl_ratio: float | None = Field(None, gt=0, description="variant ppl / baseline ppl")
    max_kl: float | None = Field(None, ge=0, description="mean KL(baseline || variant), nats/token")
    min_top1: float | None = Field(None, ge=0, le=1, description="top-1 agreement with baseline")
    max_footprint_ratio: float | None = Field(None, gt=0, description="in-memory footprint / baseline's")
    min_decode_speed_ratio: float | None = Field(
        None, gt=0, description="batch-1 decode tokens/s / baseline's (needs speed for both)"
    )
    min_smoke_ok: float | None = Field(None, ge=0, le=1, description="share of the smoke test's chat prompts "
                                                                     "answered with non-degenerate text")
    min_acceptance: float | None = Field(None, ge=0, le=1, description="draft acceptance rate alpha")
    min_spec_speedup: float | None = Field(None, gt=0, description="speculative speed-up over the verifier alone")
    min_serve_tok_s_ratio: float | None = Field(None, gt=0, description="served output tok/s / baseline's at the "
                                                                         "same concurrency (lowest level ratio)")
    max_serve_error_rate: float | None = Field(None, ge=0, le=1, description="share of load-test requests that "
                                                                             "failed through the server")


class GatesConfig(GateBounds):
    """`[validate.gates]`: global bounds, per-model overrides, and gates that only warn."""

    min_smoke_ok: float | None = Field(1.0, ge=0, le=1, description="share of the smoke test's chat prompts "
                                                                    "answered with non-degenerate text; on by default "
                                                                    "(not applied to randomly initialised models)")
    warn_only: list[str] = Field(default_factory=list, description="gate names that warn instead of failing")
    speculative_mode: str = Field("greedy", description="which speculative measurement the draft gates read")
    models: dict[str, GateBounds] = Field(
        default_factory=dict, description="per-model overrides (a set field replaces the global bound)"
    )

    @model_validator(mode="after")
    def _known_warn_only(self) -> "GatesConfig":
        unknown = [g for g in self.warn_only if g not in GATE_METRICS]
        if unknown:
            raise ValueError(f"warn_only names unknown gates {unknown}; known: {sorted(GATE_METRICS)}")
        return self

    def bounds_for(self, model: str) -> dict[str, float]:
        """The active bounds for one model: global ones, replaced by that model's overrides."""
        merged = {g: getattr(self, g) for g in GATE_METRICS}
        override = self.models.get(model)
        if override is not None:
            merged.update({g: v for g, v in override.model_dump().items() if v is not None})
        return {g: v for g, v in merged.items() if v is not None}


# gate -> (metric it reads, which models it applies to). Kept here (torch-free) so the
# recipe check can refuse a gate that reads a metric the run does not produce.
GATE_METRICS: dict[str, tuple[str, str]] = {
    "max_ppl_ratio": ("ppl_ratio", "variant"),
    "max_kl": ("kl", "variant"),
    "min_top1": ("top1", "variant"),
    "max_footprint_ratio": ("footprint_ratio", "variant"),
    "min_decode_speed_ratio": ("decode_speed_ratio", "variant"),
    "min_smoke_ok": ("smoke_ok", "variant"),
    "min_acceptance": ("acceptance", "draft"),
    "min_spec_speedup": ("spec_speedup", "draft"),
    "min_serve_tok_s_ratio": ("serve_tok_s_ratio", "variant"),
    "max_serve_error_rate": ("serve_error_rate", "variant"),
}


def gate_problems(gates: GatesConfig, speed: SpeedConfig | None, variants: list[str],
                  draft: str | None, smoke: bool = True) -> list[str]:
    """Cross-stage checks for `compress check`: each problem is one readable line (empty = fine)."""
    problems = []
    if not smoke and variants and any(gates.bounds_for(v).get("min_smoke_ok") for v in variants):
        problems.append("[validate.gates].min_smoke_ok needs the smoke test, but [validate.smoke] enabled = false; "
                        "enable it, or set min_smoke_ok = 0 to run without it")
    known = set(variants) | ({draft} if draft else set()) | {"baseline"}
    for name in gates.models:
        if name not in known:
            problems.append(f"[validate.gates.models.{name}]: no variant or draft named {name!r}; "
                            f"known: {sorted(known - {'baseline'})}")
    for model, kind in [(v, "variant") for v in variants] + ([(draft, "draft")] if draft else []):
        for gate in gates.bounds_for(model):
            metric, applies = GATE_METRICS[gate]
            if applies == "draft" and draft is None and kind == "variant":
                problems.append(f"[validate.gates].{gate} needs a [draft]; the recipe has none")
            if gate == "min_decode_speed_ratio" and applies == kind:
                timed = _speed_models(speed)
                for needed in ("baseline", model):
                    if timed is not None and needed not in timed:
                        problems.append(f"[validate.gates].{gate} for {model!r} needs speed for "
                                        f"{needed!r}, but [validate.speed] does not time it")
    return sorted(set(problems))


def _speed_models(speed: SpeedConfig | None) -> set[str] | None:
    """Models timed by the speed config: None = all of them, empty set = none."""
    if speed is None or not speed.enabled:
        return set()
    return None if speed.models == "all" else set(speed.models)


def speed_problems(speed: SpeedConfig, variants: list[str], draft: str | None) -> list[str]:
    """Cross-stage checks for `compress check`: speed model names that do not exist."""
    known = {"baseline", *variants, *([draft] if draft else [])}
    problems = []
    for field in ("models", "technique_models"):
        names = getattr(speed, field)
        for name in ([] if names == "all" else names):
            if name not in known:
                problems.append(f"[validate.speed].{field}: no model named {name!r}; known: {sorted(known)}")
    return problems

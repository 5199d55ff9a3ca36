"""Recipe sections owned by evaluation: `[validate.perplexity]`, `[validate.smoke]`, `[validate.speed]` and
`[validate.gates]`.

Torch-free on purpose: `compress check` validates a recipe without importing torch.
The recipe loader (pipeline/recipe.py) embeds these models; their defaults are the
recipe's defaults (the CLI never repeats them).
"""
from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field as dc_field
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from pipeline.base.problem import Problem
from pipeline.base.strict import Strict

Technique = Literal[
    "kv_cache", "no_kv_cache", "static_cache", "compile", "sdpa", "eager", "flash_attention_2", "tensor_parallel"
]
TECHNIQUES: tuple[str, ...] = get_args(Technique)
_DEFAULT_TECHNIQUES: tuple[Technique, ...] = ("kv_cache", "no_kv_cache")


class PerplexityConfig(Strict):
    dataset: str = Field("wikitext2", description="evaluation corpus: shipped name, .txt/.jsonl/.parquet path or "
                                                  "hf:<id>; also where default draft and serve prompts come from")
    text_field: str = Field("text", description="field/column holding the text in a .jsonl, .parquet or hf: dataset "
                                                "(shipped corpora name their own)")
    seq_len: int = Field(2048, ge=8, description="tokens per window; each window predicts its last seq_len-1 tokens")
    stride: int | None = Field(None, ge=1, description="None: non-overlapping windows (GPTQ protocol)")
    max_windows: int | None = Field(None, ge=1, description="evaluate only the first max_windows windows; unset: "
                                                            "every window of the corpus")
    kl_top_k: int = Field(256, ge=1, description="baseline log-probs kept per token for KL (tail folded into one "
                                                 "bucket)")


class SmokeConfig(Strict):
    enabled: bool = Field(True, description="run the smoke test on the baseline and every variant (in their quality "
                                            "unit); min_smoke_ok needs it")
    prompts: list[str] = Field(["What is the capital of France?", "Write one sentence about the sea."],
                               description="user messages, sent through the chat template when the tokenizer has one, "
                                           "else as raw text")
    max_new_tokens: int = Field(32, ge=1, description="tokens generated greedily per smoke prompt")


class SpeedConfig(BaseModel):
    """How each model is timed (pipeline/eval/speed.py). Every model runs in a fresh process."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="time the models `models` selects (validate/<model>/speed); false: no "
                                            "speed figures (min_decode_speed_ratio needs them)")
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
        default_factory=lambda: list(_DEFAULT_TECHNIQUES),
        description="named technique rows, timed at batch 1",
    )
    tp_size: int = Field(2, ge=2, description="tensor_parallel: ranks (torchrun processes, tp_plan='auto'; gloo on "
                                              "CPU, one core each, nccl on GPUs); must divide the attention and KV "
                                              "heads")
    equality_atol: float = Field(0.02, gt=0, description="largest |logit difference| (on the prompt's last position, "
                                                         "float32) an attention implementation or the "
                                                         "tensor_parallel ranks may show against one process with "
                                                         "sdpa before the row is timed; above it the row records the "
                                                         "difference instead of a speed")
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

    def for_model(self, model: str) -> SpeedConfig:
        """The config to time `model` with: technique rows only for `technique_models`."""
        if self.technique_models == "all" or model in self.technique_models:
            return self
        return self.model_copy(update={"techniques": []})


@dataclass(frozen=True)
class GateSpec:
    """One gate: everything about it is here, and every reader asks this table (the recipe's fields, `compress
    check`'s rules, the evaluation in pipeline/results/gates.py). A new gate is one row, and its reader (a callable)
    under its name in pipeline/results/gates.py READERS: the report's types live a layer above this one. The name
    says the direction: max_* fails above the bound, min_* below it."""

    name: str  # the [validate.gates] field
    metric: str  # what the gate record calls the value
    applies: Literal["variant", "draft"]  # which models it judges (the draft: with its verifier)
    description: str
    limits: dict = dc_field(default_factory=dict)  # the bound's pydantic constraints (gt, ge, le)
    default: float | None = None  # the global default; None = off unless the recipe sets it
    skip_random_init: bool = False  # not applied to randomly initialised models; a bound of 0 turns it off
    needs_speed: bool = False  # needs [validate.speed] timings of the model and the baseline
    needs_tasks: bool = False  # needs [validate.tasks] scores of the model and the baseline
    needs_serve: bool = False  # needs [validate.serve] figures of the model (`compress check` refuses it unserved)
    serve_baseline: bool = False  # with needs_serve: of the baseline too (its value is a ratio to the baseline's)
    # its reader returns several records (one per task and/or the average) instead of one value
    multi: bool = False
    # judges calibrated variants of a Mixture-of-Experts model only: `compress check` refuses it on a dense model
    moe_only: bool = False

    @property
    def op(self) -> str:
        return "<=" if self.name.startswith("max_") else ">="


GATES: tuple[GateSpec, ...] = (
    GateSpec("max_ppl_ratio", "ppl_ratio", "variant",
             "variant ppl / baseline ppl, in process and as each engine serves it ([validate.serve] served "
             "perplexity on the same windows: one record per engine, so a served computation outside the bound fails "
             "too)", {"gt": 0}, multi=True),
    GateSpec("max_kl", "kl", "variant", "mean KL(baseline || variant), nats/token", {"ge": 0}),
    GateSpec("min_top1", "top1", "variant", "top-1 agreement with baseline", {"ge": 0, "le": 1}),
    GateSpec("max_footprint_ratio", "footprint_ratio", "variant",
             "in-memory footprint / baseline's", {"gt": 0}),
    GateSpec("min_decode_speed_ratio", "decode_speed_ratio", "variant",
             "batch-1 decode tokens/s / baseline's (needs speed for both)", {"gt": 0}, needs_speed=True),
    GateSpec("min_smoke_ok", "smoke_ok", "variant",
             "share of the smoke test's chat prompts answered with non-degenerate text; on by default "
             "(not applied to randomly initialised models)", {"ge": 0, "le": 1}, default=1.0, skip_random_init=True),
    GateSpec("min_acceptance", "acceptance", "draft", "draft acceptance rate alpha",
             {"ge": 0, "le": 1}),
    GateSpec("min_spec_speedup", "spec_speedup", "draft",
             "speculative speed-up over the verifier alone", {"gt": 0}),
    GateSpec("min_task_recovery", "task_recovery", "variant",
             "[validate.tasks] recovery above chance, (variant - chance) / (baseline - chance) on the same "
             "items, each task and the average (task_recovery_scope, task_recovery_bound); a task whose baseline is "
             "not above chance is excluded", {"gt": 0}, needs_tasks=True, multi=True),
    GateSpec("min_serve_tok_s_ratio", "serve_tok_s_ratio", "variant",
             "served output tok/s / baseline's at the same concurrency (lowest level ratio)", {"gt": 0},
             needs_serve=True, serve_baseline=True),
    GateSpec("max_serve_error_rate", "serve_error_rate", "variant",
             "share of load-test requests that failed through the server", {"ge": 0, "le": 1}, needs_serve=True),
    GateSpec("min_expert_tokens", "expert_tokens", "variant",
             "Mixture-of-Experts models: the fewest calibration tokens routed to any expert of any MoE layer (counted "
             "through the baseline; a variant with moe_all_experts: every calibration token it reads); judges the "
             "variants that calibrate, and the failure names each layer's starved experts", {"ge": 0}, multi=True,
             moe_only=True),
)
GATE_SPECS: dict[str, GateSpec] = {g.name: g for g in GATES}
# gate -> (metric it reads, which models it applies to): the table's short form
GATE_METRICS: dict[str, tuple[str, str]] = {g.name: (g.metric, g.applies) for g in GATES}


def _bound_fields(defaults: bool) -> dict:
    return {g.name: (float | None, Field(g.default if defaults else None, description=g.description, **g.limits))
            for g in GATES}


# Bounds; None = gate off. One field per row of GATES (per-model overrides: no defaults, a set field replaces
# the global bound).
GateBounds = create_model("GateBounds", __config__=ConfigDict(extra="forbid"), **_bound_fields(defaults=False))


# a base built at run time from GATES: mypy cannot see its fields (misc: "Unsupported dynamic base class")
class GatesConfig(create_model("_GlobalBounds",  # type: ignore[misc]
                               __config__=ConfigDict(extra="forbid"), **_bound_fields(defaults=True))):
    """`[validate.gates]`: global bounds, per-model overrides, and gates that only warn."""

    warn_only: list[str] = Field(default_factory=list, description="gate names that warn instead of failing")
    speculative_mode: str = Field("greedy", description="which speculative measurement the draft gates read")
    models: dict[str, GateBounds] = Field(
        default_factory=dict, description="per-model overrides (a set field replaces the global bound)"
    )
    task_recovery_bound: Literal["point", "lower"] = Field(
        "point", description="min_task_recovery judges the point recovery, or the lower end of its paired 95 % "
        "bootstrap interval (a gate that never passes on noise)")
    task_recovery_scope: Literal["each", "average", "both"] = Field(
        "both", description="min_task_recovery applies to each task, to the average over tasks, or both")

    @model_validator(mode="after")
    def _known_warn_only(self) -> GatesConfig:
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


def gate_path(gates: GatesConfig, model: str, gate: str) -> str:
    """Where a model's gate is set: its [validate.gates.models.<model>] override, else [validate.gates]."""
    override = gates.models.get(model)
    if override is not None and getattr(override, gate, None) is not None:
        return f"validate.gates.models.{model}.{gate}"
    return f"validate.gates.{gate}"


def gate_problems(gates: GatesConfig, speed: SpeedConfig | None, variants: list[str],
                  draft: str | None, smoke: bool = True, tasks=None) -> list[Problem]:
    """Cross-stage checks for `compress check` (empty = fine), sorted by message, one per message."""
    problems = []
    if not smoke and variants and any(gates.bounds_for(v).get("min_smoke_ok") for v in variants):
        problems.append(Problem("validate.gates.min_smoke_ok", "smoke-gate-without-smoke",
                                "[validate.gates].min_smoke_ok needs the smoke test, but [validate.smoke] enabled = "
                                "false; enable it, or set min_smoke_ok = 0 to run without it"))
    known = set(variants) | ({draft} if draft else set()) | {"baseline"}
    for name in gates.models:
        if name not in known:
            problems.append(Problem(f"validate.gates.models.{name}", "gate-model-unknown",
                                    f"[validate.gates.models.{name}]: no variant or draft named {name!r}; "
                                    f"known: {sorted(known - {'baseline'})}"))
    for model, kind in [(v, "variant") for v in variants] + ([(draft, "draft")] if draft else []):
        for gate in gates.bounds_for(model):
            metric, applies = GATE_METRICS[gate]
            if applies == "draft" and draft is None and kind == "variant":
                problems.append(Problem(gate_path(gates, model, gate), "draft-gate-without-draft",
                                        f"[validate.gates].{gate} needs a [draft]; the recipe has none"))
            if GATE_SPECS[gate].needs_speed and applies == kind:
                timed = _speed_models(speed)
                for needed in ("baseline", model):
                    if timed is not None and needed not in timed:
                        problems.append(Problem(gate_path(gates, model, gate), "speed-gate-model-not-timed",
                                                f"[validate.gates].{gate} for {model!r} needs speed for "
                                                f"{needed!r}, but [validate.speed] does not time it"))
    problems += _task_gate_problems(gates, tasks, variants)
    by_message = {p.message: p for p in reversed(problems)}  # one per message: the first found
    return sorted(by_message.values(), key=str)


def moe_gate_problems(gates: GatesConfig, variants: list[str], model_type: str, moe: bool) -> list[Problem]:
    """A gate on Mixture-of-Experts routing (min_expert_tokens) set for a variant of a dense model: refused, naming
    the model type (it has no experts to count)."""
    if moe:
        return []
    out = []
    for v in variants:
        for gate in (g for g in gates.bounds_for(v) if GATE_SPECS[g].moe_only):
            out.append(Problem(gate_path(gates, v, gate), "moe-gate-on-dense-model",
                               f"[validate.gates].{gate} counts the calibration tokens routed to each expert, but "
                               f"model_type {model_type or '?'!r} is not a Mixture-of-Experts model (no experts); "
                               f"drop {gate}"))
    return sorted({p.message: p for p in out}.values(), key=str)


def _task_gate_problems(gates: GatesConfig, tasks, variants: list[str]) -> list[Problem]:
    """A task gate (min_task_recovery) needs [validate.tasks] enabled for the baseline and the gated variant."""
    if tasks is None:
        return []
    out = []
    for v in variants:
        for gate in (g for g in gates.bounds_for(v) if GATE_SPECS[g].needs_tasks):
            for needed in ("baseline", v):
                if not tasks.scores(needed):
                    out.append(Problem(gate_path(gates, v, gate), "task-gate-model-not-scored",
                                       f"[validate.gates].{gate} for {v!r} needs [validate.tasks] scores for "
                                       f"{needed!r} (enabled = true, tasks, models)"))
    return out


def _speed_models(speed: SpeedConfig | None) -> set[str] | None:
    """Models timed by the speed config: None = all of them, empty set = none."""
    if speed is None or not speed.enabled:
        return set()
    return None if speed.models == "all" else set(speed.models)


def speed_problems(speed: SpeedConfig, variants: list[str], draft: str | None) -> list[Problem]:
    """Cross-stage checks for `compress check`: speed model names that do not exist."""
    known = {"baseline", *variants, *([draft] if draft else [])}
    problems = []
    for field in ("models", "technique_models"):
        names = getattr(speed, field)
        for name in ([] if names == "all" else names):
            if name not in known:
                problems.append(Problem(f"validate.speed.{field}", "speed-model-unknown",
                                        f"[validate.speed].{field}: no model named {name!r}; known: {sorted(known)}"))
    return problems

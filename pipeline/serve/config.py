"""`[validate.serve]`: serve each model's checkpoint with `compress serve` and load-test it (torch-free: the recipe
check imports it). Off by default: on 2 cores it adds about a minute per model for a 135 M model."""
from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pipeline.base.problem import Problem
from pipeline.quant.registry import METHODS
from pipeline.serve import engines
from pipeline.serve.engines.base import CHOICES, describe

if TYPE_CHECKING:  # built at run time from the engine registry, as QuantVariant is from the methods'
    EngineName = str
    EngineChoice = str
else:
    EngineName = Literal[engines.REGISTERED]
    EngineChoice = Literal[("auto", *engines.REGISTERED)]
_DEFAULT_ENGINES: tuple[EngineChoice, ...] = ("auto",)


class EngineOptions(BaseModel):
    """[validate.serve] engine_options.<engine>: a computation the engine offers a choice between (CHOICES in
    pipeline/serve/engines/base.py), passed to `compress serve` as its flag. An engine that does not declare the
    choice (Engine.honours) refuses it at `compress check`."""
    model_config = ConfigDict(extra="forbid")

    int8_activations: bool | None = Field(
        None, description="vllm on a CPU: true multiplies 4-bit weights with int8-quantized activations (its W4A8 "
                          "paths, VLLM_CPU_INT4_W4A8=1; vLLM's default in bfloat16 on AMX CPUs, and for "
                          "compressed-tensors W4A16 on AMD Zen CPUs with zentorch installed), false with 16-bit ones "
                          "(W4A16: the computation scored in process); unset: vLLM's default. The served record says "
                          "which path ran (int8_activations) and max_ppl_ratio judges it")


class ServeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="serve the selected models in each engine and load-test them "
                                             "(validate/<model>/serve/<engine>)")
    models: Literal["all"] | list[str] = Field("all", description="which models are served ('all' or names)")
    engines: Literal["all"] | list[EngineChoice] = Field(
        default_factory=lambda: list(_DEFAULT_ENGINES),
        description="engines each model is served and load-tested in, one unit each. auto: transformers for Hugging "
                    "Face checkpoints, llama.cpp for a GGUF variant (skipped with a recorded reason when "
                    "llama-cpp-python is not installed); all: every engine that declares the model's format on this "
                    "device (pipeline/serve/engines), those not installed skipped with the reason recorded; a named "
                    "engine serves the models whose format it declares and must be installed")
    engine_models: dict[EngineName, list[str]] = Field(
        default_factory=dict,
        description="an engine named here serves only these models (of those `models` and `engines` select), e.g. "
                    "{ vllm = [\"gptq-w4g64\"] } to serve only the deployed export in vLLM; an engine not named "
                    "serves every selected model. Which units exist, not what they measure: not in any identity")
    engine_options: dict[EngineName, EngineOptions] = Field(
        default_factory=dict,
        description="per engine, the computation it serves where it offers a choice, e.g. { vllm = { "
                    "int8_activations = false } } (compress serve --no-int8-activations); part of that engine's serve "
                    "units' identity only")
    concurrency: list[int] = Field(default_factory=lambda: [1, 4, 16],
                                   description="load-test levels (concurrent streaming clients)")
    requests_per_level: int | None = Field(None, ge=1, description="requests per level (None: 2 x concurrency, "
                                                                    "at least 4)")
    max_tokens: int = Field(32, ge=1, description="output tokens per request (ignore_eos: always this many)")
    prompt_words: int = Field(64, ge=1, description="words per prompt, drawn from the perplexity corpus")
    equality_prompts: int = Field(3, ge=0, description="prompts whose greedy output through the server is compared "
                                                      "with generate's (token for token on transformers; by text "
                                                      "on llama.cpp, against the dequantized checkpoint)")
    equality_tokens: int = Field(16, ge=1, description="tokens generated per equality prompt")
    max_model_len: int = Field(512, ge=2, description="longest prompt + output served (sizes the KV cache)")
    compile: bool = Field(True, description="vllm: let vLLM compile the model (its default; on 2 cores ~60-90 s more "
                                            "start-up per model for 1.2-1.4x eager mode's throughput); false: "
                                            "--enforce-eager")
    timeout_s: float = Field(300.0, gt=0, description="longest a request (and the server's start) may take")
    tensor_parallel_size: int = Field(1, ge=1, description="vllm: its --tensor-parallel-size (the heads split over "
                                                           "ranks, one core or GPU each; must divide the attention "
                                                           "heads); engines without it are refused above 1")
    pipeline_parallel_size: int = Field(1, ge=1, description="vllm: its --pipeline-parallel-size (the layers split "
                                                             "over ranks, one core or GPU each)")
    perplexity: bool = Field(True, description="vllm: also score the [validate.perplexity] windows through the "
                                               "server (its prompt log-probabilities; the quality stage's ids and "
                                               "windows) and record that perplexity beside the in-process one; its "
                                               "server then holds a window (max_model_len at least the window + 8). "
                                               "The other engines return no prompt log-probabilities: not scored")

    @field_validator("engines")
    @classmethod
    def _engines(cls, v):
        if isinstance(v, list) and (not v or len(set(v)) < len(v)):
            raise ValueError("engines: 'all' or a list of distinct engines")
        return v

    @field_validator("concurrency")
    @classmethod
    def _levels(cls, v: list[int]) -> list[int]:
        if not v or any(c < 1 for c in v):
            raise ValueError("concurrency: one or more levels, each >= 1")
        return v

    def serves(self, name: str) -> bool:
        return self.enabled and (self.models == "all" or name in self.models)

    def option(self, engine: str, choice: str):
        """engine_options.<engine>.<choice>, None when unset (the engine's own default)."""
        opts = self.engine_options.get(engine)
        return getattr(opts, choice) if opts is not None else None

    def engine_serves(self, engine: str, name: str) -> bool:
        """Whether `engine_models` lets `engine` serve model `name` (an engine it does not name serves all)."""
        return engine not in self.engine_models or name in self.engine_models[engine]


def model_format(method: str | None, fmt: str | None = None) -> str:
    """The checkpoint format validate serves for a model, as engines declare formats: the baseline (method None) is
    "unquantized", a variant the format its recipe entry asks for (`fmt`, pipeline.quant.registry.variant_format),
    else its method's checkpoint format ("gptq", "awq", "bitsandbytes", "torchao", "gguf")."""
    if method is None:
        return "unquantized"
    if fmt is not None:
        return fmt

    return METHODS.get(method).checkpoint_format


def engine_plan(cfg: ServeConfig, fmt: str, device: str, model: str, model_class: str | None = None,
                needs: tuple[str, ...] = (), config: dict | None = None
                ) -> tuple[dict[str, str | None], list[tuple[str, str | None]]]:
    """({engine: None to serve it, or why it is skipped}, [(engine, why it cannot)]) for one model of format `fmt`.
    "all": every engine declaring the format here, one not installed skipped with its reason. A list: "auto" is the
    format's default engine (skipped with its reason when that is an extra not installed); a named engine serves the
    models whose format it declares, must be installed, and a model that no listed engine declares is refused.
    An engine that `engine_models` keeps for other models is not asked for this one at all."""
    declared = engines.declared(fmt, device)
    why = engines.engines_for(fmt, device, model_class, needs, config)
    if cfg.engines == "all":
        return {n: why[n] for n in declared if cfg.engine_serves(n, model)}, []
    plan, problems = {}, []
    for asked in cfg.engines:
        name = engines.default_engine(fmt) if asked == "auto" else asked
        if name in plan or not cfg.engine_serves(name, model):
            continue
        if name not in declared:
            problems.append((name, why[name]))
        elif why[name] is None or (asked == "auto" and engines.get(name).optional):
            plan[name] = why[name]
        else:
            problems.append((name, why[name]))
    if plan:  # a named engine that does not declare this format is simply not asked for this model
        problems = [(n, w) for n, w in problems if n in declared]
    return plan, problems


def serve_plan(cfg: ServeConfig, models: list[tuple[str, str | None] | tuple[str, str | None, str | None]],
               device: str, model_class: str | None = None, needs: dict[str, tuple[str, ...]] | None = None,
               config: dict | None = None) -> tuple[list[Problem], dict[str, dict[str, str | None]]]:
    """`compress check` for [validate.serve]: (problems, {model: {engine: None (served) or why it is skipped}}).
    `models` are (name, method) pairs, the baseline's method None, or (name, method, format) when a variant asks
    for another format than its method's default; `config` the model's config.json (the shapes an engine may lack
    kernels for). A model no engine can serve here is refused, naming the engines that can."""
    problems: list[Problem] = []
    out: dict[str, dict[str, str | None]] = {}
    served = [n for n, *_ in models if cfg.serves(n)]
    problems += option_problems(cfg)
    for engine, names in cfg.engine_models.items():
        if unknown := [n for n in names if n not in served]:
            problems.append(Problem(f"validate.serve.engine_models.{engine}", "serve-engine-models-unknown",
                                    f"[validate.serve] engine_models.{engine}: {', '.join(map(repr, unknown))} not "
                                    f"among the served models ({', '.join(served) or 'none'})"))
    asked: list[str | None]
    for name, method, *asked in models:
        if not cfg.serves(name):
            continue
        fmt = model_format(method, *asked)
        plan, refused = engine_plan(cfg, fmt, device, name, model_class, (needs or {}).get(name, ()), config)
        what = describe(fmt) if fmt == "gguf" else f"a Hugging Face checkpoint ({method or 'unquantized'})"
        able = engines.able(engines.engines_for(fmt, device, model_class, (needs or {}).get(name, ()), config))
        for other, why in refused:
            problems.append(Problem("validate.serve.engines", "serve-engine-cannot-serve",
                                    f"[validate.serve] engines = {cfg.engines!r}: {other} cannot serve {name!r} "
                                    f"({what}) here: {why}; {able} (set "
                                    f"engines = ['auto'] or leave {name!r} out of [validate.serve] models)"))
        if not plan and not refused:
            problems.append(Problem("validate.serve.engines", "serve-no-engine",
                                    f"[validate.serve] engines = {cfg.engines!r}: no engine serves {name!r} ({what}) "
                                    "here" + (f" (engine_models: {cfg.engine_models})" if cfg.engine_models else "")))
        out[name] = plan
    return problems, out


def option_problems(cfg: ServeConfig) -> list[Problem]:
    """engine_options: a choice set for an engine that does not offer it (Engine.honours) is refused, naming the
    engine and those that offer it."""
    out = []
    for engine, opts in cfg.engine_options.items():
        for choice in CHOICES:
            if getattr(opts, choice) is None or choice in engines.get(engine).honours:
                continue
            able = [n for n in engines.NAMES if choice in engines.get(n).honours]
            out.append(Problem(f"validate.serve.engine_options.{engine}", "serve-option-not-offered",
                               f"[validate.serve] engine_options.{engine}.{choice}: engine {engine} offers no "
                               f"{choice} choice (it serves one computation); only {', '.join(able) or 'no engine'} "
                               f"does: set it under engine_options.{able[0] if able else '<engine>'} or leave it out"))
    return out

"""`[validate.serve]`: serve each model's checkpoint with `compress serve` and load-test it (torch-free: the recipe
check imports it). Off by default: on 2 cores it adds about a minute per model for a 135 M model."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class ServeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    models: Literal["all"] | list[str] = Field("all", description="which models are served ('all' or names)")
    engine: Literal["auto", "transformers", "llama.cpp", "vllm"] = Field(
        "auto", description="auto: transformers for Hugging Face checkpoints, llama.cpp for a GGUF variant "
                            "(skipped with a recorded reason when llama-cpp-python is not installed)")
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
    timeout_s: float = Field(300.0, gt=0, description="longest a request (and the server's start) may take")

    @field_validator("concurrency")
    @classmethod
    def _levels(cls, v: list[int]) -> list[int]:
        if not v or any(c < 1 for c in v):
            raise ValueError("concurrency: one or more levels, each >= 1")
        return v

    def serves(self, name: str) -> bool:
        return self.enabled and (self.models == "all" or name in self.models)


def model_format(method: str | None) -> str:
    """What validate serves for a model: the baseline (method None) and every variant whose method writes a
    Hugging Face folder are "hf"; a method whose checkpoint format is GGUF writes one .gguf file."""
    if method is None:
        return "hf"
    from pipeline.quant.registry import METHODS

    return "gguf" if METHODS.get(method).checkpoint_format == "gguf" else "hf"


def serve_plan(cfg: ServeConfig, models: list[tuple[str, str | None]], cuda: bool) -> tuple[list[str], dict[str, str]]:
    """`compress check` for [validate.serve]: (problems, {model: why its serving is skipped}). `models` are
    (name, method) pairs, the baseline's method None. A model no engine can serve here is refused, naming the
    engines that can; with engine = "auto", a GGUF variant while llama-cpp-python is missing is skipped instead
    (recorded in the report), since that is an optional extra and not a wrong recipe."""
    from pipeline.serve.folder import able, default_engine, engines_for, llama_cpp_missing

    problems, skipped = [], {}
    for name, method in models:
        if not cfg.serves(name):
            continue
        fmt = model_format(method)
        why = engines_for(fmt, cuda)
        engine = default_engine(fmt) if cfg.engine == "auto" else cfg.engine
        if why[engine] is None:
            continue
        if cfg.engine == "auto" and engine == "llama.cpp" and why[engine] == llama_cpp_missing():
            skipped[name] = why[engine]
            continue
        what = "a GGUF file" if fmt == "gguf" else f"a Hugging Face checkpoint ({method or 'unquantized'})"
        problems.append(f"[validate.serve] engine = {cfg.engine!r}: {engine} cannot serve {name!r} ({what}) here: "
                        f"{why[engine]}; {able(why)} (set engine = 'auto' or leave {name!r} out of "
                        "[validate.serve] models)")
    return problems, skipped

"""`[validate.serve]`: serve each model's checkpoint with `compress serve` and load-test it (torch-free: the recipe
check imports it). Off by default: on 2 cores it adds about a minute per model for a 135 M model."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class ServeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    models: Literal["all"] | list[str] = Field("all", description="which models are served ('all' or names)")
    concurrency: list[int] = Field(default_factory=lambda: [1, 4, 16],
                                   description="load-test levels (concurrent streaming clients)")
    requests_per_level: int | None = Field(None, ge=1, description="requests per level (None: 2 x concurrency, "
                                                                    "at least 4)")
    max_tokens: int = Field(32, ge=1, description="output tokens per request (ignore_eos: always this many)")
    prompt_words: int = Field(64, ge=1, description="words per prompt, drawn from the perplexity corpus")
    equality_prompts: int = Field(3, ge=0, description="prompts whose greedy output through the server is compared "
                                                      "with generate's, token for token")
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

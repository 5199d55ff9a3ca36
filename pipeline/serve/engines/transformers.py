"""transformers' continuous-batching manager behind compress's own FastAPI app (pipeline/serve/app.py,
pipeline/serve/engine.py), in this process: every option applied, every route but /health behind the key, the
SIGTERM drain of pipeline/serve/drain.py (socket kept open, 503 to new requests). The serving is
pipeline/serve/work/transformers.py."""
from __future__ import annotations

import logging
from importlib.metadata import version

from pipeline.serve.engines.base import UNQUANTIZED, Engine

log = logging.getLogger("compress.serve")
HF_FORMATS = (UNQUANTIZED, "gptq", "awq", "bitsandbytes", "torchao", "compressed-tensors", "compressed-tensors-fp8")


class Transformers(Engine):
    name = "transformers"
    formats = {"cpu": HF_FORMATS, "cuda": HF_FORMATS}
    exact = True  # the same weights and kernels as generate: token for token
    reference = True  # report.md's "x transformers": the other engines' throughput over this one's
    scores_tasks = True  # compress's own server: echo + logprobs on token-id batches (tests/unit/test_serve_openai.py)
    work = "pipeline.serve.work.transformers"

    def version(self) -> dict[str, str]:
        return {"transformers": version("transformers")}

    def refuses_model(self, config: dict, device: str, fmt: str = UNQUANTIZED, needs: tuple[str, ...] = ()
                      ) -> str | None:
        return paged_cache_missing(config)


def paged_cache_missing(config: dict) -> str | None:
    """Why transformers' continuous batching (its paged KV cache: one head size for keys and values) cannot serve
    this model, or None. Multi-head latent attention (deepseek_v3) caches keys of qk_nope_head_dim + qk_rope_head_dim
    and values of v_head_dim; where they differ the manager fails every request (transformers 5.24: "index_copy_():
    Source/destination tensor must have same slice shapes", measured on the architecture matrix's deepseek_v3)."""
    cfg = config.get("text_config") or config
    if not cfg.get("kv_lora_rank"):
        return None
    key = (cfg.get("qk_nope_head_dim") or 0) + (cfg.get("qk_rope_head_dim") or 0)
    value = cfg.get("v_head_dim")
    if not key or not value or key == value:
        return None
    return (f"transformers' continuous batching (its paged KV cache holds one head size for keys and values) cannot "
            f"serve {cfg.get('model_type') or 'this model'}'s multi-head latent attention: keys of {key} "
            f"(qk_nope_head_dim + qk_rope_head_dim) and values of {value} (v_head_dim); every request would fail. "
            "Serve it with vLLM (its MLA backends) or llama.cpp")


ENGINES = (Transformers,)

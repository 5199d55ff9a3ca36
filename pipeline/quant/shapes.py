"""A model's quantizable linears, read from its config.json through the model-family table (pipeline/model/families.py),
and the `modules_to_skip` rule every method applies to them. Torch-free."""
from __future__ import annotations

import re

from pipeline.model.families import LLAMA, family_of, linear_shapes


def linear_shapes_from_config(config: dict) -> dict:
    """In/out features of every linear of a config.json whose family pipeline/model/families.py knows, keyed by name
    inside a layer.

    {"model_type", "shapes_known", "num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size",
     "linear_in_features": {"self_attn.q_proj": 576, ..., "lm_head": 576}, "linear_out_features": {...},
     "layers" (the decoder layers' module path), "rope_type" (None or "default" = plain RoPE), "attention_bias",
     "mlp_bias"}
    For other model types shapes_known is False and the shape checks are skipped (said by check_variant's caller).
    """
    mt = config.get("model_type", "")
    out = {k: config.get(k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size",
                                      "tie_word_embeddings")}
    out.update(model_type=mt, shapes_known=False, linear_in_features={}, linear_out_features={})
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}  # transformers 5 / older config.json
    out.update(rope_type=rope.get("rope_type", rope.get("type")), attention_bias=config.get("attention_bias"),
               mlp_bias=config.get("mlp_bias"))
    shapes = linear_shapes(config)
    if shapes is None:
        return out
    out.update(shapes_known=True, layers=family_of(config).layers,
               linear_in_features={k: v[0] for k, v in shapes.items()},
               linear_out_features={k: v[1] for k, v in shapes.items()})
    return out


def module_names(arch: dict) -> list[str]:
    """Full names of the linear modules (<layers>.<i>.<name>, lm_head)."""
    n, layers = arch.get("num_hidden_layers") or 0, arch.get("layers", LLAMA.layers)
    inner = [k for k in arch["linear_in_features"] if k != "lm_head"]
    names = [f"{layers}.{i}.{k}" for i in range(n) for k in inner]
    return names + (["lm_head"] if "lm_head" in arch["linear_in_features"] else [])


def skip_pattern(entry: str) -> str:
    """Regex for one modules_to_skip entry: the module name itself or any name ending in '.<entry>'."""
    return rf"^(?:.*\.)?{re.escape(entry)}$"


def is_skipped(name: str, modules_to_skip: list[str]) -> bool:
    return any(re.match(skip_pattern(e), name) for e in modules_to_skip)


def quantized_linears(arch: dict, modules_to_skip: list[str]) -> dict[str, tuple[int, int]]:
    """{kind (e.g. 'self_attn.q_proj'): (in, out)} of the linears the variant quantizes."""
    kinds = {}
    for full in module_names(arch):
        if not is_skipped(full, modules_to_skip):
            prefix = arch.get("layers", LLAMA.layers) + "."
            kind = full[len(prefix):].split(".", 1)[-1] if full.startswith(prefix) else full
            kinds[kind] = (arch["linear_in_features"][kind], arch["linear_out_features"][kind])
    return kinds

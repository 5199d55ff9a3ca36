"""A model's quantizable linears, read from its config.json through the model-family table (pipeline/model/families.py),
and the `modules_to_skip` rule every method applies to them. Torch-free."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from pipeline.model.families import LLAMA, family_of, linear_shapes


@dataclass(frozen=True)
class Arch:
    """What the quantization checks read of a model's config.json (`linear_shapes_from_config`): its size, and the
    in/out features of every linear keyed by name inside a layer ({"self_attn.q_proj": 576, ..., "lm_head": 576}).
    For a model type pipeline/model/families.py does not know, shapes_known is False, the feature maps are empty
    and the shape checks are skipped (said by check_variant's caller)."""

    model_type: str
    shapes_known: bool = False
    num_hidden_layers: int | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None
    vocab_size: int | None = None
    tie_word_embeddings: bool | None = None
    rope_type: str | None = None  # None or "default": plain RoPE
    attention_bias: bool | None = None
    mlp_bias: bool | None = None
    linear_in_features: dict[str, int] = field(default_factory=dict)
    linear_out_features: dict[str, int] = field(default_factory=dict)
    layers: str = LLAMA.layers  # the decoder layers' module path (the family's when shapes_known)


def linear_shapes_from_config(config: dict) -> Arch:
    """The Arch of a config.json (see Arch)."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}  # transformers 5 / older config.json
    known = dict(model_type=config.get("model_type", ""), num_hidden_layers=config.get("num_hidden_layers"),
                 hidden_size=config.get("hidden_size"), intermediate_size=config.get("intermediate_size"),
                 vocab_size=config.get("vocab_size"), tie_word_embeddings=config.get("tie_word_embeddings"),
                 rope_type=rope.get("rope_type", rope.get("type")), attention_bias=config.get("attention_bias"),
                 mlp_bias=config.get("mlp_bias"))
    shapes = linear_shapes(config)
    if shapes is None:
        return Arch(**known)
    family = family_of(config)
    assert family is not None  # linear_shapes answers only for a known family
    return Arch(**known, shapes_known=True, layers=family.layers,
                linear_in_features={k: v[0] for k, v in shapes.items()},
                linear_out_features={k: v[1] for k, v in shapes.items()})


def module_names(arch: Arch) -> list[str]:
    """Full names of the linear modules (<layers>.<i>.<name>, lm_head)."""
    n, layers = arch.num_hidden_layers or 0, arch.layers
    inner = [k for k in arch.linear_in_features if k != "lm_head"]
    names = [f"{layers}.{i}.{k}" for i in range(n) for k in inner]
    return names + (["lm_head"] if "lm_head" in arch.linear_in_features else [])


def skip_pattern(entry: str) -> str:
    """Regex for one modules_to_skip entry: the module name itself or any name ending in '.<entry>'."""
    return rf"^(?:.*\.)?{re.escape(entry)}$"


def is_skipped(name: str, modules_to_skip: list[str]) -> bool:
    return any(re.match(skip_pattern(e), name) for e in modules_to_skip)


def quantized_linears(arch: Arch, modules_to_skip: list[str]) -> dict[str, tuple[int, int]]:
    """{kind (e.g. 'self_attn.q_proj'): (in, out)} of the linears the variant quantizes."""
    kinds = {}
    for full in module_names(arch):
        if not is_skipped(full, modules_to_skip):
            prefix = arch.layers + "."
            kind = full[len(prefix):].split(".", 1)[-1] if full.startswith(prefix) else full
            kinds[kind] = (arch.linear_in_features[kind], arch.linear_out_features[kind])
    return kinds

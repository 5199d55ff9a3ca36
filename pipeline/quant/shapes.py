"""A model's quantizable linears, read from its config.json through the architecture source
(pipeline/model/architecture.py: GPTQModel's definitions as data), and the `modules_to_skip` rule every method
applies to them. Torch-free."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from pipeline.model.architecture import EXPERT, Architecture, architecture_of


@dataclass(frozen=True)
class Arch:
    """What the quantization checks read of a model's config.json (`linear_shapes_from_config`): its size, its
    architecture (pipeline/model/architecture.py) and the in/out features of every linear keyed by its kind inside
    a layer ({"self_attn.q_proj": 576, ..., "mlp.experts.#.gate_proj": 64, "lm_head": 576}). For a model type no
    architecture definition covers, shapes_known is False, the feature maps are empty and the shape checks are
    skipped (said by check_variant's caller)."""

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
    layers: str = "model.layers"  # the decoder layers' module path (the architecture's when known)
    architecture: Architecture | None = field(default=None, compare=False)

    @property
    def is_moe(self) -> bool:
        return self.architecture is not None and self.architecture.is_moe


def linear_shapes_from_config(config: dict) -> Arch:
    """The Arch of a config.json (see Arch)."""
    sub = config.get("text_config")
    text: dict = sub if isinstance(sub, dict) else config
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}  # transformers 5 / older config.json
    known = dict(model_type=text.get("model_type", "") or config.get("model_type", ""),
                 num_hidden_layers=text.get("num_hidden_layers"),
                 hidden_size=text.get("hidden_size"), intermediate_size=text.get("intermediate_size"),
                 vocab_size=text.get("vocab_size"), tie_word_embeddings=text.get("tie_word_embeddings"),
                 rope_type=rope.get("rope_type", rope.get("type")), attention_bias=text.get("attention_bias"),
                 mlp_bias=text.get("mlp_bias"))
    arch = architecture_of(config)
    shapes = {k: arch.shape(k) for k in (*arch.linear_kinds(), "lm_head")} if arch.known else {}
    if not arch.known or not text.get("hidden_size") or any(v is None for v in shapes.values()):
        return Arch(**known, architecture=arch, layers=arch.layers)
    full = {k: v for k, v in shapes.items() if v is not None}
    return Arch(**known, shapes_known=True, layers=arch.layers, architecture=arch,
                linear_in_features={k: v[0] for k, v in full.items()},
                linear_out_features={k: v[1] for k, v in full.items()})


def module_kinds(arch: Arch) -> list[tuple[str, str]]:
    """(full module name, its kind) of every quantizable linear: <layers>.<i>.<kind>, each routed expert's index in
    place of EXPERT, then lm_head."""
    out = []
    a = arch.architecture
    for i in range(arch.num_hidden_layers or 0):
        kinds = a.layer_linears(i) if a is not None else tuple(k for k in arch.linear_in_features if k != "lm_head")
        for kind in kinds:
            if kind not in arch.linear_in_features:
                continue
            if EXPERT in kind.split(".") and a is not None and a.experts is not None:
                out += [(f"{arch.layers}.{i}.{kind.replace(EXPERT, str(e))}", kind) for e in range(a.experts.count)]
            else:
                out.append((f"{arch.layers}.{i}.{kind}", kind))
    return out + ([("lm_head", "lm_head")] if "lm_head" in arch.linear_in_features else [])


def module_names(arch: Arch) -> list[str]:
    """Full names of the linear modules (<layers>.<i>.<name>, experts expanded, lm_head)."""
    return [full for full, _ in module_kinds(arch)]


def skip_pattern(entry: str) -> str:
    """Regex for one modules_to_skip entry: the module name itself or any name ending in '.<entry>'."""
    return rf"^(?:.*\.)?{re.escape(entry)}$"


def is_skipped(name: str, modules_to_skip: list[str]) -> bool:
    return any(re.match(skip_pattern(e), name) for e in modules_to_skip)


def quantized_linears(arch: Arch, modules_to_skip: list[str]) -> dict[str, tuple[int, int]]:
    """{kind (e.g. 'self_attn.q_proj'): (in, out)} of the linears the variant quantizes."""
    return {kind: (arch.linear_in_features[kind], arch.linear_out_features[kind])
            for full, kind in module_kinds(arch) if not is_skipped(full, modules_to_skip)}

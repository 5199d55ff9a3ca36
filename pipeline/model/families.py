"""Model families as data (GPTQModel's habit: an architecture is a table entry, not regexes in three modules).

One `Family` per decoder family: the config.json `model_type`s it covers, where its decoder layers live, and each
linear layer's (in, out) features as a function of the config's dimensions. The quantization checks (bits, group
sizes, skips), the runtime tables, the bits-per-weight count and the draft builder read it. Torch-free.

A model whose family is not here still runs; `compress check` says its shape checks were skipped and names the
model_type to add here (`unknown_family`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

Dims = dict  # hidden, inter, heads, kv_heads, head_dim, vocab


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    layers: str  # the decoder layers' module path: "<layers>.<i>.<linear>"
    linears: dict[str, Callable[[Dims], tuple[int, int]]]  # linear name inside a layer (or "lm_head") -> (in, out)
    head: str = "lm_head"
    # SmoothQuant's fold points inside a layer: (the module whose output feeds the linears, those linears). A norm
    # takes 1/s on its weight; a linear (v_proj before o_proj) on its output rows, repeated over the query heads
    # that share each key/value head
    smooth: tuple[tuple[str, tuple[str, ...]], ...] = ()


def _dims(config: dict) -> Dims:
    h = config["hidden_size"]
    heads = config.get("num_attention_heads") or 1
    return {"hidden": h, "inter": config["intermediate_size"], "heads": heads,
            "kv_heads": config.get("num_key_value_heads") or heads, "head_dim": config.get("head_dim") or h // heads,
            "vocab": config.get("vocab_size") or 0}


LLAMA = Family(
    "llama", ("llama", "mistral", "qwen2", "qwen3", "granite", "olmo2"), "model.layers",
    {
        "self_attn.q_proj": lambda d: (d["hidden"], d["heads"] * d["head_dim"]),
        "self_attn.k_proj": lambda d: (d["hidden"], d["kv_heads"] * d["head_dim"]),
        "self_attn.v_proj": lambda d: (d["hidden"], d["kv_heads"] * d["head_dim"]),
        "self_attn.o_proj": lambda d: (d["heads"] * d["head_dim"], d["hidden"]),
        "mlp.gate_proj": lambda d: (d["hidden"], d["inter"]),
        "mlp.up_proj": lambda d: (d["hidden"], d["inter"]),
        "mlp.down_proj": lambda d: (d["inter"], d["hidden"]),
        "lm_head": lambda d: (d["hidden"], d["vocab"]),
    },
    smooth=(("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
            ("self_attn.v_proj", ("self_attn.o_proj",))),
)

FAMILIES: tuple[Family, ...] = (LLAMA,)
BY_MODEL_TYPE: dict[str, Family] = {mt: f for f in FAMILIES for mt in f.model_types}


def family_of(config: dict) -> Family | None:
    return BY_MODEL_TYPE.get(config.get("model_type", ""))


def linear_shapes(config: dict) -> dict[str, tuple[int, int]] | None:
    """{linear name: (in, out)} for a known family whose config has its dimensions; None otherwise."""
    fam = family_of(config)
    if fam is None or not config.get("hidden_size") or not config.get("intermediate_size"):
        return None
    d = _dims(config)
    return {name: shape(d) for name, shape in fam.linears.items()}


def unknown_family(model_type: str) -> str:
    """The one line `compress check` prints for a model_type no family covers."""
    known = ", ".join(sorted(BY_MODEL_TYPE))
    return (f"model_type {model_type!r} is not in pipeline/model/families.py (known: {known}): its linear shapes are "
            "unknown, so group-size and skip checks are skipped; add a Family row for it")

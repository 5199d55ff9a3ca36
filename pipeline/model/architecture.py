"""What compress knows of a model's architecture, derived from the library that has it: GPTQModel's own
definitions (its `models/definitions/*.py` classes and `models/auto.py` MODEL_MAP), read as data with `ast`
(torch-free: `compress check` never imports GPTQModel), and the config.json's dimensions.

    arch = architecture_of(config)        # Architecture, or one with `definition is None` and `missing` said
    arch.layer_linears(i)                 # ("self_attn.q_proj", ..., "mlp.experts.#.gate_proj", ...) in layer i
    arch.shape("self_attn.q_proj")        # (in, out) from the config, or None when no rule gives it

GPTQModel's module tree grammar (its base.py, "module_tree"): `[<path>..., "#", {block: leaves}]`, a leaf
`"name:subset[:flags]"`, `":!"` = runs but is not quantized (norms, routers), `"a|b"` = alternative names, a
block key `"mlp:moe"` = a Mixture-of-Experts block, `"#"` inside it = one entry per expert (count from the
config field named by the class's `dynamic_expert_index`). The tree names experts one module per expert, as
GPTQModel writes them to a checkpoint; transformers 5 holds a MoE's routed experts as fused 3D parameters
(`experts.gate_up_proj` [E, 2I, H]), which GPTQModel splits while it quantizes (`fused_experts`).

Every feature that needs a model's structure asks this module: the quantization checks (pipeline/quant/shapes.py),
the W8A8 fold points, the methods' architecture rules (pipeline/quant/arch_support.py), the draft builder.
Where GPTQModel has no definition, `LOCAL` holds a short entry; a model_type in neither is named by `missing`.
"""
from __future__ import annotations

import ast
import contextlib
import importlib.util
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

EXPERT = "#"  # the expert index in a linear's name inside a layer: "mlp.experts.#.gate_proj"

# model_types GPTQModel maps to a definition whose tree does not match transformers 5.24's modules, with the tree
# compress uses instead (checked against the meta-device model by tests/unit/test_architecture.py)
LOCAL: dict[str, list] = {
    # GPTQModel's LlamaQModel tree names input_layernorm; OLMo 2 normalises each block's output instead
    "olmo2": ["model", "layers", "#", {
        "self_attn": ("q_proj:0", "k_proj:0", "v_proj:0", "o_proj:1", "q_norm:!", "k_norm:!"),
        "post_attention_layernorm": ("post_attention_layernorm:!",),
        "mlp": ("gate_proj:0", "up_proj:0", "down_proj:1"),
        "post_feedforward_layernorm": ("post_feedforward_layernorm:!",)}],
    # GPTQModel's Phi3QModel names gate_proj/up_proj; transformers' Phi3MLP has one fused gate_up_proj
    "phi3": ["model", "layers", "#", {
        "input_layernorm": ("input_layernorm:!",),
        "self_attn": ("qkv_proj:0", "o_proj:1"),
        "post_attention_layernorm": ("post_attention_layernorm:!",),
        "mlp": ("gate_up_proj:0", "down_proj:1")}],
    # Gemma 2 / 3: a norm after attention and after the MLP (sandwich), a pre-feedforward norm before the MLP
    "gemma2": ["model", "layers", "#", {
        "input_layernorm": ("input_layernorm:!",),
        "self_attn": ("q_proj:0", "k_proj:0", "v_proj:0", "o_proj:1"),
        "post_attention_layernorm": ("post_attention_layernorm:!",),
        "pre_feedforward_layernorm": ("pre_feedforward_layernorm:!",),
        "mlp": ("gate_proj:0", "up_proj:0", "down_proj:1"),
        "post_feedforward_layernorm": ("post_feedforward_layernorm:!",)}],
    "gemma3_text": ["model", "layers", "#", {
        "input_layernorm": ("input_layernorm:!",),
        "self_attn": ("q_proj:0", "k_proj:0", "v_proj:0", "o_proj:1", "q_norm:!", "k_norm:!"),
        "post_attention_layernorm": ("post_attention_layernorm:!",),
        "pre_feedforward_layernorm": ("pre_feedforward_layernorm:!",),
        "mlp": ("gate_proj:0", "up_proj:0", "down_proj:1"),
        "post_feedforward_layernorm": ("post_feedforward_layernorm:!",)}],
    # GPTQModel's tree names GraniteMoE's experts as its converted input_linear/output_linear; transformers 5.24's
    # GraniteMoeMoE holds them fused (experts.gate_up_proj / experts.down_proj) under a router
    "granitemoe": ["model", "layers", "#", {
        "input_layernorm": ("input_layernorm:!",),
        "self_attn": ("q_proj:0", "k_proj:0", "v_proj:0", "o_proj:1"),
        "post_attention_layernorm": ("post_attention_layernorm:!",),
        "block_sparse_moe:moe": {"router": ("router:!",), "experts": {"#": ("gate_proj:0", "up_proj:0",
                                                                             "down_proj:1")}}}],
}
LOCAL_EXPERT_INDEX = {"granitemoe": "num_local_experts"}
# model_types whose GPTQModel definition does not reach transformers 5.24's modules, so that GPTQModel would leave
# part of the model unquantized without a word (measured on the matrix's tiny models): what GPTQModel-driven methods
# are refused with
GPTQMODEL_GAPS: dict[str, str] = {
    "granitemoe": "GPTQModel 7.6's definition names GraniteMoE's experts input_linear/output_linear (its converted "
                  "layout), while transformers 5.24 holds them as fused experts.gate_up_proj/down_proj: GPTQModel "
                  "quantizes none of the routed experts (measured: 0 of 24 on the tiny model)",
}
# which config field counts each MoE's routed experts and chosen experts per token, in the order tried
EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
TOP_K_FIELDS = ("num_experts_per_tok", "top_k", "moe_top_k")


@dataclass(frozen=True)
class Experts:
    """A Mixture-of-Experts block inside a decoder layer."""
    block: str  # "mlp" (the MoE block's path inside a layer)
    linears: tuple[str, ...]  # per-expert linears inside the layer: "mlp.experts.#.gate_proj", ...
    count: int  # routed experts per MoE layer
    top_k: int  # experts chosen per token
    router: str | None  # "mlp.gate": runs, never quantized (rule: routers stay in 16 bits, like GPTQModel's)
    shared: tuple[str, ...] = ()  # shared-expert linears (always run): quantized like dense MLP linears
    dense_layers: tuple[int, ...] = ()  # decoder layers with a dense MLP instead (DeepSeek's first_k_dense_replace)
    fused: bool = True  # transformers 5 holds routed experts as 3D parameters, not one nn.Linear per expert
    # other names of an expert linear in checkpoints (GPTQModel's "gate_proj|w1" alternatives: Mixtral's own
    # checkpoints name them w1/w3/w2), alias -> the name in `linears`
    aliases: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Architecture:
    model_type: str
    definition: str | None  # "gptqmodel: definitions/qwen3_moe.py Qwen3MoeQModel", "local: ...", or None
    layers: str = "model.layers"
    attention: tuple[str, ...] = ()  # quantizable linears inside a layer, attention block
    mlp: tuple[str, ...] = ()  # dense MLP linears inside a layer (every layer when not MoE; dense_layers when MoE)
    norms: tuple[str, ...] = ()  # per-layer norms, in the tree's order
    experts: Experts | None = None
    tied_embeddings: bool = False
    attention_bias: bool = False
    config: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_moe(self) -> bool:
        return self.experts is not None

    @property
    def fused_qkv(self) -> bool:
        return any(n.endswith(".qkv_proj") for n in self.attention)

    @property
    def fused_gate_up(self) -> bool:
        return any(n.endswith(".gate_up_proj") for n in self.mlp)

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (DeepSeek V2/V3): low-rank q/kv projections."""
        return any(n.endswith(("kv_a_proj_with_mqa", "kv_b_proj")) for n in self.attention)

    @property
    def known(self) -> bool:
        return self.definition is not None

    def layer_linears(self, i: int) -> tuple[str, ...]:
        """The quantizable linears of decoder layer i (experts with EXPERT for their index)."""
        e = self.experts
        if e is None:
            return self.attention + self.mlp
        if i in e.dense_layers:
            return self.attention + self.mlp
        return self.attention + e.shared + e.linears

    def linear_kinds(self) -> tuple[str, ...]:
        """Every linear name inside a layer that some layer has, in order, without repeats."""
        out: dict[str, None] = {}
        for i in range(int(self.config.get("num_hidden_layers") or 1)):
            out.update(dict.fromkeys(self.layer_linears(i)))
        return tuple(out)

    def shape(self, kind: str) -> tuple[int, int] | None:
        """(in, out) features of a linear inside a layer (or "lm_head"), from the config; None: no rule for it."""
        return linear_shape(self, kind)

    def expert_weights(self) -> int:
        """Routed expert linears in the whole model (MoE layers x experts x linears per expert): what a checkpoint
        must hold quantized."""
        e = self.experts
        if e is None:
            return 0
        moe_layers = int(self.config.get("num_hidden_layers") or 0) - len(e.dense_layers)
        return moe_layers * e.count * len(e.linears)


# ---------------------------------------------------------------- GPTQModel's definitions, read as data


def _gptqmodel_dir() -> Path | None:
    root = _package_dir("gptqmodel")  # the top-level package's folder only: nothing of it is imported
    return root / "models" if root is not None else None


@dataclass
class _ClassDef:
    file: str
    bases: tuple[str, ...]
    attrs: dict[str, object]


@cache
def gptqmodel_definitions() -> tuple[dict[str, str], dict[str, _ClassDef]]:
    """(MODEL_MAP: model_type -> class name, class name -> its literal attributes), parsed from GPTQModel's files
    without importing them; ({}, {}) when GPTQModel is not installed."""
    root = _gptqmodel_dir()
    if root is None or not (root / "auto.py").is_file():
        return {}, {}
    classes: dict[str, _ClassDef] = {}
    for path in sorted((root / "definitions").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                attrs = {}
                for stmt in node.body:
                    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 \
                            and isinstance(stmt.targets[0], ast.Name):
                        with contextlib.suppress(ValueError):  # not a literal (a call, a name): not data
                            attrs[stmt.targets[0].id] = ast.literal_eval(stmt.value)
                bases = tuple(b.id for b in node.bases if isinstance(b, ast.Name))
                classes[node.name] = _ClassDef(f"definitions/{path.name}", bases, attrs)
    model_map: dict[str, str] = {}
    for node in ast.parse((root / "auto.py").read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "MODEL_MAP"
                                                for t in node.targets) and isinstance(node.value, ast.Dict):
            for k, v in zip(node.value.keys, node.value.values, strict=True):
                if isinstance(k, ast.Constant) and isinstance(v, ast.Name):
                    model_map[str(k.value)] = v.id
    return model_map, classes


def _attr(classes: dict[str, _ClassDef], name: str, attr: str) -> object:
    """A class attribute, looked up through its bases as Python would (first base first)."""
    seen, todo = set(), [name]
    while todo:
        c = todo.pop(0)
        if c in seen or c not in classes:
            continue
        seen.add(c)
        if attr in classes[c].attrs:
            return classes[c].attrs[attr]
        todo += list(classes[c].bases)
    return None


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    locations = spec.submodule_search_locations if spec is not None else None
    return Path(next(iter(locations))) if locations else None


@cache
def transformers_model_types() -> frozenset[str]:
    """The config.json model_types this transformers knows (its auto mappings' ("type", "XConfig") pairs), read with
    ast: importing transformers' auto classes imports torch."""
    root = _package_dir("transformers")
    out: set[str] = set()
    for rel in ("models/auto/auto_mappings.py", "models/auto/configuration_auto.py"):
        path = root / rel if root is not None else None
        if path is None or not path.is_file():
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Tuple) and len(node.elts) == 2 and all(
                    isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
                key, value = (e.value for e in node.elts)  # type: ignore[attr-defined]
                if value.endswith("Config"):
                    out.add(key)
            elif isinstance(node, ast.Dict):
                out |= {str(k.value) for k, v in zip(node.keys, node.values, strict=True) if isinstance(k, ast.Constant)
                        and isinstance(v, ast.Constant) and str(v.value).endswith("Config")}
    return frozenset(out)


@cache
def causal_lm_classes() -> dict[str, str]:
    """model_type -> the class transformers' AutoModelForCausalLM builds for it (its MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    read with ast): what config.json's `architectures` names, and what serving engines register."""
    root = _package_dir("transformers")
    path = root / "models/auto/modeling_auto.py" if root is not None else None
    if path is None or not path.is_file():
        return {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"
                                                for t in node.targets):
            pairs = [e for e in ast.walk(node.value) if isinstance(e, ast.Tuple) and len(e.elts) == 2]
            return {str(a.value): str(b.value) for a, b in (p.elts for p in pairs)
                    if isinstance(a, ast.Constant) and isinstance(b, ast.Constant)}
    return {}


def model_class(config: dict) -> str | None:
    """The model class a config.json names (`architectures`), else the one transformers builds for its model_type."""
    named = config.get("architectures")
    if isinstance(named, list) and named:
        return str(named[0])
    return causal_lm_classes().get(str(config.get("model_type") or ""))


# ---------------------------------------------------------------- the tree -> Architecture


def _leaf(spec: str) -> tuple[str, bool]:
    """("q_proj", quantized?) of a leaf "q_proj:0:in=x" / "input_layernorm:!" (first of "a|b" alternatives)."""
    parts = spec.split(":")
    return parts[0].split("|")[0], "!" not in parts[1:] and not spec.endswith(":!")


def _block(key: str) -> tuple[str, bool]:
    """("mlp", moe?) of a block key "mlp|block_sparse_moe:moe:?"."""
    parts = key.split(":")
    return parts[0].split("|")[0], "moe" in parts[1:]


def _first(config: dict, names: tuple[str, ...]) -> int:
    return next((int(config[n]) for n in names if isinstance(config.get(n), int)), 0)


def _dense_layers(config: dict) -> tuple[int, ...]:
    n = int(config.get("num_hidden_layers") or 0)
    dense = set(config.get("mlp_only_layers") or [])
    k = config.get("first_k_dense_replace")
    if isinstance(k, int):
        dense |= set(range(k))
    step = config.get("decoder_sparse_step")
    if isinstance(step, int) and step > 1:
        dense |= {i for i in range(n) if (i + 1) % step}
    return tuple(sorted(i for i in dense if i < n))


def _from_tree(model_type: str, tree: list, expert_field: str | None, definition: str, config: dict) -> Architecture:
    path = [p for p in tree if isinstance(p, str)]
    if EXPERT in path:
        path = path[:path.index(EXPERT)]
    body = next((p for p in tree if isinstance(p, dict)), {})
    attention: list[str] = []
    mlp: list[str] = []
    norms: list[str] = []
    experts = None
    for key, value in body.items():
        block, moe = _block(key)
        if moe and isinstance(value, dict):
            experts = _experts(block, value, config, expert_field)
            mlp += [f"{block}.{n}" for n, q in (_leaf(s) for s in value.get("", ())) if q]
            continue
        leaves = [_leaf(s) for s in (value if isinstance(value, tuple | list) else ())]
        quantized = [f"{block}.{n}" for n, q in leaves if q]
        norms += [f"{block}" if n == block else f"{block}.{n}" for n, q in leaves if not q and "norm" in n]
        (attention if "attn" in block or "attention" in block else mlp).extend(quantized)
    if experts is not None and not mlp and experts.dense_layers:  # the dense layers' MLP: the experts' linears
        mlp = [f"{experts.block}.{n.rsplit('.', 1)[-1]}" for n in experts.linears]
    if config.get("kv_lora_rank"):  # MLA: the tree names both query forms; the config says which one the model has
        drop = ("q_proj",) if config.get("q_lora_rank") else ("q_a_proj", "q_b_proj")
        attention = [n for n in attention if n.rsplit(".", 1)[-1] not in drop]
    layers = ".".join(path)
    if model_type == "gemma3_text" and layers == "model.language_model.layers":
        layers = "model.layers"  # Gemma3ForCausalLM (the text-only model) has no language_model level
    return Architecture(model_type, definition, layers, tuple(attention), tuple(mlp), tuple(norms), experts,
                        tied_embeddings=bool(config.get("tie_word_embeddings")),
                        attention_bias=bool(config.get("attention_bias") or config.get("qkv_bias")
                                            or model_type == "qwen2"),
                        config=config)


def _aliases(specs) -> list[tuple[str, str]]:
    """(alternative, first name) of each leaf "gate_proj|w1:0" with alternatives."""
    out = []
    for spec in specs:
        names = spec.split(":")[0].split("|")
        out += [(alt, names[0]) for alt in names[1:]]
    return out


def _experts(block: str, value: dict, config: dict, expert_field: str | None) -> Experts:
    linears: list[str] = []
    aliases: list[tuple[str, str]] = []
    router = shared = None
    for key, sub in value.items():
        name = key.split(":")[0].split("|")[0]
        if isinstance(sub, dict) and EXPERT in sub:
            linears += [f"{block}.{name}.{EXPERT}.{n}" for n, q in (_leaf(s) for s in sub[EXPERT]) if q]
            aliases += _aliases(sub[EXPERT])
        elif isinstance(sub, tuple | list) and name in ("gate", "router"):
            router = f"{block}.{name}"
        elif isinstance(sub, tuple | list) and name.startswith("shared_expert") and sub:
            shared = tuple(f"{block}.{name}.{n}" for n, q in (_leaf(s) for s in sub) if q)
    fields = ((expert_field,) if expert_field else ()) + EXPERT_COUNT_FIELDS
    return Experts(block, tuple(linears), _first(config, fields), _first(config, TOP_K_FIELDS), router,
                   shared or (), _dense_layers(config), aliases=tuple(aliases))


def architecture_of(config: dict) -> Architecture:
    """The Architecture of a config.json (a composite config's text_config is the decoder)."""
    sub = config.get("text_config")
    text: dict = sub if isinstance(sub, dict) else config
    mt = str(text.get("model_type") or config.get("model_type") or "")
    if mt in LOCAL:
        return _from_tree(mt, LOCAL[mt], LOCAL_EXPERT_INDEX.get(mt), "local: pipeline/model/architecture.py LOCAL",
                          text)
    model_map, classes = gptqmodel_definitions()
    cls = model_map.get(mt)
    tree = _attr(classes, cls, "module_tree") if cls else None
    if not isinstance(tree, list):
        return Architecture(mt, None, config=text)
    expert_field = _attr(classes, cls, "dynamic_expert_index") if cls else None
    return _from_tree(mt, tree, expert_field if isinstance(expert_field, str) else None,
                      f"gptqmodel: {classes[cls].file} {cls}" if cls else "", text)


def missing(arch: Architecture) -> str | None:
    """The line `compress check` prints for a model_type no definition covers (None when one does)."""
    if arch.known:
        return None
    return (f"model_type {arch.model_type!r} has no architecture definition (GPTQModel's models/definitions/ "
            "has none and pipeline/model/architecture.py LOCAL has none): its decoder layers and linears are "
            "unknown, so the shape checks are skipped and methods that need its structure are refused")


# ---------------------------------------------------------------- shapes from the config


def _dims(c: dict) -> dict[str, int]:
    h = int(c.get("hidden_size") or 0)
    heads = int(c.get("num_attention_heads") or 1)
    moe_inter = c.get("moe_intermediate_size") or c.get("intermediate_size") or 0
    d = {"h": h, "heads": heads, "kv": int(c.get("num_key_value_heads") or heads),
         "hd": int(c.get("head_dim") or (h // heads if heads else 0)), "inter": int(c.get("intermediate_size") or 0),
         "moe_inter": int(moe_inter), "vocab": int(c.get("vocab_size") or 0),
         "shared_inter": int(c.get("shared_expert_intermediate_size")
                             or int(moe_inter) * int(c.get("n_shared_experts") or 1))}
    if c.get("kv_lora_rank"):  # MLA
        d |= {"q_lora": int(c.get("q_lora_rank") or 0), "kv_lora": int(c["kv_lora_rank"]),
              "rope": int(c.get("qk_rope_head_dim") or 0), "nope": int(c.get("qk_nope_head_dim") or 0),
              "v": int(c.get("v_head_dim") or 0)}
    return d


def linear_shape(arch: Architecture, kind: str) -> tuple[int, int] | None:
    d = _dims(arch.config)
    if not d["h"]:
        return None
    if kind == "lm_head":
        return (d["h"], d["vocab"]) if d["vocab"] else None
    leaf = kind.rsplit(".", 1)[-1]
    inter = d["inter"]
    if EXPERT in kind.split("."):
        inter = d["moe_inter"]
    elif arch.experts is not None and kind in arch.experts.shared:
        inter = d["shared_inter"]
    q, kv = d["heads"] * d["hd"], d["kv"] * d["hd"]
    if "kv_lora" in d:  # MLA: q/k heads are nope + rope wide, values v wide
        qk = d["nope"] + d["rope"]
        mla = {"q_proj": (d["h"], d["heads"] * qk), "q_a_proj": (d["h"], d["q_lora"]),
               "q_b_proj": (d["q_lora"], d["heads"] * qk), "kv_a_proj_with_mqa": (d["h"], d["kv_lora"] + d["rope"]),
               "kv_b_proj": (d["kv_lora"], d["heads"] * (d["nope"] + d["v"])), "o_proj": (d["heads"] * d["v"], d["h"])}
        if leaf in mla and "attn" in kind:
            return mla[leaf]
    rules = {"q_proj": (d["h"], q), "k_proj": (d["h"], kv), "v_proj": (d["h"], kv), "o_proj": (q, d["h"]),
             "qkv_proj": (d["h"], q + 2 * kv), "gate_proj": (d["h"], inter), "up_proj": (d["h"], inter),
             "down_proj": (inter, d["h"]), "gate_up_proj": (d["h"], 2 * inter)}
    return rules.get(leaf)


# ---------------------------------------------------------------- tensor parallelism over quantization groups


def row_parallel_inputs(config: dict) -> dict[str, int]:
    """The input widths of the layers tensor parallelism splits along their inputs (row-parallel: each rank takes a
    slice of the columns): attention's output projection, the MLP's down projection and the experts' down
    projections, from config.json."""
    cfg = config.get("text_config") or config
    n, hidden = int(cfg.get("num_attention_heads") or 0), int(cfg.get("hidden_size") or 0)
    head = int(cfg.get("v_head_dim") or cfg.get("head_dim") or (hidden // n if n else 0))
    out = {"o_proj": n * head} if n and head else {}
    for key, name in (("intermediate_size", "down_proj"), ("moe_intermediate_size", "the experts' down_proj")):
        if cfg.get(key):
            out[name] = int(cfg[key])
    return out


def split_groups(tp: int, config: dict, group_size: int) -> tuple[dict[str, int], list[int]]:
    """({row-parallel layer: its input width} for the layers that `tp` ranks would cut into slices that are not
    whole groups of `group_size` columns, the sizes from 1 to 8 that keep whole groups in every such layer). A
    group-quantized checkpoint (GPTQ, AWQ, compressed-tensors W4A16) keeps one scale per group: vLLM shards the scales
    by whole groups, so a cut group loads and then fails every request (Qwen2.5-Coder-0.5B w4g128 at TP=2)."""
    widths = row_parallel_inputs(config)
    bad = {name: w for name, w in widths.items() if w % tp or (w // tp) % group_size}
    fits = [t for t in range(1, 9) if all(w % t == 0 and (w // t) % group_size == 0 for w in widths.values())]
    return bad, fits


def cut_layers(bad: dict[str, int], tp: int) -> str:
    """split_groups' layers as the refusals name them: "o_proj (896 inputs, 448 a rank), ..."."""
    return ", ".join(f"{name} ({w} inputs, {w / tp:g} a rank)" for name, w in bad.items())

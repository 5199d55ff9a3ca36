"""`compress check` for the speed stage's runtime technique rows (torch-free: read before any weight is loaded).

- tensor_parallel: transformers splits each attention layer's heads and KV heads across the ranks (tp_plan="auto":
  q/k/v column-wise, o row-wise), so `tp_size` must divide both; a model whose transformers config declares no
  tensor-parallel plan cannot be split; on CPU each rank is a process with one core of its own, so more ranks than
  cores is refused (they would time the scheduler). The memory per rank is predicted here (`tp_rank_bytes`).
- attention rows: an implementation the model's transformers class or the device cannot run is refused, naming
  the ones that can (the model's `_supports_sdpa` / `_supports_flash_attn`, read with ast from its modeling file).
"""
from __future__ import annotations

import ast
import contextlib
import importlib.util
import os
from functools import cache
from pathlib import Path

from pipeline.base.problem import Problem
from pipeline.budget.formulas import speed_bytes
from pipeline.model.architecture import cut_layers, split_groups

ATTENTION = ("sdpa", "eager", "flash_attention_2")  # the technique rows that switch attn_implementation
_SUPPORT_ATTR = {"sdpa": "_supports_sdpa", "flash_attention_2": "_supports_flash_attn"}


def usable_cores() -> int:
    """The cores this process may run on (its affinity set: a container pinned to 2 cores has 2)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def bound_cores(threads: int | None) -> int:
    """The cores a served engine binds: [run] threads of the usable ones when set (pipeline.serve.engines.vllm's
    bound_cpus), else all of them."""
    return min(threads, usable_cores()) if threads else usable_cores()


def heads(config: dict) -> tuple[int, int]:
    """(attention heads, KV heads) of a config.json (its text config for a multimodal one)."""
    cfg = config.get("text_config") or config
    n = int(cfg.get("num_attention_heads") or 0)
    return n, int(cfg.get("num_key_value_heads") or n)


@cache
def _class_attrs(model_type: str, kind: str) -> dict[str, object]:
    """Literal class attributes of every class in transformers' models/<type>/<kind>_<type>.py, merged (the model's
    own classes; their base PreTrainedModel says False for every kernel), read with ast: nothing imported."""
    spec = importlib.util.find_spec("transformers")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    path = Path(roots[0]) / "models" / model_type / f"{kind}_{model_type}.py" if roots else None
    if path is None or not path.is_file():
        return {}
    out: dict[str, object] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                    with contextlib.suppress(ValueError):
                        out.setdefault(stmt.targets[0].id, ast.literal_eval(stmt.value))
    return out


def attention_can_run(config: dict, device: str) -> dict[str, str | None]:
    """{implementation: None where this model and device can run it, else why not}. A model type transformers does
    not ship (remote code) is not judged: its row says at run time."""
    attrs = _class_attrs(str(config.get("model_type") or ""), "modeling")
    out: dict[str, str | None] = {}
    for impl in ATTENTION:
        attr = _SUPPORT_ATTR.get(impl)
        if attr and attrs and not attrs.get(attr, False):
            out[impl] = f"transformers' {config.get('model_type')} model does not support it ({attr} is not set)"
        elif impl == "flash_attention_2" and not str(device).startswith("cuda"):
            out[impl] = f"it needs CUDA (device here: {device})"
        elif impl == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
            out[impl] = "the flash_attn package is not installed"
        else:
            out[impl] = None
    return out


def tp_plan_declared(config: dict) -> bool | None:
    """Whether transformers' config class for this model type declares a tensor-parallel plan (None: not known)."""
    attrs = _class_attrs(str(config.get("model_type") or ""), "configuration")
    return bool(attrs.get("base_model_tp_plan")) if attrs else None


def tp_rank_bytes(config: dict, param_bytes: int, tp: int, speed: dict) -> int:
    """Predicted peak memory of one tensor-parallel rank timing the model: the decoder layers' linears split `tp`
    ways (tp_plan "auto" splits q/k/v/gate/up by output and o/down by input), the embeddings, norms and a tied head
    whole on every rank (an untied head split: colwise_gather_output), the KV cache split by KV heads, plus one
    process's runtime (pipeline/budget/formulas.py speed_bytes, with its bandwidth buffers left out: ranks time no
    roofline)."""
    cfg = config.get("text_config") or config
    h, inter = int(cfg.get("hidden_size") or 0), int(cfg.get("intermediate_size") or 0)
    n, kv = heads(config)
    head_dim = int(cfg.get("head_dim") or (h // n if n else 0))
    layers, vocab = int(cfg.get("num_hidden_layers") or 0), int(cfg.get("vocab_size") or 0)
    per_layer = h * head_dim * (2 * n + 2 * kv) + 3 * h * inter
    tied = bool(config.get("tie_word_embeddings", cfg.get("tie_word_embeddings", True)))
    split = layers * per_layer + (0 if tied else vocab * h)
    whole = vocab * h + (2 * layers + 1) * h
    local = {**speed, "roofline": False, "batch_sizes": [1]}
    kv_share = {**cfg, "num_key_value_heads": max(1, kv // tp)}  # the cache of this rank's KV heads
    return speed_bytes(kv_share, param_bytes * (split // tp + whole), local)


def technique_problems(speed, config: dict, device: str, cores: int | None = None) -> list[Problem]:
    """[validate.speed] techniques that cannot run on this model and device (`cores`: CPU cores, None: this
    process's): exit 2 at `compress check`."""
    problems = []
    can = attention_can_run(config, device)
    able = [impl for impl, why in can.items() if why is None]
    for impl in (t for t in speed.techniques if t in ATTENTION and can[t] is not None):
        problems.append(Problem("validate.speed.techniques", "speed-attention-unsupported",
                                f"[validate.speed] techniques: {impl} cannot run here: {can[impl]}; this model and "
                                f"device can run {', '.join(able) or 'none of them'}"))
    if "tensor_parallel" in speed.techniques:
        problems += _tp_problems(speed.tp_size, config, device, usable_cores() if cores is None else cores)
    return problems


def _tp_problems(tp: int, config: dict, device: str, cores: int) -> list[Problem]:
    n, kv = heads(config)
    out = []
    if n % tp or kv % tp:
        fits = [d for d in range(2, n + 1) if n % d == 0 and kv % d == 0]
        out.append(Problem("validate.speed.tp_size", "speed-tp-heads-indivisible",
                           f"[validate.speed] tp_size = {tp} does not divide the model's {n} attention heads and "
                           f"{kv} KV heads (tensor parallelism gives each rank whole heads); sizes that divide both: "
                           f"{', '.join(map(str, fits)) or 'none above 1'}"))
    if tp_plan_declared(config) is False:
        out.append(Problem("validate.speed.techniques", "speed-tp-no-plan",
                           f"[validate.speed] techniques: tensor_parallel needs a tensor-parallel plan, and "
                           f"transformers' {config.get('model_type')} config declares none (base_model_tp_plan)"))
    if not str(device).startswith("cuda") and tp > cores:
        out.append(Problem("validate.speed.tp_size", "speed-tp-over-cores",
                           f"[validate.speed] tp_size = {tp} ranks on {cores} CPU cores: each rank needs a core of "
                           f"its own (more would time the scheduler); at most {cores}"))
    return out


def tp_group_problems(tp: int, config: dict, groups: dict[str, tuple[int, ...]]) -> list[Problem]:
    """A group-quantized model (GPTQ, AWQ, compressed-tensors W4A16: one scale per `g` input columns) split over `tp`
    ranks: each rank's slice of a row-parallel layer's inputs must hold whole groups. Qwen2.5-Coder-0.5B's GPTQ
    w4g128 at TP=2 (o_proj: 896 inputs, 448 a rank, 3.5 groups) loaded in vLLM's CPU build, reported healthy and
    failed every request ("cpu_wna16.cpp: Check failed: group_size % 2 == 0", 7 Dec 2026); its compressed-tensors
    scheme asserts the same at load. `groups`: {served model: the group sizes its checkpoint may hold}."""
    out = []
    for model, sizes in groups.items():
        for g in sorted({g for g in sizes if g > 0}):
            bad, fits = split_groups(tp, config, g)
            if not bad:
                continue
            out.append(Problem("validate.serve.tensor_parallel_size", "serve-tp-group-indivisible",
                               f"[validate.serve] tensor_parallel_size = {tp} splits {model}'s "
                               f"{cut_layers(bad, tp)} into slices that are not whole groups of {g} (its group "
                               "size): vLLM loads it "
                               "and fails every request; tensor_parallel_size values that keep whole groups: "
                               f"{', '.join(map(str, fits))}"))
    return out


def serve_parallel_problems(serve, config: dict, device: str, engines: dict[str, dict[str, str | None]],
                            splitting: tuple[str, ...], cores: int | None = None,
                            groups: dict[str, tuple[int, ...]] | None = None) -> list[Problem]:
    """[validate.serve] tensor_parallel_size / pipeline_parallel_size (vLLM's): only an engine that splits a model
    over ranks may be asked, the heads must divide, a group-quantized model's ranks must hold whole groups, the
    layers must cover the stages, and on CPU each rank needs a core (`engines`: the plan's {model: {engine: None or
    why skipped}}; `splitting`: the engines that split a model over ranks, pipeline.serve.engines.splitting();
    `groups`: {served model: the group sizes its checkpoint may hold})."""
    tp, pp = serve.tensor_parallel_size, serve.pipeline_parallel_size
    if not serve.enabled or tp * pp == 1:
        return []
    out = []
    whole = sorted({e for plan in engines.values() for e, why in plan.items() if why is None and e not in splitting})
    if whole:
        out.append(Problem("validate.serve.engines", "serve-parallel-engine",
                           f"[validate.serve] tensor_parallel_size = {tp}, pipeline_parallel_size = {pp}: only "
                           f"{' and '.join(splitting) or 'no engine'} splits a model over ranks, and "
                           f"{', '.join(whole)} would serve it whole; set engines = {list(splitting)} (or "
                           "engine_models) or leave both sizes at 1"))
    n, kv = heads(config)
    if n % tp or (kv % tp and tp % kv):
        out.append(Problem("validate.serve.tensor_parallel_size", "serve-tp-heads-indivisible",
                           f"[validate.serve] tensor_parallel_size = {tp} does not divide the model's {n} attention "
                           f"heads (KV heads: {kv}); vLLM refuses it at start-up"))
    split = {m: g for m, g in (groups or {}).items()
             if any(why is None and e in splitting for e, why in engines.get(m, {}).items())}
    if tp > 1:
        out += tp_group_problems(tp, config, split)
    layers = int((config.get("text_config") or config).get("num_hidden_layers") or 0)
    if pp > layers:
        out.append(Problem("validate.serve.pipeline_parallel_size", "serve-pp-over-layers",
                           f"[validate.serve] pipeline_parallel_size = {pp} is more stages than the model's {layers} "
                           "layers"))
    cores = usable_cores() if cores is None else cores
    if not str(device).startswith("cuda") and tp * pp > cores:
        out.append(Problem("validate.serve.tensor_parallel_size", "serve-parallel-over-cores",
                           f"[validate.serve] tensor_parallel_size x pipeline_parallel_size = {tp * pp} ranks on "
                           f"{cores} CPU cores (the [run] threads it binds, else every core this process may use): "
                           f"vLLM binds each rank to cores of its own; at most {cores}"))
    return out

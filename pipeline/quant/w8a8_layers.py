"""The W8A8 variants' work on a model in memory, one decoder layer at a time (the layer-by-layer loop GPTQ
implementations use): the calibration rows' inputs to layer 0 are captured once; each layer is then smoothed
(SmoothQuant, pipeline/quant/smoothquant.py), its linears rounded (round to nearest, or GPTQ on the layer's own
inputs), and run once more to give the next layer its inputs: inputs produced by the already-quantized layers
before it. Static activation scales are the max |x| of each linear's input in that last pass.

The maths are in pipeline/quant/w8a8_math.py and smoothquant.py. The layers and linears come from the architecture
source (pipeline/model/architecture.py); SmoothQuant's fold points are found on the model itself (`fold_points`: a
norm whose output is, to the bit, the input of a group of linears, and v_proj before o_proj), and each fold is
verified: the layer's output must be unchanged by it, else it is undone and recorded as not foldable (Gemma's
norms scale by 1 + weight, OLMo 2's normalise a block's output: neither divides out).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING

import torch

from pipeline.model.architecture import EXPERT, Architecture
from pipeline.quant import kv_fp8
from pipeline.quant.shapes import is_skipped
from pipeline.quant.smoothquant import fold, search_alpha
from pipeline.quant.w8a8_math import FP8_MAX, INT8_ACT, fake_weight, gptq_channel, quant_act, rtn

if TYPE_CHECKING:
    from transformers import PreTrainedModel

SEARCH_TOKENS = 512  # calibration tokens per fold point the alpha search measures its error on (the first rows')
BATCH = 8  # calibration rows per forward


@dataclass
class W8A8Plan:
    kind: str  # "int8" or "fp8"
    rounding: str  # "rtn" or "gptq"
    static: bool  # one calibrated activation scale per tensor (else per token, at run time)
    alphas: Sequence[float] | None  # SmoothQuant's grid; None = no smoothing
    modules_to_skip: list[str]
    dtype: torch.dtype  # the checkpoint's dtype: scales are rounded to it
    damp: float = 0.01
    min_static_tokens: int = 0
    kv_cache: bool = False  # an FP8 KV cache: per-layer k/v scales calibrated on the quantized model


@dataclass
class W8A8Result:
    model: PreTrainedModel  # float32; each quantized linear holds q * s exactly
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # name -> (q, s [out, 1])
    input_scales: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [1] (static only)
    alphas: dict[str, float | None] = field(default_factory=dict)  # fold point -> alpha (None: not smoothed)
    errors: dict[str, dict[str, float]] = field(default_factory=dict)  # fold point -> {candidate: rel. error}
    tokens: int = 0
    kv_scales: dict[str, tuple[float, float]] | None = None  # attention -> (k_scale, v_scale): an FP8 KV cache


class _Stop(Exception):
    pass


def layer_inputs(model, layers, calib_ids: torch.Tensor) -> list[tuple[torch.Tensor, dict]]:
    """(hidden states, keyword arguments) layer 0 receives for each batch of calibration rows."""
    seen: list[tuple[torch.Tensor, dict]] = []

    def grab(_module, args, kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        seen.append((hidden.detach(), dict(kwargs)))
        raise _Stop

    handle = layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        for i in range(0, calib_ids.shape[0], BATCH):
            with contextlib.suppress(_Stop):
                model(calib_ids[i:i + BATCH], use_cache=False)
    finally:
        handle.remove()
    return seen


def run_layer(layer, inputs, linears: dict[str, torch.nn.Linear] | None = None,
              on_input: Callable[[str, torch.Tensor], None] | None = None) -> list[tuple[torch.Tensor, dict]]:
    """The layer's outputs for each batch; on_input(name, x [tokens, in]) sees each named linear's input."""
    handles = []
    if on_input is not None:
        for name, lin in (linears or {}).items():
            handles.append(lin.register_forward_hook(
                lambda _m, args, _o, n=name: on_input(n, args[0].reshape(-1, args[0].shape[-1]).detach())))
    try:
        out = []
        for hidden, kwargs in inputs:
            y = layer(hidden, **kwargs)
            out.append((y[0] if isinstance(y, tuple) else y, kwargs))
        return out
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def quantize_model(model, arch: Architecture, calib_ids: torch.Tensor | None, plan: W8A8Plan,
                   console: IO[str] | None = None) -> W8A8Result:
    """Smooth, round and (static) calibrate every linear of `model` (float32) that modules_to_skip does not name."""
    if arch.experts is not None:
        raise ValueError(f"W8A8 quantizes nn.Linear modules; {arch.model_type}'s routed experts are fused 3D "
                         "parameters in transformers 5 (refused by compress check)")
    layers = model.get_submodule(arch.layers)
    result = W8A8Result(model)
    needs_data = plan.rounding == "gptq" or plan.static or plan.alphas is not None
    inputs: list[tuple[torch.Tensor, dict]] = []
    if needs_data:
        if calib_ids is None:
            raise ValueError("this W8A8 variant needs calibration rows (GPTQ, SmoothQuant or static scales)")
        if plan.static and calib_ids.numel() < plan.min_static_tokens:
            raise ValueError(f"static activation scales from {calib_ids.numel()} calibration tokens "
                             f"({calib_ids.shape[0]} rows x {calib_ids.shape[1]}): the scheme needs at least "
                             f"{plan.min_static_tokens}; raise calibration.num_samples or calibration_rows")
        inputs = layer_inputs(model, layers, calib_ids)
        result.tokens = int(calib_ids.numel())  # else W8A8Result's 0
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    repeat = cfg.num_attention_heads // (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    for i, layer in enumerate(layers):
        prefix = f"{arch.layers}.{i}."
        linears = {k: layer.get_submodule(k) for k in arch.layer_linears(i)
                   if EXPERT not in k.split(".") and not is_skipped(prefix + k, plan.modules_to_skip)}
        if plan.alphas is not None:
            _smooth(layer, prefix, linears, inputs, arch, plan, result, repeat, head_dim)
        hessians = _hessians(layer, linears, inputs) if plan.rounding == "gptq" else {}
        for k, lin in linears.items():
            q, s = (gptq_channel(lin.weight, hessians[k], plan.dtype, plan.damp) if k in hessians
                    else rtn(lin.weight, plan.kind, plan.dtype))
            lin.weight.copy_(q * s)
            result.weights[prefix + k] = (q, s)
        if needs_data:
            amax: dict[str, torch.Tensor] = {}

            def record(n: str, x: torch.Tensor, amax: dict[str, torch.Tensor] = amax) -> None:
                amax[n] = torch.maximum(amax.get(n, torch.zeros(())), x.abs().amax())

            inputs = run_layer(layer, inputs, linears, record if plan.static else None)
            qmax = INT8_ACT if plan.kind == "int8" else FP8_MAX
            for k, m in amax.items():
                result.input_scales[prefix + k] = (m / qmax).reshape(1).to(plan.dtype).float()
        if console is not None:
            console.write(f"w8a8: layer {i + 1}/{len(layers)} done\n")
    if plan.kv_cache:
        if calib_ids is None:
            raise ValueError("an FP8 KV cache calibrates its k/v scales: it needs calibration rows")
        result.kv_scales = kv_fp8.calibrate(model, calib_ids)
        if console is not None:
            console.write(f"w8a8: FP8 KV cache: k/v scales of {len(result.kv_scales)} layers from "
                          f"{len(calib_ids)} calibration rows\n")
    return result


def _hessians(layer, linears, inputs) -> dict[str, torch.Tensor]:
    """X^T X of each linear's inputs; linears fed the same tensor (q/k/v, gate/up) share one matrix."""
    hs: dict[str, torch.Tensor] = {}
    # this batch's input tensors -> the linear whose matrix they went into; holding each tensor keeps its memory from
    # being reused by a later input within the batch, so equal (address, shape) means the same tensor
    last: dict[tuple, tuple[str, torch.Tensor]] = {}

    def add(name, x):
        key = (x.data_ptr(), tuple(x.shape))
        if key in last and last[key][0] != name:
            hs[name] = hs[last[key][0]]  # the same input as an earlier linear's: its matrix (the same object)
            return
        last[key] = (name, x)
        x = x.float()
        if name not in hs:
            hs[name] = torch.zeros(x.shape[1], x.shape[1])
        hs[name].add_(x.t() @ x)

    for batch in inputs:
        last.clear()
        run_layer(layer, [batch], linears, add)
    return hs


def fold_points(layer, linears: dict[str, torch.nn.Linear], norms: tuple[str, ...], batch
                ) -> list[tuple[str, tuple[str, ...]]]:
    """SmoothQuant's fold points of one layer, found on one batch: (norm, the linears whose input is that norm's
    output, to the bit), and (v_proj, (o_proj,)) where the attention has both. Only quantized linears count."""
    outs: dict[str, torch.Tensor] = {}
    handles = [layer.get_submodule(n).register_forward_hook(
        lambda _m, _a, o, n=n: outs.__setitem__(n, (o[0] if isinstance(o, tuple) else o).detach()))
        for n in norms]
    ins: dict[str, torch.Tensor] = {}
    try:
        run_layer(layer, [batch], linears, lambda n, x: ins.__setitem__(n, x))
    finally:
        for h in handles:
            h.remove()
    points = []
    for norm, y in outs.items():
        flat = y.reshape(-1, y.shape[-1])
        group = tuple(k for k, x in ins.items() if x.shape == flat.shape and torch.equal(x, flat))
        if group:
            points.append((norm, group))
    for v, o in (("self_attn.v_proj", "self_attn.o_proj"),):
        if v in linears and o in linears:
            points.append((v, (o,)))
    return points


def _layer_out(layer, batch) -> torch.Tensor:
    return run_layer(layer, [batch])[0][0]


def _smooth(layer, prefix, linears, inputs, arch: Architecture, plan: W8A8Plan, result: W8A8Result, repeat: int,
            head_dim: int) -> None:
    """Search and fold SmoothQuant's factors at each fold point whose linears are all quantized; a fold that
    changes the layer's output (a norm that does not scale by its weight, a non-linear step between v and o) is
    undone and recorded with alpha None and the error 'fold changes the output'."""
    assert plan.alphas is not None  # quantize_model smooths only with a grid
    if not inputs:
        return
    points = fold_points(layer, linears, arch.norms, inputs[0])
    firsts = {group[0]: (prev, group) for prev, group in points}
    amax: dict[str, torch.Tensor] = {}
    sample: dict[str, list[torch.Tensor]] = {k: [] for k in firsts}

    def record(name, x):
        x = x.float()
        m = x.abs().amax(0)
        amax[name] = torch.maximum(amax[name], m) if name in amax else m
        have = sum(t.shape[0] for t in sample[name])
        if have < SEARCH_TOKENS:
            sample[name].append(x[:SEARCH_TOKENS - have])

    run_layer(layer, inputs, {k: linears[k] for k in firsts}, record)
    qmax = INT8_ACT if plan.kind == "int8" else FP8_MAX

    def quant_x(t: torch.Tensor) -> torch.Tensor:  # the scheme's activations: one scale for the sample, or per token
        return quant_act(t, plan.kind, t.abs().amax() / qmax if plan.static else None)

    for first, (prev, group) in firsts.items():
        x = torch.cat(sample[first])
        kv = prev in linears  # a linear before the group (v_proj -> o_proj): channels per key/value head
        alpha, s, errors = search_alpha(
            x, amax[first], [linears[g].weight for g in group], plan.alphas,
            lambda w: fake_weight(w, plan.kind), quant_x, repeat if kv else 1, head_dim if kv else 0)
        where = prefix + prev
        result.alphas[where], result.errors[where] = alpha, errors
        if s is not None:
            mods = [layer.get_submodule(prev), *(linears[g] for g in group)]
            saved = [{n: t.detach().clone() for n, t in m.named_parameters(recurse=False)} for m in mods]
            before = _layer_out(layer, inputs[0])
            fold(mods[0], mods[1:], s, repeat if kv else 1, head_dim)
            after = _layer_out(layer, inputs[0])
            if not torch.allclose(after, before, rtol=1e-3, atol=1e-4 * float(before.abs().max())):
                for m, params in zip(mods, saved, strict=True):
                    for n, t in params.items():
                        getattr(m, n).copy_(t)
                result.alphas[where] = None
                result.errors[where] = {**errors, "fold changes the output": 1.0}

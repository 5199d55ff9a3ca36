"""SmoothQuant (Xiao et al. 2023) as plain functions over tensors: per-channel smoothing factors, their fold into the
preceding RMSNorm or linear, and the per-group search for the migration strength alpha.

A linear y = x W^T is unchanged when its input channel j is divided by s_j and its weight column j multiplied by s_j.
The division is folded into whatever produced x: an RMSNorm's weight (x = norm(h) * g: g_j / s_j), or the previous
linear's output rows (v_proj before o_proj: attention mixes tokens, not channels, so scaling v's channel j scales
the attention output's channel j). With grouped-query attention each key/value channel feeds `repeat` query heads'
channels of o_proj's input, so one factor serves all of them.

    s_j = max|x_j|^alpha / max|W_:,j|^(1 - alpha)      (the paper's eq. 4; W over every linear the input feeds)

alpha = 0 moves nothing onto the activations' side but scales by the weights' column maxima; alpha = 1 divides the
activation outliers out completely. The search (`search_alpha`) picks, per fold point, the alpha (or no smoothing)
whose quantized group reproduces the float outputs best on calibration tokens.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

EPS = 1e-5


def kv_expand(s: torch.Tensor, repeat: int, head_dim: int) -> torch.Tensor:
    """Factors per key/value channel -> factors per o_proj input channel (query head h reads kv head h // repeat)."""
    if repeat == 1:
        return s
    return s.view(-1, 1, head_dim).expand(-1, repeat, head_dim).reshape(-1)


def kv_reduce(x: torch.Tensor, repeat: int, head_dim: int) -> torch.Tensor:
    """Per o_proj input channel maxima -> per key/value channel (the max over the query heads sharing it)."""
    if repeat == 1:
        return x
    return x.view(-1, repeat, head_dim).amax(1).reshape(-1)


def smooth_factors(act_max: torch.Tensor, weights: Sequence[torch.Tensor], alpha: float) -> torch.Tensor:
    """s_j = max|x_j|^alpha / max|W_:,j|^(1-alpha) over the weights' columns (all the linears the input feeds)."""
    w_max = torch.cat([w.detach().abs().float() for w in weights], 0).amax(0).clamp(min=EPS)
    a = act_max.float().clamp(min=EPS)
    return (a.pow(alpha) / w_max.pow(1 - alpha)).clamp(min=EPS)


@torch.no_grad()
def fold(prev: torch.nn.Module, linears: Sequence[torch.nn.Linear], s: torch.Tensor, repeat: int = 1,
         head_dim: int = 0) -> None:
    """Divide prev's output channels by s and multiply the linears' input columns by s (expanded over query heads
    when prev is v_proj under grouped-query attention). prev: an RMSNorm (weight [c]) or a linear (weight [c, in])."""
    s_in = kv_expand(s, repeat, head_dim) if repeat > 1 else s
    w = prev.weight
    assert isinstance(w, torch.Tensor)  # a parameter
    if w.dim() == 1:
        w.div_(s.to(w.dtype))
    else:
        w.div_(s.to(w.dtype).unsqueeze(1))
        bias = getattr(prev, "bias", None)
        if bias is not None:
            bias.div_(s.to(bias.dtype))
    for lin in linears:
        lin.weight.mul_(s_in.to(lin.weight.dtype).unsqueeze(0))


def group_error(x: torch.Tensor, weights: Sequence[torch.Tensor], s_in: torch.Tensor | None,
                quant_w: Callable[[torch.Tensor], torch.Tensor], quant_x: Callable[[torch.Tensor], torch.Tensor],
                refs: Sequence[torch.Tensor] | None = None) -> float:
    """Relative squared error of the quantized group on inputs x [tokens, in]: sum ||x W^T - Qx(x/s) Qw(W s)^T||^2
    over the group's linears, divided by sum ||x W^T||^2 (s_in None: no smoothing; refs: the x W^T, if known)."""
    xs = x if s_in is None else x / s_in
    xq = quant_x(xs)
    num = den = 0.0
    for i, w in enumerate(weights):
        ref = x @ w.t() if refs is None else refs[i]
        ws = w if s_in is None else w * s_in
        num += float((xq @ quant_w(ws).t() - ref).pow(2).sum())
        den += float(ref.pow(2).sum())
    return num / max(den, 1e-30)


def search_alpha(x: torch.Tensor, act_max: torch.Tensor, weights: Sequence[torch.Tensor], alphas: Sequence[float],
                 quant_w, quant_x, repeat: int = 1, head_dim: int = 0
                 ) -> tuple[float | None, torch.Tensor | None, dict]:
    """The best of no smoothing and each alpha for one fold point: (alpha or None, factors s or None, {candidate:
    error}). x: sample inputs of the linears [tokens, in]; act_max: max|x_j| over all calibration tokens, per input
    channel of the linears (reduced to key/value channels inside when repeat > 1)."""
    w32 = [w.detach().float() for w in weights]
    refs = [x @ w.t() for w in w32]
    errors = {"none": group_error(x, w32, None, quant_w, quant_x, refs)}
    best: tuple[float | None, torch.Tensor | None] = (None, None)
    best_err = errors["none"]
    a_max = kv_reduce(act_max, repeat, head_dim)
    cols = [kv_reduce(w.abs().amax(0), repeat, head_dim) for w in w32]  # per kv channel column maxima
    for alpha in alphas:
        s = smooth_factors(a_max, [c.unsqueeze(0) for c in cols], alpha)
        err = group_error(x, w32, kv_expand(s, repeat, head_dim), quant_w, quant_x, refs)
        errors[f"{alpha:g}"] = err
        if err < best_err:
            best, best_err = (alpha, s), err
    return best[0], best[1], errors

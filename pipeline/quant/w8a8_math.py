"""The number formats of the W8A8 schemes as plain functions over tensors: int8 and float8_e4m3fn weights with one
scale per output channel (round to nearest, or GPTQ's error feedback), and the activation quantizers the alpha search
of SmoothQuant measures with (per token, dynamic; or one static scale per tensor).

Weights: s = max|W_i,:| / qmax per output row i (qmax 127 for int8, 448 for float8_e4m3fn), q = round(W / s) clamped
to the grid; the dequantized weight is q * s. The scale is rounded to the checkpoint's dtype first, so q * s is what
the checkpoint holds exactly. Activations at run time are compressed-tensors' own forward (quantization/lifecycle/
forward.py); `quant_act` here is the same arithmetic for the search, not a second implementation that the figures
depend on.
"""
from __future__ import annotations

import torch

INT8_MAX = 127.0
INT8_ACT = 127.5  # compressed-tensors' symmetric int8 activation scale: max|x| / (255 / 2), grid [-128, 127]
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


def channel_scale(w: torch.Tensor, qmax: float, dtype: torch.dtype) -> torch.Tensor:
    """One scale per output row [out, 1], rounded to `dtype` and returned in float32."""
    s = (w.detach().float().abs().amax(1, keepdim=True) / qmax).clamp(min=torch.finfo(torch.float16).tiny)
    return s.to(dtype).float()


def int8_round(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """int8 values round(w / s) on the symmetric grid [-127, 127] (float32 holding integers)."""
    return torch.round(w.float() / s).clamp(-INT8_MAX, INT8_MAX)


def fp8_round(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn values of w / s (round to nearest even, saturated at +-448), as float32."""
    return (w.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8).float()


def rtn(w: torch.Tensor, kind: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, s): per-channel round to nearest; kind "int8" or "fp8"; q * s is the dequantized weight."""
    if kind == "int8":
        s = channel_scale(w, INT8_MAX, dtype)
        return int8_round(w, s), s
    s = channel_scale(w, FP8_MAX, dtype)
    return fp8_round(w, s), s


def fake_weight(w: torch.Tensor, kind: str = "int8", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    q, s = rtn(w, kind, dtype)
    return q * s


def quant_act(x: torch.Tensor, kind: str = "int8", static_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Fake-quantized activations: per token (the last dim's max) when static_scale is None, else one scale;
    compressed-tensors' arithmetic (calculate_qparams, fake_quantize) for symmetric int8 / float8."""
    qmax = INT8_ACT if kind == "int8" else FP8_MAX
    s = (x.abs().amax(-1, keepdim=True) / qmax) if static_scale is None else static_scale
    s = s.clamp(min=torch.finfo(torch.float32).tiny)
    if kind == "int8":
        return torch.round(x / s).clamp(-INT8_MAX - 1, INT8_MAX) * s
    return (x / s).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * s


@torch.no_grad()
def gptq_channel(w: torch.Tensor, hessian: torch.Tensor, dtype: torch.dtype, damp: float = 0.01,
                 block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ (Frantar et al. 2022, Algorithm 1) at 8 bits with one scale per output channel, columns in order:
    each column is rounded, and its error, weighted by the inverse Hessian's Cholesky factor, is pushed onto the
    columns not yet rounded. hessian: X^T X of the layer's calibration inputs [in, in]. Returns (q, s) like rtn."""
    W = w.detach().float().clone()
    H = hessian.float().clone()
    s = channel_scale(W, INT8_MAX, dtype)
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    H += torch.eye(H.shape[0]) * (damp * torch.mean(torch.diag(H)))
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    Q = torch.zeros_like(W)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny ops: with 2 threads on shared cores each one waits for the other
    try:                      # thread to be scheduled (measured on SmolLM2's down_proj: 16.9 s -> 1.3 s)
        _gptq_columns(W, Hinv, s, Q, block)
    finally:
        torch.set_num_threads(threads)
    return Q, s


def _gptq_columns(W: torch.Tensor, Hinv: torch.Tensor, s: torch.Tensor, Q: torch.Tensor, block: int) -> None:
    n = W.shape[1]
    for i1 in range(0, n, block):
        i2 = min(i1 + block, n)
        W1, Hinv1 = W[:, i1:i2].clone(), Hinv[i1:i2, i1:i2]
        Err1 = torch.zeros_like(W1)
        for i in range(i2 - i1):
            col, d = W1[:, i], Hinv1[i, i]
            q = int8_round(col.unsqueeze(1), s).squeeze(1)
            Q[:, i1 + i] = q
            err = (col - q * s.squeeze(1)) / d
            W1[:, i:] -= err.unsqueeze(1) @ Hinv1[i, i:].unsqueeze(0)
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]

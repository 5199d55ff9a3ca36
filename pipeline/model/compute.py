"""Half-precision models on CPUs that emulate 16-bit matmuls: the weights stay in their dtype, each matmul is
computed in float32 and its result rounded back (what a GPU's bfloat16 matmul does: float32 accumulation,
16-bit output).

    with float32_matmuls(dtype, device):   # around a forward pass, calibration or a quantizer's search
        model(ids)

On a CPU without AVX512-BF16/AMX, torch emulates bfloat16 matmuls: measured on this project's 2-core AVX2 machine,
a 2048x2048 @ 2048x8192 bfloat16 linear runs at 8 GFLOPS, and at 48 GFLOPS upcast per call. Upcasting per call
(not per model) keeps one extra float32 copy of one weight at a time, so the memory saving of the half-precision
checkpoint stays. Where the device computes the dtype natively (CUDA, CPUs with the units), or the model is float32,
this is a no-op. Speed measurements never use it: a user's transformers would not.

A torch function mode catches every matmul of the thread that entered it; engines that run forwards on their own
threads (GPTQModel's AWQ searches scales on its device workers) are caught at `torch.nn.functional.linear`, which is
swapped process-wide for the duration (nn.Linear looks it up at each call).
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from pipeline.model.dtypes import DTYPE_NAMES, native_half

_HALF = (torch.bfloat16, torch.float16)
_MATMULS = frozenset({F.linear, F.scaled_dot_product_attention, torch.matmul, torch.Tensor.matmul,
                      torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm, torch.bmm, torch.Tensor.bmm, torch.addmm,
                      torch.Tensor.addmm, torch.baddbmm, torch.Tensor.baddbmm})


def _upcast(a):
    return a.float() if isinstance(a, torch.Tensor) and a.dtype in _HALF else a


class Float32Matmuls(TorchFunctionMode):
    """Matmuls whose floating-point operands are all one 16-bit dtype on the CPU run in float32; their result is
    returned in that dtype. Everything else passes through. `calls` counts the upcast calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MATMULS:
            floats = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.is_floating_point()]
            dt = floats[0].dtype if floats else None
            if dt in _HALF and all(t.dtype == dt and t.device.type == "cpu" for t in floats):
                self.calls += 1
                if func is F.linear:
                    return _linear(*args, **kwargs) if _many_rows(args[0]) else func(*args, **kwargs)
                out = func(*map(_upcast, args), **{k: _upcast(v) for k, v in kwargs.items()})
                return out.to(dt) if isinstance(out, torch.Tensor) else out
        return func(*args, **kwargs)


CHUNK_BYTES = 64 << 20  # the largest float32 copy of a weight made at once
MIN_ROWS = 16  # fewer input rows (tokens) than this: torch's own 16-bit linear, memory-bound anyway


_LINEAR = F.linear  # torch's own, whatever is swapped in below


def _many_rows(x: torch.Tensor) -> bool:
    """Enough input rows (tokens) to pay for upcasting the weight; decoding one token is memory-bound anyway."""
    return x.numel() >= MIN_ROWS * x.shape[-1]


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear in float32, its result in x's dtype; a weight above CHUNK_BYTES in float32 (an LM head: 128k x 4096
    is 2 GiB) is upcast a block of output rows at a time."""
    rows = max(1, CHUNK_BYTES // (4 * weight.shape[-1]))
    xf = x.float()
    out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=x.dtype)
    for i in range(0, weight.shape[0], rows):
        b = bias[i: i + rows].float() if bias is not None else None
        out[..., i: i + rows] = _LINEAR(xf, weight[i: i + rows].float(), b)
    return out


def _linear_any_thread(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What torch.nn.functional.linear is while float32_matmuls is active: _linear for 16-bit CPU operands."""
    dt = input.dtype
    if (dt in _HALF and weight.dtype == dt and input.device.type == "cpu" and weight.device.type == "cpu"
            and (bias is None or bias.dtype == dt) and _many_rows(input)):
        return _linear(input, weight, bias)
    return _LINEAR(input, weight, bias)


_swapped = 0
_swap_lock = threading.Lock()


@contextlib.contextmanager
def _linear_swapped() -> Iterator[None]:
    global _swapped
    with _swap_lock:
        _swapped += 1
        F.linear = _linear_any_thread
    try:
        yield
    finally:
        with _swap_lock:
            _swapped -= 1
            if _swapped == 0:
                F.linear = _LINEAR


def upcasts(dtype: str | torch.dtype | None, device: str) -> bool:
    """Whether float32_matmuls changes anything for a model in `dtype` on `device`."""
    name = str(dtype).removeprefix("torch.") if dtype is not None else "float32"
    return device == "cpu" and name in DTYPE_NAMES and name != "float32" and not native_half("cpu", name)


@contextlib.contextmanager
def float32_matmuls(dtype: str | torch.dtype | None, device: str) -> Iterator[Float32Matmuls | None]:
    """Float32Matmuls around the block when upcasts(dtype, device), else nothing (yields None)."""
    if not upcasts(dtype, device):
        yield None
        return
    with _linear_swapped(), Float32Matmuls() as mode:
        yield mode


def describe(dtype: str | torch.dtype | None, device: str) -> str:
    """What the report says about how a model in `dtype` was computed."""
    name = str(dtype).removeprefix("torch.") if dtype is not None else "float32"
    if upcasts(dtype, device):
        return f"{name} weights, float32 matmuls (this CPU has no {name} units)"
    return name

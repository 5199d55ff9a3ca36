"""AWQ's clipping search as matrix products: the same search, and AWQ 4.25x faster end to end on SmolLM2 (CPU).

After the scale search, GPTQModel 7.6's AWQ (`AWQProcessor._compute_best_clip`, gptqmodel/looper/awq_processor.py)
tries 10 shrink ratios of every group's max |w| on every linear except q/k and keeps, per output channel and
group, the one whose quantized weights best reproduce the group's partial outputs on 512 sampled calibration
tokens. It forms those outputs as a broadcast product `(x[1, T, G, g] * w[co, 1, G, g]).sum(-1)`: a
[co, T, G, g] temporary per step in the model's 16-bit dtype, memory-bound, and about nine tenths of AWQ's time
on a 2-core CPU. `matmul_clip_search()` computes the same partial outputs as one batched matrix product per step
(G products of [T, g] x [g, co], float32 accumulation) and leaves everything else as the library has it: the
token sampling, the clamp, the library's own pseudo-quantizer, the first-best tie rule. The chosen ratios differ
from the library's only where two ratios' errors are within 16-bit rounding of each other (float32 sums instead
of bfloat16 ones); tests/unit/test_quant_awq_autoround.py compares the two, research/awq_clip_search.py times
them.

    with matmul_clip_search():         # around GPTQModel's quantize() of an AWQ config (pipeline/quant/methods/awq.py)
        model.quantize(...)
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from gptqmodel.looper.awq_processor import AWQProcessor

from pipeline.quant.common import library_method_replaced


@torch.inference_mode()
def best_clip(self, w: torch.Tensor, input_feat: torch.Tensor, n_grid: int = 20, max_shrink: float = 0.5,
              n_sample_token: int = 512) -> torch.Tensor:
    """AWQProcessor._compute_best_clip's contract: w [co, ci], input_feat [..., ci] -> max |w| per output channel
    and group, [co, G, 1], in w's dtype."""
    assert w.dim() == 2
    co, ci = w.shape
    group_size = self.qcfg.group_size if self.qcfg.group_size > 0 else ci
    n_group = ci // group_size
    x = input_feat.reshape(-1, ci)
    x = x[:: max(1, x.shape[0] // n_sample_token)]  # the library's token sampling
    xg = x.to(w.device, torch.float32).reshape(-1, n_group, group_size).transpose(0, 1)  # [G, T, g]
    batch = 256 if co % 256 == 0 else 64  # the library's output-channel batches (memory)
    w4 = w.reshape(co, 1, n_group, group_size)
    clamped, quant = torch.empty_like(w4[:batch]), torch.empty_like(w4[:batch])
    best_all = []
    for start in range(0, co, batch):
        wb = w4[start:start + batch]
        n = wb.shape[0]
        org_max = wb.abs().amax(dim=-1, keepdim=True)  # [n, 1, G, 1]
        best, min_err = org_max.clone(), torch.full(org_max.shape, 1e9, device=w.device, dtype=torch.float32)
        org_out = torch.bmm(xg, _as_bmm(wb))  # [G, T, n]
        for i_s in range(int(max_shrink * n_grid)):
            max_val = org_max * (1 - i_s / n_grid)
            torch.clamp(wb, -max_val, max_val, out=clamped[:n])
            self._pseudo_quantize_tensor_into(clamped[:n], quant[:n])
            err = (torch.bmm(xg, _as_bmm(quant[:n])) - org_out).pow_(2).mean(dim=1)  # [G, n]
            err = err.t().reshape(min_err.shape)
            better = err < min_err  # strict: the smallest shrink wins a tie, as in the library
            min_err[better] = err[better]
            best[better] = max_val[better]
        best_all.append(best)
    return torch.cat(best_all, dim=0).squeeze(1)


def _as_bmm(w4: torch.Tensor) -> torch.Tensor:
    """[n, 1, G, g] weights -> [G, g, n] float32, the right operand of one product per group."""
    return w4.squeeze(1).permute(1, 2, 0).to(torch.float32)


@contextlib.contextmanager
def matmul_clip_search() -> Iterator[None]:
    """GPTQModel's AWQ clipping search computed with batched matrix products (re-entrant; the library's own
    method is back on exit)."""
    with library_method_replaced(AWQProcessor, "_compute_best_clip", lambda _library: best_clip):
        yield

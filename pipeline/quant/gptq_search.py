"""GPTQ's `mse` scale search without the half of it whose answer GPTQModel throws away; the same bytes out.

With `mse > 0` (the recipe default 2.4: GPTQ's shrinking range search, 80 rounds of sum |w - q(w)|^mse per row),
GPTQModel 7.6's GPTQ first calls `Quantizer.find_params` on the whole weight matrix, then again on every group of
`group_size` columns before any column is quantized (gptqmodel/quantization/gptq.py): the whole-matrix answer is
overwritten unused, yet its search costs about as much as all the groups' together. `group_search_only()`
answers that call with the plain min/max range (the search's own starting point) and leaves every group's search
to the library. Measured: GPTQ 1.4-1.7x faster on CPU with byte-identical checkpoints (research/gptq_mse_search.py;
tests/unit/test_quant.py checks the bytes for group-aware, act-order, asymmetric and GPTAQ/FOEM GPTQ).

    with group_search_only():          # around GPTQModel's quantize() (pipeline/quant/gptqmodel_driver.py)
        model.quantize(...)
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

from gptqmodel.quantization.quantizer import Quantizer

from pipeline.quant.common import library_method_replaced


class _PlainRange:
    """A quantize config that reads as `base` except `mse = 0`: one Quantizer's view; nothing shared changes
    (GPTQModel's worker threads share the config)."""

    mse = 0.0

    def __init__(self, base):
        self._base = base

    def __getattr__(self, name):
        return getattr(self._base, name)


def _groups_only(original):
    def find_params(self, x, weight=False):
        group_size = int(getattr(self.qcfg, "group_size", -1) or -1)
        mse = float(getattr(self.qcfg, "mse", 0.0) or 0.0)
        if weight and mse > 0 and group_size > 0 and x.dim() == 2 and x.shape[1] > group_size:
            qcfg = self.qcfg  # the whole-matrix call: each group is searched again before it is quantized
            self.qcfg = _PlainRange(qcfg)
            try:
                return original(self, x, weight)
            finally:
                self.qcfg = qcfg
        return original(self, x, weight)

    return find_params


@contextlib.contextmanager
def group_search_only() -> Iterator[None]:
    """GPTQModel's Quantizer.find_params without the scale search on whole multi-group matrices (re-entrant;
    the library's own method is back on exit)."""
    with library_method_replaced(Quantizer, "find_params", _groups_only):
        yield

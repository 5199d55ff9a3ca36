"""The architecture matrix's run for an MoE architecture (qwen3_moe): every method that
`compress check` passes runs through `compress run` and scores a finite perplexity on its reloaded checkpoint.

Cells that docs/architectures.json records as failing are strict xfails carrying the recorded error: the test
fails (XPASS) once such a cell works, until the matrix is rerun and the JSON says so
(`python scripts/arch_matrix.py --only <type> --methods <name>`)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.script_module import arch_matrix

ROOT = Path(__file__).resolve().parents[2]
# the MoE one only in CI (about 5 minutes on 2 cores): the dense Llama-shaped path is what the e2e tier and
# recipes/ci-real.toml already run; every architecture is measured by `python scripts/arch_matrix.py`
ARCHS = ("qwen3_moe",)

pytestmark = pytest.mark.slow


_matrix = arch_matrix


AM = _matrix()
RECORDED = AM.load_results().get("architectures", {})


def _param(arch: str, cell: str):
    recorded = RECORDED.get(arch, {}).get("cells", {}).get(cell) or {}
    if recorded.get("status") in (AM.FAILED, AM.NONFINITE):
        why = recorded.get("error") or recorded.get("status")
        reason = f"recorded in docs/architectures.json ({recorded.get('date')}): {why}"
        return pytest.param(arch, cell, marks=pytest.mark.xfail(strict=True, reason=reason))
    return pytest.param(arch, cell)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """One check + run per architecture, every method, shared by that architecture's cells."""
    scratch = tmp_path_factory.mktemp("arch-matrix")
    return {arch: AM.measure(arch, list(AM.METHODS), scratch, AM.TIMEOUT_S) for arch in ARCHS}


@pytest.mark.parametrize("arch,cell", [_param(a, c) for a in ARCHS for c in AM.METHODS])
def test_cell_is_refused_at_check_or_scores_a_finite_perplexity(measured, arch, cell):
    info, results = measured[arch]
    result = results[cell]
    if result["status"] == AM.REFUSED:
        assert result["codes"] and result["reason"]  # refused by check, naming why: allowed
        return
    assert result["status"] == AM.GREEN, f"{arch} {cell}: {result['status']}: {result.get('error')}"
    assert math.isfinite(result["perplexity"]) and math.isfinite(result["ppl_ratio"]), result
    assert result["kl"] is not None and math.isfinite(result["kl"]) and result["kl"] >= 0, result

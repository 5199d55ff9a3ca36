"""The GPU check's SDPA backend rows (benchmarks/gpu/sdpa_backends.py), rehearsed on the CPU for real: each backend
this CPU runs is checked against math before it is timed, one it cannot run is a skip with torch's reason, and a
row outside its tolerance is not timed. The CUDA rows themselves: tests/gpu/test_cuda.py (skipped here)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.gpu.sdpa_backends import BACKENDS, kernel_rows, model_rows, run_under

ROOT = Path(__file__).resolve().parents[2]


def _runs_on_cpu(backend: str) -> bool:
    q = torch.randn(1, 2, 4, 8)
    return isinstance(run_under(backend, lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q)),
                      torch.Tensor)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      pad_token_id=0, eos_token_id=2, bos_token_id=1)
    folder = tmp_path_factory.mktemp("tiny-sdpa")
    LlamaForCausalLM(cfg).eval().save_pretrained(folder)
    return folder


def test_each_backend_is_checked_against_math_then_timed_or_skipped_with_the_reason():
    out = kernel_rows("cpu", torch.float32, seq=64, repeats=2, heads=4, head_dim=16)
    assert set(out) == {"prefill", "decode"} and out["decode"]["q_len"] == 1 and out["prefill"]["causal"]
    for shape in out.values():
        assert set(shape["rows"]) == set(BACKENDS)
        assert shape["rows"]["math"]["max_abs_diff"] == 0 and shape["rows"]["math"]["ms"] > 0
        for name, row in shape["rows"].items():
            if _runs_on_cpu(name):
                assert row["max_abs_diff"] <= row["atol"] and row["ms"] > 0, (name, row)
            else:  # the memory-efficient kernel has no CPU implementation in torch
                assert row == {"skipped": row["skipped"]} and row["skipped"].startswith(f"{name} cannot run here: ")


def test_a_backend_outside_the_tolerance_records_the_difference_and_no_time():
    out = kernel_rows("cpu", torch.float32, seq=64, repeats=1, heads=4, head_dim=16, atol=1e-30)
    fused = [r for r in out["prefill"]["rows"].values() if "skipped" not in r and r["max_abs_diff"] > 0]
    if not fused:
        pytest.skip("every backend this CPU runs agrees with math bit for bit")
    assert all("ms" not in r and "differs from math" in r["error"] for r in fused)


def test_model_rows_compare_logits_with_math_before_timing_decode(tiny_dir):
    rows = model_rows(tiny_dir, "cpu", torch.float32, atol=1e-3, prompt_len=8, new_tokens=4, repeats=1)
    assert rows["math"]["max_abs_logit_diff"] == 0 and rows["math"]["decode_tokens_per_s"]["median"] > 0
    for name, row in rows.items():
        assert ("skipped" in row) != _runs_on_cpu(name), (name, row)
        if "skipped" not in row:
            assert row["max_abs_logit_diff"] <= 1e-3 and row["decode_tokens_per_s"]["n"] == 1


def test_the_command_line_writes_the_rows(tiny_dir, tmp_path):
    subprocess.run([sys.executable, "-m", "benchmarks.gpu.sdpa_backends", "--device", "cpu", "--seq", "32",
                    "--model-dir", str(tiny_dir), "--out", str(tmp_path)], cwd=ROOT, check=True,
                   capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    result = json.loads((tmp_path / "sdpa.json").read_text())
    assert result["device"] == "cpu" and result["dtype"] == "float32"
    assert set(result["kernel"]["prefill"]["rows"]) == set(result["model"]["rows"]) == set(BACKENDS)

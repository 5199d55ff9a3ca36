"""Mixed-precision exports ([quantize.mix]) in vLLM's CPU build, through the serve unit's measurement: a 4-bit mix of
group sizes is served with 0 errors in both formats (GPTQ with GPTQModel's `dynamic` overrides, which vLLM looks up
under its fused names qkv_proj/gate_up_proj; compressed-tensors with a config group per setting), and a mix with an
8-bit module is refused by the CPU kernel, saying so. The tiny random Llama, eager mode (~40 s a start on 2 cores).
Skipped, saying so, where .venv-vllm is not set up. On an AVX2-only CPU vLLM's CPU build has no weight-only kernel
(pipeline/serve/engines/vllm.py): the serving tests are skipped there, saying so, and the refusal is tested instead."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from pydantic import TypeAdapter

from pipeline.quant.registry import QuantVariant
from pipeline.serve.config import ServeConfig
from pipeline.serve.engines import get
from pipeline.serve.engines.vllm import wna16_missing
from pipeline.serve.measure import Refused
from tests.serve_helpers import tiny_export

pytestmark = [pytest.mark.slow, pytest.mark.skipif(get("vllm").missing() is not None,
                                                   reason=f"vllm engine: {get('vllm').missing()}")]
PROMPTS = [f"word{i} " * 12 for i in range(16)]
NO_WNA16 = wna16_missing("weight-only checkpoints")
needs_wna16 = pytest.mark.skipif(NO_WNA16 is not None, reason=f"this CPU: {NO_WNA16}")
CFG = ServeConfig(enabled=True, concurrency=[1, 4], requests_per_level=4, max_tokens=8, equality_prompts=2,
                  equality_tokens=8, max_model_len=128, compile=False, timeout_s=300)


def mixed_export(tmp_path: Path, fmt: str, bits: list[int], bpw: float) -> tuple[Path, dict]:
    from pipeline.quant.api import quantize_variant

    base = tiny_export(tmp_path / "tiny")
    v = TypeAdapter(QuantVariant).validate_python(
        {"method": "gptq", "name": "mix", "bits": 4, "group_size": 32, "mse": 0.0, "format": fmt,
         "mix": {"budget": {"bits_per_weight": bpw}, "bits": bits, "group_sizes": [32, -1], "probe_rows": 2,
                 "hessian_rows": 4}})
    calib = torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(0))
    out = tmp_path / "mix"
    details = quantize_variant(base, v, calib, out, logging.getLogger("t"), 0)
    shutil.copyfile(base / "tokenizer_config.json", out / "tokenizer_config.json")  # the chat template
    allocation = details["mix"]["allocation"]
    assert len({(a["bits"], a["group_size"]) for a in allocation.values()}) > 1, allocation
    return out, allocation


@needs_wna16
@pytest.mark.parametrize("fmt,bpw", [("gptq", 4.8), ("compressed-tensors", 4.4)])
def test_vllm_cpu_serves_a_4_bit_mix_of_group_sizes(tmp_path: Path, fmt: str, bpw: float):
    from pipeline.serve.measure import measure

    out, allocation = mixed_export(tmp_path, fmt, [4], bpw)
    (tmp_path / "m").mkdir()
    r = measure(out, CFG, PROMPTS, tmp_path / "m", threads=1, engine="vllm")
    assert r["engine"] == "vllm" and r["server_exit"] == 0
    assert all(lv["errors"] == 0 and lv["requests"] == 4 and lv["output_tok_s"] > 0 for lv in r["levels"])
    log = (tmp_path / "m" / "server.log").read_text(errors="replace")
    assert "Using CPUWNA16LinearKernel" in log
    if fmt == "gptq":  # the overrides are in the checkpoint, one per unit that is not at the base setting
        qc = json.loads((out / "config.json").read_text())["quantization_config"]
        assert qc["dynamic"] and any("gate_up_proj" in k or "qkv_proj" in k for k in qc["dynamic"])


@needs_wna16
def test_vllm_cpu_refuses_a_mix_with_an_8_bit_module(tmp_path: Path):
    from pipeline.serve.measure import measure

    out, allocation = mixed_export(tmp_path, "compressed-tensors", [4, 8], 6.0)
    assert any(a["bits"] == 8 for a in allocation.values())
    (tmp_path / "m").mkdir()
    with pytest.raises(Refused, match=r"uint8b128\) not supported by CPUWNA16"):  # the worker's reason, quoted
        measure(out, CFG, PROMPTS, tmp_path / "m", threads=1, engine="vllm")
    log = (tmp_path / "m" / "server.log").read_text(errors="replace")
    assert "Quant type (uint8b128) not supported by CPUWNA16" in log


@pytest.mark.skipif(NO_WNA16 is None, reason="this CPU has AVX-512: vLLM's CPU build serves weight-only checkpoints")
def test_on_an_avx2_cpu_a_weight_only_checkpoint_is_refused_before_vllm_starts(tmp_path: Path):
    """`compress serve --engine vllm` exits 2 naming the CPU's ISA, instead of a server that answers every request
    with HTTP 500; the plan (compress check) refuses gptq/awq the same way (tests/unit/test_serve_engines.py)."""
    from pipeline.serve.measure import measure

    out, _ = mixed_export(tmp_path, "compressed-tensors", [4], 4.4)
    (tmp_path / "m").mkdir()
    with pytest.raises(Refused, match="AVX2 without AVX-512"):
        measure(out, CFG, PROMPTS, tmp_path / "m", threads=1, engine="vllm")
    assert "vllm.entrypoints" not in (tmp_path / "m" / "server.log").read_text(errors="replace")

"""An INT8 W8A8 compressed-tensors checkpoint written by method = "w8a8" (compressed-tensors 0.20) served by vLLM's
CPU build (which carries compressed-tensors 0.17) through the serve unit's measurement: it loads, answers and passes
a load test with 0 errors; with kv_cache = "fp8" vLLM stores its KV cache in fp8 (one byte a value: twice the tokens in the same memory; its
CPU build needs AVX-512 or AMX and a head size divisible by 32: on an AVX2 CPU that row checks that `compress serve`
refuses it, naming the ISA, before vLLM starts). The tiny random Llama, eager mode (~40 s a start on 2 cores).
Skipped, saying so, where .venv-vllm is not set up."""
from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from pydantic import TypeAdapter

from pipeline.quant.registry import QuantVariant
from pipeline.serve.config import ServeConfig
from pipeline.serve.engines import get
from pipeline.serve.engines.vllm import fp8_kv_missing
from tests.serve_helpers import tiny_export

pytestmark = [pytest.mark.slow, pytest.mark.skipif(get("vllm").missing() is not None,
                                                   reason=f"vllm engine: {get('vllm').missing()}")]
PROMPTS = [f"word{i} " * 12 for i in range(16)]


@pytest.mark.parametrize("fields", [{"scheme": "int8-dynamic", "kv_cache": "fp8"},  # one vLLM start for both
                                    {"scheme": "int8-static", "static_min_tokens": 256}])
def test_vllm_cpu_serves_an_int8_w8a8_checkpoint(tmp_path: Path, fields: dict):
    from pipeline.quant.api import quantize_variant
    from pipeline.serve.measure import measure

    base = tiny_export(tmp_path / "tiny")
    v = TypeAdapter(QuantVariant).validate_python({"method": "w8a8", "name": "w8a8", **fields})
    calib = torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(0))
    out = tmp_path / "w8a8"
    quantize_variant(base, v, calib, out, logging.getLogger("t"), 0)
    shutil.copyfile(base / "tokenizer_config.json", out / "tokenizer_config.json")  # the chat template
    cfg = ServeConfig(enabled=True, concurrency=[1, 4], requests_per_level=4, max_tokens=8, equality_prompts=2,
                      equality_tokens=8, max_model_len=128, compile=False, timeout_s=300)
    (tmp_path / "m").mkdir()  # the serve unit's own folder, made by the unit before it measures
    if fields.get("kv_cache") == "fp8" and fp8_kv_missing():
        from pipeline.serve.measure import Refused

        with pytest.raises(Refused, match="FP8 KV cache.*AVX2 without AVX-512"):
            measure(out, cfg, PROMPTS, tmp_path / "m", threads=1, engine="vllm")
        return
    r = measure(out, cfg, PROMPTS, tmp_path / "m", threads=1, engine="vllm")
    assert r["engine"] == "vllm" and r["server_exit"] == 0
    assert all(lv["errors"] == 0 and lv["requests"] == 4 and lv["output_tok_s"] > 0 for lv in r["levels"])
    log = (tmp_path / "m" / "server.log").read_text(errors="replace")
    # bytes a cached token takes: 2 layers x (k, v) x 2 kv heads x 32 dims x 1 byte (fp8) or 2 (bfloat16, as served)
    memory = int(re.search(r"'kv_cache_memory_bytes': (\d+)", log).group(1))
    tokens = int(re.search(r"CPU KV cache size: ([\d,]+) tokens", log).group(1).replace(",", ""))
    assert memory / tokens == (256 if fields.get("kv_cache") == "fp8" else 512), (memory, tokens)

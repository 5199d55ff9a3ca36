"""Which float8 rounding reproduces vLLM CPU's perplexity for a checkpoint with an FP8 KV cache (issue #34: our figure
and vLLM's disagreed by 3 %). The checkpoint is loaded as the quality stage loads it (pipeline/quant/checkpoint.py:
activations and the KV cache quantized) and its keys and values are then rounded four ways: e4m3 to nearest with the
checkpoint's scales (what pipeline/quant/kv_fp8.py does: the format's definition), e4m3 toward zero, e5m2 to nearest,
e4m3 with scale 1.0; perplexity on the run's own windows.

    python -m research.kv_fp8_rounding artifacts/w8a8-kv w8a8-int8-sq-kv
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from pipeline.eval.perplexity import gptq_windows, perplexity, windowed_nll
from pipeline.quant import kv_fp8
from pipeline.quant.checkpoint import load_checkpoint


def to_nearest(fmt: torch.dtype):
    top = float(torch.finfo(fmt).max)

    def qdq(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        s = scale.to(x.device, torch.float32)
        return ((x.float() / s).clamp(-top, top).to(fmt).float() * s).to(x.dtype)
    return qdq


def e4m3_toward_zero(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    s = scale.to(x.device, torch.float32)
    q = (x.float() / s).clamp(-448, 448)
    r = q.to(torch.float8_e4m3fn)
    bits = r.view(torch.uint8)
    up = (r.float().abs() > q.abs()) & ((bits & 0x7F) > 0)  # rounded away from zero: one code down in magnitude
    return (torch.where(up, (bits - 1).view(torch.float8_e4m3fn), r).float() * s).to(x.dtype)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("model")
    a = ap.parse_args(argv)
    quality = a.run_dir / "validate" / a.model / "quality"
    ppl = json.loads((quality / "metrics.json").read_text())["perplexity"]
    ids = next(iter(load_file(a.run_dir / "validate" / "baseline" / "quality" / "eval_ids.safetensors").values()))
    windows = gptq_windows(ids.numel(), ppl["window"], ppl["windows"])
    folder = a.run_dir / "export" / a.model
    model = load_checkpoint(folder)
    if kv_fp8.read(folder) is None:
        raise SystemExit(f"{folder} declares no FP8 KV cache")
    kept = kv_fp8.quantize_dequantize
    print(f"quality stage's figure: {ppl['value']:.4f}")
    try:
        for label, fn, unit_scale in (("e4m3, to nearest, calibrated scales", to_nearest(torch.float8_e4m3fn), False),
                                      ("e4m3, toward zero, calibrated scales", e4m3_toward_zero, False),
                                      ("e5m2, to nearest, calibrated scales", to_nearest(torch.float8_e5m2), False),
                                      ("e4m3, to nearest, scale 1.0", to_nearest(torch.float8_e4m3fn), True)):
            kv_fp8.quantize_dequantize = fn
            if unit_scale:
                for m in kv_fp8.attention_layers(model).values():
                    m.compress_kv = (torch.tensor(1.0), torch.tensor(1.0))
            print(f"{label}: {perplexity(*windowed_nll(model, ids, windows)):.4f}", flush=True)
    finally:
        kv_fp8.quantize_dequantize = kept
    return 0


if __name__ == "__main__":
    sys.exit(main())

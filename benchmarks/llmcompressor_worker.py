"""llm-compressor's own quantization of a Hugging Face folder, run in llm-compressor's environment (it cannot be
installed beside compress: llmcompressor 0.14 pins transformers 5.17, huggingface_hub 1.x and auto-round 0.15), by
benchmarks/llmcompressor_anchor.py. Nothing of compress is imported here.

    <llmc-venv>/bin/python benchmarks/llmcompressor_worker.py MODEL CALIB.safetensors SCHEME OUT [--rows N]

The calibration rows are token ids (a compress run's calibrate/calibration.safetensors), handed to `oneshot` as a
dataset of input_ids, so both tools see the same tokens. Schemes (llm-compressor's recipes as its examples write them):
  w8a8            QuantizationModifier W8A8 (int8 weights per channel, int8 activations per token, dynamic)
  sq-w8a8         SmoothQuantModifier(smoothing_strength) then QuantizationModifier W8A8
  sq-gptq-w8a8    SmoothQuantModifier then GPTQModifier W8A8 (its W8A8 INT8 example)
  w8a8-kv         QuantizationModifier W8A8 with an FP8 KV cache (kv_cache_scheme, calibrated k/v scales)
  fp8-dynamic     QuantizationModifier FP8_DYNAMIC
  gptq-w4a16-g64  GPTQModifier W4A16 with group size 64 (SmolLM2's 576 in-features do not tile by 128)
  gptq-w4a16-g64-mse  the same with its "mse" observer (a grid search of each group's scale, as GPTQModel's mse)
Writes OUT (save_compressed) and OUT/llmcompressor_run.json (scheme, versions, seconds).
"""
from __future__ import annotations

import argparse
import json
import time
from importlib.metadata import version
from pathlib import Path

KV_FP8 = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def recipe(scheme: str, alpha: float):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

    ignore = ["lm_head"]
    if scheme == "w8a8":
        return [QuantizationModifier(targets="Linear", scheme="W8A8", ignore=ignore)]
    if scheme == "sq-w8a8":
        return [SmoothQuantModifier(smoothing_strength=alpha),
                QuantizationModifier(targets="Linear", scheme="W8A8", ignore=ignore)]
    if scheme == "sq-gptq-w8a8":
        return [SmoothQuantModifier(smoothing_strength=alpha),
                GPTQModifier(targets="Linear", scheme="W8A8", ignore=ignore)]
    if scheme == "w8a8-kv":
        return [QuantizationModifier(targets="Linear", scheme="W8A8", ignore=ignore, kv_cache_scheme=KV_FP8)]
    if scheme == "fp8-dynamic":
        return [QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=ignore)]
    if scheme in ("gptq-w4a16-g64", "gptq-w4a16-g64-mse"):
        observer = {"observer": "mse"} if scheme.endswith("-mse") else {}
        w4 = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
            num_bits=4, type="int", symmetric=True, strategy="group", group_size=64, **observer))
        return [GPTQModifier(config_groups={"group_0": w4}, ignore=ignore)]
    raise SystemExit(f"unknown scheme {scheme!r}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("calibration", type=Path)
    ap.add_argument("scheme")
    ap.add_argument("out", type=Path)
    ap.add_argument("--rows", type=int, default=16, help="calibration rows handed to oneshot (the first N)")
    ap.add_argument("--alpha", type=float, default=0.8, help="SmoothQuant's smoothing_strength (its examples: 0.8)")
    args = ap.parse_args()

    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    ids = load_file(args.calibration)["input_ids"][: args.rows]
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype="auto")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    t0 = time.perf_counter()
    oneshot(model=model, dataset=data, recipe=recipe(args.scheme, args.alpha), max_seq_length=ids.shape[1],
            num_calibration_samples=len(ids), shuffle_calibration_samples=False)
    seconds = time.perf_counter() - t0
    model.save_pretrained(args.out, save_compressed=True)
    tokenizer.save_pretrained(args.out)
    (args.out / "llmcompressor_run.json").write_text(json.dumps({
        "scheme": args.scheme, "rows": len(ids), "seq_len": ids.shape[1], "alpha": args.alpha,
        "oneshot_s": round(seconds, 1), "dtype": str(model.dtype),
        "versions": {p: version(p) for p in ("llmcompressor", "compressed-tensors", "transformers", "torch")}},
        indent=2) + "\n")


if __name__ == "__main__":
    main()

"""Predicted memory of the stages that can stream weights from disk: one formula shared by the plan
(`compress check`, pipeline/plan.py) and the stages that decide at run time whether to offload (the GPTQModel
quantizers, the baseline's perplexity). Torch-free, and imports nothing of the pipeline but its dtype table: a stage's identity includes
what it imports (pipeline/codehash.py), so editing the plan does not rerun quantization.
"""
from __future__ import annotations

from pathlib import Path

GiB = 1 << 30
# resident memory of the runtime before any weight: the main process with torch, transformers and GPTQModel imported
# (measured 0.52 GiB here); a fresh worker, or the main process before any engine is imported (the load stage), with
# torch and transformers (0.25-0.35 GiB); each with some room
RUNTIME_OVERHEAD = int(0.6 * GiB)
WORKER_OVERHEAD = int(0.4 * GiB)


def window_bytes(config: dict, seq_len: int) -> int:
    """Memory one perplexity window needs beside the weights: its logits (in the model's dtype, then float32, then
    their log-softmax: 2.5 float32 copies), the widest activations of a layer in float32, and a float32 copy of
    the largest weight, at most 64 MiB at a time (pipeline/compute.py upcasts 16-bit matmuls on CPUs without 16-bit
    units)."""
    h, vocab = config.get("hidden_size") or 0, config.get("vocab_size") or 0
    inter = config.get("intermediate_size") or 4 * h
    return seq_len * vocab * 10 + seq_len * max(inter, h) * 4 * 4 + min(4 * max(vocab * h, h * inter), 64 << 20)


def quantize_bytes(config: dict, weights: int, cal_tokens: int, offload: bool, param_bytes: int = 4) -> int:
    """Predicted peak RSS of a GPTQModel quantization (GPTQ, RTN), runtime included. weights: the checkpoint's
    bytes as loaded; cal_tokens: calibration tokens; param_bytes: bytes per weight as loaded. In memory: the model plus GPTQModel's working copies. Offloaded
    (GPTQModel's layer-by-layer path): the embeddings and head, a few layers in flight, one layer's Hessians in
    float32 (the widest input's, twice) and the calibration activations."""
    h = config.get("hidden_size") or 0
    inter = config.get("intermediate_size") or 4 * h
    acts = cal_tokens * h * 4 * 4
    if not offload:
        return RUNTIME_OVERHEAD + 2 * weights + acts
    n_layers = max(config.get("num_hidden_layers") or 1, 1)
    vocab = config.get("vocab_size") or 0
    heads = (1 if config.get("tie_word_embeddings", True) else 2) * vocab * h * param_bytes
    layer = (weights - heads) / n_layers
    return int(RUNTIME_OVERHEAD + heads + 3 * layer + 2 * 4 * max(h, inter) ** 2 + acts)


def quantize_peak(base_dir: Path, calib_ids, offload: bool) -> int:
    """quantize_bytes for the checkpoint in base_dir (its config.json and safetensors sizes)."""
    import json

    from pipeline.dtypes import config_dtype, dtype_bytes

    config = json.loads((Path(base_dir) / "config.json").read_text())
    weights = sum(f.stat().st_size for f in Path(base_dir).glob("*.safetensors"))
    return quantize_bytes(config, weights, calib_ids.numel() if calib_ids is not None else 0, offload,
                          dtype_bytes(config_dtype(config)))

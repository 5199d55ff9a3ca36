"""The formulas: predicted memory of the stages that can stream weights from disk, shared by the plan
(`compress check`, pipeline/estimate.py) and the stages that decide at run time whether to offload (the
GPTQModel quantizers, the baseline's perplexity). Torch-free, and imports nothing of the pipeline but its dtype table:
a stage's identity includes what it imports (pipeline/base/codehash.py), so editing the plan's
estimates does not rerun quantization.
"""
from __future__ import annotations

import json
from pathlib import Path

from pipeline.model.dtypes import config_dtype, dtype_bytes

GiB = 1 << 30
# resident memory of the runtime before any weight: the main process with torch, transformers and GPTQModel imported
# (measured 0.52 GiB here); a fresh worker, or the main process before any engine is imported (the load stage), with
# torch and transformers (0.25-0.35 GiB); each with some room
RUNTIME_OVERHEAD = int(0.6 * GiB)
WORKER_OVERHEAD = int(0.4 * GiB)


def window_bytes(config: dict, seq_len: int) -> int:
    """Memory one perplexity window needs beside the weights: its logits (in the model's dtype, then float32, then
    their log-softmax: 2.5 float32 copies), the widest activations of a layer in float32, and a float32 copy of
    the largest weight, at most 64 MiB at a time (pipeline/model/compute.py upcasts 16-bit matmuls on CPUs without
    16-bit units)."""
    h, vocab = config.get("hidden_size") or 0, config.get("vocab_size") or 0
    inter = config.get("intermediate_size") or 4 * h
    return seq_len * vocab * 10 + seq_len * max(inter, h) * 4 * 4 + min(4 * max(vocab * h, h * inter), 64 << 20)


def quantize_bytes(config: dict, weights: int, cal_tokens: int, offload: bool, param_bytes: int = 4) -> int:
    """Predicted peak RSS of a GPTQModel quantization (GPTQ, RTN), runtime included. weights: the checkpoint's
    bytes as loaded; cal_tokens: calibration tokens; param_bytes: bytes per weight as loaded. In memory: the model
    plus GPTQModel's working copies. Offloaded (GPTQModel's layer-by-layer path): the embeddings and head, a few
    layers in flight, one layer's Hessians in float32 (the widest input's, twice) and the calibration activations."""
    h = config.get("hidden_size") or 0
    inter = config.get("intermediate_size") or 4 * h
    acts = cal_tokens * h * 4 * 4
    if not offload:
        return RUNTIME_OVERHEAD + 2 * weights + acts
    n_layers = max(config.get("num_hidden_layers") or 1, 1)
    heads = head_bytes(config, param_bytes)
    layer = (weights - heads) / n_layers
    return int(RUNTIME_OVERHEAD + heads + 3 * layer + 2 * 4 * max(h, inter) ** 2 + acts)


def head_bytes(config: dict, param_bytes: int) -> int:
    """Bytes of the embeddings and the LM head (one matrix when tied), which quantizers keep unquantized."""
    h, vocab = config.get("hidden_size") or 0, config.get("vocab_size") or 0
    return (1 if config.get("tie_word_embeddings", True) else 2) * vocab * h * param_bytes


def quantize_peak(base_dir: Path, calib_ids, offload: bool) -> int:
    """quantize_bytes for the checkpoint in base_dir (its config.json and safetensors sizes)."""
    config = json.loads((Path(base_dir) / "config.json").read_text())
    weights = sum(f.stat().st_size for f in Path(base_dir).glob("*.safetensors"))
    return quantize_bytes(config, weights, calib_ids.numel() if calib_ids is not None else 0, offload,
                          dtype_bytes(config_dtype(config)))


def speed_bytes(config: dict, resident: int, speed: dict) -> int:
    """Predicted peak RSS of timing one model (pipeline/eval/speed.py), runtime included: its weights as they are
    resident (`resident`), the KV cache of the largest batch in float32, a prompt's widest activations in float32,
    the last position's logits, and the copy-bandwidth buffers. Timing never offloads weights to disk: a decode
    rate read from disk is not a speed figure, so a model that does not fit is not timed (pipeline/eval/speed.py
    speed_skip)."""
    h = config.get("hidden_size") or 0
    inter = config.get("intermediate_size") or 4 * h
    heads = config.get("num_attention_heads") or 1
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or h // heads
    batch = max(speed.get("batch_sizes") or [1])
    prompt, new = speed.get("prompt_len", 128), speed.get("new_tokens", 32)
    kv = 2 * (config.get("num_hidden_layers") or 0) * kv_heads * head_dim * batch * (prompt + new) * 4
    acts = batch * prompt * max(inter, h) * 4 * 4
    logits = batch * (config.get("vocab_size") or 0) * 4 * 2
    bandwidth = 2 * (speed.get("bandwidth_mib", 256) << 20) if speed.get("roofline", True) else 0
    return int(WORKER_OVERHEAD + resident + kv + acts + logits + bandwidth)

"""calibrate: tokenize calibration samples once; every variant that needs calibration shares them. On a
Mixture-of-Experts model, also count the calibration tokens routed to each expert (through the baseline)."""
from __future__ import annotations

import gc
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer

from pipeline import data
from pipeline.base.unit import Unit, UnitContext
from pipeline.data.calib import sample_token_windows, training_documents
from pipeline.model.architecture import architecture_of
from pipeline.model.compute import float32_matmuls
from pipeline.quant.checkpoint import load_checkpoint
from pipeline.quant.coverage import measure
from pipeline.stages.kinds import Calibrate, Load

CODE = ("stages/calibrate.py",)  # the entry module: what it imports is found by pipeline/base/codehash.py


def unit(recipe) -> Unit:
    cfg = recipe.calibration
    # allow_overlap is a check (compress check), not an input; the corpus counts by content (a local file's sha256)
    config = {"calibration": cfg.model_dump(exclude={"allow_overlap"}),
              "data": data.identity(data.resolve(cfg.dataset, cfg.text_field))}
    return Unit(Calibrate.key(), config, lambda ctx: run(ctx, recipe), deps=[Load.key()], code=CODE)


def run(ctx: UnitContext, recipe) -> dict:
    cfg = recipe.calibration
    tokenizer = AutoTokenizer.from_pretrained(ctx.dep(Load.key()))
    docs = training_documents(cfg)
    ids = sample_token_windows(tokenizer, docs, cfg.num_samples, cfg.seq_len, cfg.sampling, ctx.seed, cfg.chat_template)
    save_file({"input_ids": ids.contiguous()}, ctx.out / "calibration.safetensors")
    preview = [tokenizer.decode(row[:48]) for row in ids[:3]]
    info = {"dataset": cfg.dataset, "documents_available": len(docs), "num_samples": int(ids.shape[0]),
            "seq_len": int(ids.shape[1]), "tokens": int(ids.numel()), "sampling": cfg.sampling,
            "chat_template": cfg.chat_template, "preview": preview}
    coverage = expert_coverage(ctx.dep(Load.key()), ids, ctx.device)
    if coverage is not None:  # a dense model's metrics stay as they were: its variants are not recomputed
        info["expert_coverage"] = coverage
    (ctx.out / "calibration.json").write_text(json.dumps(info, indent=2))
    return info


def expert_coverage(model_dir: Path, ids: torch.Tensor, device: str) -> dict | None:
    """Tokens per (MoE layer, expert) for these rows through the baseline (pipeline/quant/coverage.py); None for a
    dense model."""
    arch = architecture_of(json.loads((model_dir / "config.json").read_text()))
    if not arch.is_moe:
        return None
    model = load_checkpoint(model_dir, device)
    try:
        with float32_matmuls(model.dtype, device):  # a 16-bit model on a CPU without 16-bit units
            return measure(model, ids, arch)
    finally:
        del model
        gc.collect()


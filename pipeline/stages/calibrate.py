"""calibrate: tokenize calibration samples once; every variant that needs calibration shares them."""
from __future__ import annotations

import json

from safetensors.torch import save_file
from transformers import AutoTokenizer

from pipeline import data
from pipeline.base.unit import Unit, UnitContext
from pipeline.data.calib import sample_token_windows, training_documents
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
    (ctx.out / "calibration.json").write_text(json.dumps(info, indent=2))
    return info


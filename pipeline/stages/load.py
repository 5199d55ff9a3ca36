"""load: resolve the recipe's model source and save it once as a normal HF checkpoint."""
from __future__ import annotations

import json

from pipeline.fileio import sha256_file
from pipeline.runner import Unit, UnitContext
from pipeline.sources import content_identity, describe, parse

CODE = ("stages/load.py",)  # the entry module: what it imports is found by pipeline/codehash.py


def unit(recipe) -> Unit:
    from pipeline.models import DEFAULT_TOKENIZER

    cfg = recipe.model
    src = parse(cfg.source, cfg.gguf_file)
    tokenizer = cfg.tokenizer or (DEFAULT_TOKENIZER if src.kind == "config" else None)
    # what the outputs depend on is the content of the source (file or folder) and of the tokenizer's, not paths
    config = {"model": cfg.model_dump(), "source_sha256": content_identity(src),
              "tokenizer_sha256": content_identity(parse(tokenizer)) if tokenizer else None}
    return Unit("load", config, lambda ctx: run(ctx, recipe), code=CODE)


def run(ctx: UnitContext, recipe) -> dict:
    from pipeline.models import load_source

    cfg = recipe.model
    src = parse(cfg.source, cfg.gguf_file)
    info = describe(src)
    model, tokenizer = load_source(src, cfg.dtype, ctx.seed, cfg.tokenizer, cfg.trust_remote_code)
    model.save_pretrained(ctx.out, safe_serialization=True)
    tokenizer.save_pretrained(ctx.out)
    ctx.fault("mid")
    metrics = {
        "source": cfg.source, "name": info.name, "architecture": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()), "dtype": cfg.dtype,
        "footprint_bytes": model.get_memory_footprint(), "provenance": info.provenance,
        "random_init": src.random_init, "license": info.license,
        "source_file": str(src.path), "source_sha256": sha256_file(src.path) if src.path.is_file() else None,
        "config": {k: model.config.to_dict().get(k) for k in ("hidden_size", "num_hidden_layers", "intermediate_size",
                                                              "vocab_size", "num_attention_heads", "num_key_value_heads")},
    }
    (ctx.out / "model_info.json").write_text(json.dumps(metrics, indent=2))
    return metrics


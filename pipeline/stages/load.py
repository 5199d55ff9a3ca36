"""load: resolve the recipe's model source and its precision, and write it once into load/ as a normal HF
checkpoint, holding at most one copy of the weights in memory (pipeline/model/materialize.py)."""
from __future__ import annotations

import json
import logging
import shutil

from transformers import AutoConfig

from pipeline.base.fileio import sha256_file
from pipeline.base.unit import Unit, UnitContext
from pipeline.model import materialize
from pipeline.model.dtypes import HALF_UNITS, cpu_flags, resolve_dtype
from pipeline.model.materialize import checkpoint_facts
from pipeline.model.models import check_vocab, load_model, source_tokenizer
from pipeline.model.sources import content_identity, describe, is_quantized, link_problem, parse
from pipeline.stages.kinds import Load

CODE = ("stages/load.py",)  # the entry module: what it imports is found by pipeline/base/codehash.py
log = logging.getLogger("compress")


def unit(recipe) -> Unit:
    cfg = recipe.model
    src = parse(cfg.source, cfg.gguf_file)
    tokenizer = cfg.tokenizer or src.default_tokenizer
    # what the outputs depend on is the content of the source (file or folder) and of the tokenizer's, not paths
    # "auto" on a GGUF depends on the device (in every unit's identity) and on this CPU's half-precision units
    config = {"model": cfg.model_dump(), "cpu_half_units": sorted(cpu_flags() & {f for v in HALF_UNITS.values()
                                                                                for f in v}),
              "source_sha256": content_identity(src),
              "tokenizer_sha256": content_identity(parse(tokenizer)) if tokenizer else None}
    return Unit(Load.key(), config, lambda ctx: run(ctx, recipe), code=CODE)


def run(ctx: UnitContext, recipe) -> dict:
    cfg = recipe.model
    src = parse(cfg.source, cfg.gguf_file)
    info = describe(src)
    dtype = resolve_dtype(cfg.dtype, src.source_kind, info.dtype, ctx.device)
    log.info("load: %s in %s%s", cfg.source, dtype, " ([model] dtype = auto)" if cfg.dtype == "auto" else "")
    tokenizer = source_tokenizer(src, cfg.tokenizer, cfg.trust_remote_code)
    weights = write_weights(ctx, src, dtype, cfg.trust_remote_code)
    tokenizer.save_pretrained(ctx.out)
    facts = checkpoint_facts(ctx.out, dtype, cfg.trust_remote_code)
    check_vocab(tokenizer, facts["config"]["vocab_size"])
    ctx.fault("mid")
    metrics = {
        "source": cfg.source, "name": info.name, "architecture": facts["architecture"],
        "parameters": facts["parameters"], "dtype": dtype, "footprint_bytes": facts["footprint_bytes"],
        "provenance": info.provenance, "random_init": src.random_init, "license": info.license,
        "source_file": str(src.path), "source_sha256": sha256_file(src.path) if src.path.is_file() else None,
        "weights": weights, "config": facts["config"],
    }
    (ctx.out / "model_info.json").write_text(json.dumps(metrics, indent=2))
    return metrics


def write_weights(ctx: UnitContext, src, dtype: str, trust_remote_code: bool) -> str:
    """Put the weights into ctx.out in `dtype` the cheapest way; returns how (recorded in the metrics)."""
    why = link_problem(src, dtype)
    if why is None and is_quantized(src):
        # a quantized checkpoint (another tool's compressed-tensors, GPTQ, ...) is evaluated as it was written:
        # loading and re-saving it through transformers would re-encode it and drop tensors its quantizer does not
        # know (an FP8 KV cache's k/v scales: compressed-tensors 0.20 finds no attention in transformers 5.24)
        how = materialize.link_checkpoint(src.path, ctx.out, trust_remote_code)
        for name in ("config.json", "generation_config.json"):
            if (src.path / name).is_file():
                shutil.copyfile(src.path / name, ctx.out / name)
        log.info("load: %s is already quantized: its files kept as written", src.spec)
        return "quantized checkpoint kept as written (" + (
            "hardlinked" if set(how.values()) == {"hardlink"} else "copied") + ")"
    if why is None:  # a safetensors folder kept as stored: config readable, then its files linked
        config = AutoConfig.from_pretrained(src.path, trust_remote_code=trust_remote_code)
        arch = type(materialize.meta_model(config, trust_remote_code)).__name__
        how = materialize.link_checkpoint(src.path, ctx.out, trust_remote_code)
        materialize.write_config(config, ctx.out, dtype, arch, folder=src.path)
        return "hardlinked" if set(how.values()) == {"hardlink"} else "copied"
    if src.is_gguf:
        why = materialize.gguf_to_safetensors(src.path, ctx.out, dtype)
        if why is None:
            log.info("load: %s dequantized tensor by tensor into safetensors (%s)", src.path.name, dtype)
            return "dequantized tensor by tensor"
    if src.random_init:
        config = AutoConfig.for_model(**json.loads(src.path.read_text()))
        materialize.random_to_safetensors(config, ctx.out, dtype, ctx.seed, trust_remote_code)
        log.info("load: %s built with random weights in %s tensor by tensor into safetensors", src.spec, dtype)
        return "random weights written tensor by tensor"
    log.info("load: loading %s once in %s and saving it (not %s: %s)", src.spec, dtype,
             "streamed" if src.is_gguf else "linked", why)
    model = load_model(src, dtype, ctx.seed, trust_remote_code)
    model.save_pretrained(ctx.out, safe_serialization=True)  # written from the tensors' memory: no second copy
    return "loaded in memory and saved"

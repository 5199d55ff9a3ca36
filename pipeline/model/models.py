"""Loading models and tokenizers from a recipe source (load stage), and the file facts of a checkpoint folder; a
checkpoint folder itself loads through pipeline/quant/checkpoint.py (every later stage)."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig

from pipeline.base.errors import StageError
from pipeline.model.dtypes import torch_dtype
from pipeline.model.sources import DEFAULT_TOKENIZER as DEFAULT_TOKENIZER  # re-exported (its home: the config: kind)
from pipeline.model.sources import ModelSource, parse

log = logging.getLogger("compress")


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise StageError("the recipe asks for device = 'cuda' but no CUDA device is available")
    return device


def load_tokenizer(source: ModelSource, trust_remote_code: bool = False):
    folder, kwargs = source.source_kind.tokenizer_files(source, trust_remote_code)
    return AutoTokenizer.from_pretrained(folder, **kwargs)


def load_source(source: ModelSource, dtype: str, seed: int, tokenizer_source: str | None,
                trust_remote_code: bool = False):
    """(model, tokenizer) for a recipe's [model] source, as a normal savable HF model on CPU, in `dtype` (a name
    in DTYPE_NAMES: "auto" is resolved before, pipeline/model/dtypes.py resolve_dtype)."""
    model = load_model(source, dtype, seed, trust_remote_code)
    tokenizer = source_tokenizer(source, tokenizer_source, trust_remote_code)
    check_vocab(tokenizer, model.config.vocab_size)
    return model, tokenizer


def load_model(source: ModelSource, dtype: str, seed: int, trust_remote_code: bool = False):
    """One copy of the source's weights in memory, in `dtype`: a GGUF through transformers (its whole state
    dict is read first: the load stage streams GGUFs instead, pipeline/model/materialize.py), a config: model built
    directly in `dtype` (transformers creates the parameters in it: no float32 copy), a checkpoint folder
    converted while loading."""
    dtype_ = torch_dtype(dtype)
    if source.is_gguf:
        model = AutoModelForCausalLM.from_pretrained(
            source.path.parent, gguf_file=source.gguf_file, dtype=dtype_,
            quantization_config=GgufConfig(dequantize=True))
    elif source.random_init:
        config = AutoConfig.for_model(**json.loads(source.path.read_text()))
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype_, trust_remote_code=trust_remote_code)
    else:
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype_, trust_remote_code=trust_remote_code)
    return model.eval()


def source_tokenizer(source: ModelSource, tokenizer_source: str | None, trust_remote_code: bool = False):
    """The tokenizer a [model] source runs with: [model].tokenizer, else the source's own (the SmolLM2 one
    for config: models)."""
    tok_src = parse(tokenizer_source) if tokenizer_source else (
        parse(source.default_tokenizer) if source.default_tokenizer else source)
    return load_tokenizer(tok_src, trust_remote_code)


def check_vocab(tokenizer, vocab_size: int) -> None:
    if len(tokenizer) > vocab_size:
        raise StageError(f"tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
                         f"{vocab_size}; pick a matching [model].tokenizer")


def single_gguf(folder: Path) -> str | None:
    """The name of the .gguf file a folder holds instead of config.json + safetensors (a `method = "gguf"`
    variant), or None for an HF checkpoint folder."""
    folder = Path(folder)
    if (folder / "config.json").is_file():
        return None
    files = sorted(p.name for p in folder.glob("*.gguf") if not p.name.startswith("."))
    if len(files) > 1:
        raise StageError(f"{folder} holds {len(files)} .gguf files {files} and no config.json: which one is the model?")
    return files[0] if files else None


def load_gguf(folder: Path, gguf_file: str, device: str = "cpu", dtype: torch.dtype | None = None):
    """A GGUF file as transformers loads it: every tensor dequantized (gguf's numpy dequantizers) into a dense
    model, the Q/K permutation of llama-arch files undone. float32 by default: llama.cpp computes in float32
    on the dequantized blocks, so the figures measure the file's weights, not a second rounding."""
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=dtype or torch.float32,
                                                 device_map=device, quantization_config=GgufConfig(dequantize=True))
    return model.eval()


def folder_bytes(folder: Path, suffixes: tuple[str, ...] = (".safetensors", ".gguf")) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and p.suffix in suffixes)

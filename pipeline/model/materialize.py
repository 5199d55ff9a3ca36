"""Writing a recipe's model source into load/ as a plain HF checkpoint folder, with at most one copy of the
weights in memory (the load stage picks the way; pipeline/model/models.py load_source is the in-memory way):

    link_checkpoint      a safetensors folder kept in its dtype: its weight files hardlinked (else copied)
    gguf_to_safetensors  a GGUF dequantized tensor by tensor straight into safetensors shards
    (anything else: loaded or built once in memory by models.load_source in its dtype, and saved; safetensors
    writes from the tensors' own memory, so saving adds no second copy)

config.json, generation_config.json and the tokenizer are always written fresh (small files), so nothing the
later stages write can land in a file shared with the source.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, dequantize
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
from transformers.core_model_loading import revert_weight_conversion
from transformers.modeling_gguf_pytorch_utils import (
    TENSOR_PROCESSORS,
    LlamaTensorProcessor,
    TensorProcessor,
    get_gguf_hf_weights_map,
    load_gguf_checkpoint,
    read_field,
)

from pipeline.base.errors import StageError
from pipeline.base.memory import MappedPagesTrimmed
from pipeline.model.dtypes import SAFETENSORS_DTYPES, torch_dtype
from pipeline.model.sources import weight_files

log = logging.getLogger("compress")
# rows of a GGUF tensor dequantized at a time: a large tensor is never whole in float32 (gguf's K-quant decoders
# also hold about twice their output in intermediates: 2.0 GB for Qwen2.5-1.5B's 0.89 GB head decoded whole)
ROWS = 4096
MAX_SHARD_BYTES = 50 * 10**9  # transformers' save_pretrained default (max_shard_size="50GB")
_SAFETENSORS_CODE = {v: k for k, v in SAFETENSORS_DTYPES.items()}


# ---------------------------------------------------------------- a checkpoint folder: linked


def link_or_copy(src: Path, dst: Path) -> str:
    """Hardlink src (symlinks followed: an hf: snapshot points into blobs/) to dst; copy when the filesystem
    refuses (another device, no permission). Returns "hardlink" or "copy"."""
    real = src.resolve()
    try:
        os.link(real, dst)
        return "hardlink"
    except OSError:
        shutil.copyfile(real, dst)
        return "copy"


def link_checkpoint(folder: Path, out: Path, trust_remote_code: bool = False) -> dict[str, str]:
    """Link a checkpoint folder's weights (*.safetensors, their index) and, with trust_remote_code, its model
    code (*.py) into `out`. Returns {file name: "hardlink" | "copy"}; what was copied is logged."""
    names = [p.name for p in weight_files(folder)]
    names += [p.name for p in folder.glob("*.safetensors.index.json")]
    if trust_remote_code:
        names += [p.name for p in folder.glob("*.py")]
    how = {name: link_or_copy(folder / name, out / name) for name in sorted(names)}
    copied = [n for n, h in how.items() if h == "copy"]
    if copied:
        log.info("load: could not hardlink %s from %s (another filesystem?): copied instead", ", ".join(copied), folder)
    else:
        log.info("load: hardlinked %d weight file(s) from %s (no copy)", len(how), folder)
    return how


def write_config(config, out: Path, dtype: str, architecture: str, folder: Path | None = None) -> None:
    """config.json declaring `dtype` and `architecture` (as save_pretrained writes them) and
    generation_config.json (the source folder's, else derived from the config, as from_pretrained does)."""
    config.dtype = dtype
    config.architectures = [architecture]
    config.save_pretrained(out)
    if folder is not None and (folder / "generation_config.json").is_file():
        gen = GenerationConfig.from_pretrained(folder)
    else:
        gen = GenerationConfig.from_model_config(config)
    gen.save_pretrained(out)


def meta_model(config, trust_remote_code: bool = False, dtype: str | None = None):
    """The model a config describes, on the meta device (no memory for weights): its class, parameter
    names, shapes and tied weights."""
    kwargs = {"dtype": torch_dtype(dtype)} if dtype else {}
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code, **kwargs)


# ---------------------------------------------------------------- a GGUF: dequantized tensor by tensor


def gguf_to_safetensors(path: Path, out: Path, dtype: str) -> str | None:
    """Dequantize the GGUF at `path` into safetensors shards in `out` in `dtype`, one tensor at a time and a large
    one ROWS rows at a time, with config.json and generation_config.json. Returns None when
    done, or why it does not stream this GGUF (nothing written then): only the plain and the llama tensor
    processors are replayed here; others (MoE experts merged across the file, GPT-2, T5, ...) load whole.
    The values are transformers' own: the same gguf dequantize, tensor processor and name map as
    from_pretrained(gguf_file=..., dtype=...)."""
    reader = GGUFReader(str(path))
    arch = read_field(reader, "general.architecture")[0]
    parsed = load_gguf_checkpoint(str(path), return_tensors=False)  # config and tokenizer fields only
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=parsed["config"])
    if type(processor) not in (TensorProcessor, LlamaTensorProcessor):
        return f"{arch!r} GGUFs go through transformers' {type(processor).__name__}, not replayed tensor by tensor"
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = meta_model(config, dtype=dtype)
    names = get_gguf_hf_weights_map(model, processor)
    # in name order, as save_pretrained writes them (the same bytes for the same tensors)
    entries = sorted((names[t.name], [int(d) for d in reversed(t.shape)], t) for t in reader.tensors if t.name in names)
    _check_covered(model, {name for name, _, _ in entries}, path)
    out_dtype = torch_dtype(dtype)

    def produce(t):
        data = t.data
        if data.ndim == 2 and data.shape[0] > ROWS and not (isinstance(processor, LlamaTensorProcessor) and (
                ".attn_q." in t.name or ".attn_k." in t.name)):  # rows the processor passes through: streamed
            return (torch.from_numpy(np.array(dequantize(data[i:i + ROWS], t.tensor_type))).to(out_dtype)
                    for i in range(0, data.shape[0], ROWS))
        g = processor.process(weights=dequantize(data, t.tensor_type), name=t.name, tensor_key_mapping=names,
                              parsed_parameters={"tensors": {}})  # Llama's q and k rows are permuted: whole
        w = g.weights if g.weights.flags.writeable else np.copy(g.weights)  # an F32 tensor is a read-only view
        return torch.from_numpy(np.ascontiguousarray(w)).to(out_dtype)

    # the reader maps the file: the pages each tensor was read from leave the resident set as the writing goes on
    with MappedPagesTrimmed(path.parent, suffix=path.suffix):
        write_safetensors(out, [(name, shape, functools.partial(produce, t)) for name, shape, t in entries], dtype)
    write_config(config, out, dtype, type(model).__name__)
    return None


def _check_covered(model, written: set[str], path: Path) -> None:
    """Every weight of the model comes from the GGUF (a tied head counts as its embedding)."""
    groups: dict[int, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), []).append(name)
    missing = [names[0] for names in groups.values() if not written & set(names)]
    if missing:
        raise StageError(f"{path.name}: the GGUF has no tensor for {len(missing)} weight(s) of "
                         f"{type(model).__name__} ({', '.join(missing[:5])})")


# ---------------------------------------------------------------- a config: random weights, tensor by tensor


def random_to_safetensors(config, out: Path, dtype: str, seed: int, trust_remote_code: bool = False) -> None:
    """The model `config` describes with random weights, written into safetensors in `out` one tensor at a time:
    the model is built on the meta device, and each tensor's module is materialised, initialised by the model's
    own `_init_weights` (transformers' initialisation for that architecture), written and dropped. Deterministic
    for a seed (tensors are drawn in name order). Tied weights are written once, as save_pretrained does."""
    model = meta_model(config, trust_remote_code, dtype)
    groups: dict[int, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), []).append(name)
    params = dict(model.state_dict(keep_vars=True))
    entries = sorted((names[0], list(params[names[0]].shape)) for names in groups.values())
    torch.manual_seed(seed)

    def produce(name: str) -> torch.Tensor:
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        module.to_empty(device="cpu", recurse=False)
        with torch.no_grad():
            model._init_weights(module)
        t = getattr(module, attr).detach().clone()
        module.to_empty(device="meta", recurse=False)
        return t

    # in the checkpoint's own names and layout, as save_pretrained writes them (revert_weight_conversion: e.g. a MoE's
    # fused 3D experts, transformers 5's in-memory form, become one linear per expert): the layout llama.cpp's
    # converter, GPTQModel and vLLM read. Each tensor's checkpoint parts are found on the meta device; it is made once,
    # in name order as before, and its parts are written one after another
    parts = {name: revert_weight_conversion(model, {name: torch.empty(shape, device="meta")})
             for name, shape in entries}
    made: dict[str, dict[str, torch.Tensor]] = {}

    def part(name: str, key: str) -> torch.Tensor:
        if name not in made:
            made.clear()  # the previous tensor's parts are all written
            made[name] = revert_weight_conversion(model, {name: produce(name)})
        return made[name][key]

    write_safetensors(out, [(key, list(t.shape), functools.partial(part, name, key))
                            for name, _ in entries for key, t in parts[name].items()], dtype)
    write_config(config, out, dtype, type(model).__name__)


# ---------------------------------------------------------------- safetensors, written one tensor at a time


def write_safetensors(out: Path, tensors: list[tuple[str, list[int], Callable[[], Any]]], dtype: str,
                      max_shard_bytes: int = MAX_SHARD_BYTES) -> list[Path]:
    """Write tensors (name, shape, a function producing it, or an iterable of its rows in blocks) into
    model.safetensors, or model-0000i-of-0000n shards plus model.safetensors.index.json past max_shard_bytes, all in
    `dtype`. Each header is computed from the shapes first, so a tensor is produced, written and dropped before the
    next one."""
    size = torch.empty((), dtype=torch_dtype(dtype)).element_size()
    shards: list[list] = [[]]
    filled = 0
    for name, shape, make in tensors:
        n = size * _numel(shape)
        if shards[-1] and filled + n > max_shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append((name, shape, make, n))
        filled += n
    files = [out / "model.safetensors"] if len(shards) == 1 else [
        out / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for f, shard in zip(files, shards, strict=True):
        _write_shard(f, shard, dtype)
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(n for s in shards for *_, n in s)},
                 "weight_map": {name: f.name for f, s in zip(files, shards, strict=True) for name, *_ in s}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return files


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _write_shard(path: Path, shard: list, dtype: str) -> None:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _, n in shard:
        header[name] = {"dtype": _SAFETENSORS_CODE[dtype], "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # the data starts 8-byte aligned (the format allows trailing spaces)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, shape, make, n in shard:
            made = make()  # the tensor, or its rows in consecutive blocks
            written = 0
            for t in [made] if isinstance(made, torch.Tensor) else made:
                if t.dtype != torch_dtype(dtype) or list(t.shape[1:]) != shape[1:] or (
                        isinstance(made, torch.Tensor) and list(t.shape) != shape):
                    raise StageError(f"{name}: produced {t.dtype} {list(t.shape)}, expected {dtype} {shape}")
                f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)  # the array's memoryview
                written += t.numel() * t.element_size()
                del t
            del made  # before the next tensor is made: one at a time
            if written != n:
                raise StageError(f"{name}: produced {written} bytes, expected {n} ({dtype} {shape})")


# ---------------------------------------------------------------- what was written


def checkpoint_facts(folder: Path, dtype: str, trust_remote_code: bool = False) -> dict:
    """Architecture, parameter count, in-memory size in `dtype` and config of the checkpoint in `folder`, from
    its config.json and a meta-device model (no weights read)."""
    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    model = meta_model(config, trust_remote_code, dtype)
    d = config.to_dict()
    return {"architecture": type(model).__name__, "parameters": sum(p.numel() for p in model.parameters()),
            "footprint_bytes": model.get_memory_footprint(),
            "config": {k: d.get(k) for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size",
                                              "num_attention_heads", "num_key_value_heads")}}

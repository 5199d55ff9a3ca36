"""What an export folder holds (torch-free: `compress serve` starts here; which engine serves it:
pipeline/serve/engines)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.base.errors import RecipeError
from pipeline.serve.engines import checkpoint_format

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass(frozen=True)
class ExportFolder:
    path: Path
    format: str  # "hf" (config.json + safetensors + tokenizer) or "gguf" (one .gguf file)
    quant_method: str | None  # config.json's quantization_config.quant_method (gptq, awq, bitsandbytes, torchao)
    gguf_file: str | None = None
    context: int | None = None  # max_position_embeddings

    @property
    def checkpoint_format(self) -> str:
        """As engines declare formats (pipeline/serve/engines): "gguf", "unquantized" or the quant_method."""
        return checkpoint_format(self.format, self.quant_method)


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

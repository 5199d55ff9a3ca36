"""The torch side of the GPTQModel-loaded formats' reload hook (pipeline/quant/gptq_format.py GPTQModelKernels)."""
from __future__ import annotations

from pathlib import Path

from gptqmodel import GPTQModel


def load_own(folder: Path, device: str):
    """GPTQModel's own loader, for a checkpoint with per-module bits or group sizes: its HF model."""
    return GPTQModel.load(str(folder), device=device).model

"""Environment taming done by the program, not the user.

GPTQModel and its dependencies read settings from the environment at import
time, so `tame()` must run before they are imported. It only sets what the
user has not set.
"""
from __future__ import annotations

import os
from pathlib import Path


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))


def tame() -> None:
    """Set the variables the quantization stack needs on small CPU machines."""
    cores = cpu_count()
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(max(1, min(cores, 2))))
    # tokenicer (a GPTQModel dependency) sets its own HF_HOME when unset: pin the standard one.
    os.environ.setdefault("HF_HOME", str(cache_root() / "huggingface"))
    # One shared torch-extensions cache so GPTQModel's C++ op builds once per machine.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(cache_root() / "torch_extensions"))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

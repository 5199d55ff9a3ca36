"""Environment taming done by the program, not the user.

GPTQModel and its dependencies read settings from the environment at import
time, so `tame()` must run before they are imported. It only sets what the
user has not set.
"""
from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import signal
from collections.abc import Mapping
from pathlib import Path


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


LLAMA_CPP_INSTALL = ("pip install -e '.[gguf-serve]' (llama-cpp-python 0.3.36 builds llama.cpp from source, about "
                     "8 minutes on 2 cores)")


def llama_cpp_installed() -> bool:
    """llama-cpp-python (an optional extra) is importable; found without importing it (compress check is torch-free)."""
    return importlib.util.find_spec("llama_cpp") is not None


def llama_cpp_threads(threads: int | None) -> int:
    """The threads llama.cpp runs with unless told: half the cores, its server's own default. The serve stage's
    llama.cpp server and a GGUF mix's latency measurement both use it, so a budget is measured as it is served."""
    return threads or max(1, (os.cpu_count() or 2) // 2)


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))


def tame() -> None:
    """Set the variables the quantization stack needs on small CPU machines."""
    release_freed_memory()
    for key, value in tamed_environ(os.environ).items():
        os.environ.setdefault(key, value)


def tamed_environ(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with tame()'s variables added where it has none: the environment of a child that imports torch on its
    first line (pipeline/base/forkserver_loop.py), as tame() sets it in this process."""
    cores = cpu_count()
    out = dict(env)
    out.setdefault("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD_BYTES))  # release_freed_memory's, for a new process
    out.setdefault("GPTQMODEL_CPU_WORKERS", str(max(1, min(cores, 2))))
    # tokenicer (a GPTQModel dependency) sets its own HF_HOME when unset: pin the standard one.
    out.setdefault("HF_HOME", str(cache_root() / "huggingface"))
    # One shared torch-extensions cache so GPTQModel's C++ op builds once per machine.
    out.setdefault("TORCH_EXTENSIONS_DIR", str(cache_root() / "torch_extensions"))
    out.setdefault("TOKENIZERS_PARALLELISM", "false")
    out.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    out.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    return out


def with_checkout_on_path(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with this checkout first on PYTHONPATH: a child `python -m pipeline...` runs this very code, wherever
    it is run from (worker tasks and their fork server)."""
    root = str(Path(__file__).resolve().parents[2])
    return dict(env, PYTHONPATH=os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")])))


def die_with_parent(sig: int = signal.SIGKILL) -> None:  # pragma: no cover - in the child (a preexec_fn, a fork)
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").prctl(1, sig)  # PR_SET_PDEATHSIG: a killed run kills its workers


# glibc serves a freed block up to its dynamic mmap threshold (which rises to 32 MiB as large blocks are freed)
# from its heap and keeps the pages: a model written or loaded tensor by tensor then holds every size class it
# ever used. Measured writing a 1.7B-parameter bfloat16 model tensor by tensor: peak RSS 1.74 GiB with the
# default, 0.72 GiB with a fixed 1 MiB threshold (blocks above it are mapped and unmapped whole).
MMAP_THRESHOLD_BYTES = 1 << 20


def release_freed_memory() -> None:
    """Blocks of MMAP_THRESHOLD_BYTES and more go back to the OS when freed (glibc mallopt M_MMAP_THRESHOLD; the
    variable MALLOC_MMAP_THRESHOLD_ does the same for child processes). A no-op without glibc."""
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD_BYTES))
    with contextlib.suppress(OSError, AttributeError):  # not glibc: a no-op
        ctypes.CDLL("libc.so.6").mallopt(-3, MMAP_THRESHOLD_BYTES)  # M_MMAP_THRESHOLD

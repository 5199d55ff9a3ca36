"""What GPU `compress check` would run on, without importing torch in its own process: nvidia-smi names the
cards, and a short child process asks torch whether it can use them (seeing nvidia-smi does not prove that
this environment's torch was built with CUDA)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuInfo:
    name: str
    memory_bytes: int
    torch_cuda: bool  # this environment's torch can use it
    note: str = ""


def probe(timeout_s: float = 20.0) -> GpuInfo | None:
    """The first NVIDIA GPU, or None when there is none (no nvidia-smi, or it lists no card)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=timeout_s).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    if not out:
        return None
    name, _, mib = out.splitlines()[0].rpartition(",")
    ask = "import torch; print(int(torch.cuda.is_available()), torch.__version__, torch.version.cuda)"
    try:
        reply = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True, timeout=timeout_s)
        ok, version, cuda = (reply.stdout.split() + ["0", "?", "?"])[:3]
    except (OSError, subprocess.TimeoutExpired):
        ok, version, cuda = "0", "?", "?"
    note = "" if ok == "1" else (f"torch {version} here has no CUDA (built for {cuda}): install a CUDA build of torch "
                                 "(scripts/setup.sh keeps one it finds in .venv)")
    return GpuInfo(name.strip(), int(float(mib.strip() or 0)) * 2**20, ok == "1", note)

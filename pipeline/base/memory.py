"""Peak memory: the one meter every stage, worker and benchmark uses.

    with PeakMemory() as m: ...          # m.peak_bytes (absolute), m.above_start_bytes
    m = PeakMemory("cuda").start(); ...; m.peak_above_base()

CPU: the kernel's RSS high-water mark. `start()` resets it (write "5" to /proc/self/clear_refs) and the
peak is read from VmHWM, so an allocation freed a microsecond later still counts. Meters nest: before a
reset, every running meter (and the process's lifetime peak) takes in the high-water mark so far. Where
the reset is refused or has no effect (some kernels and sandboxes), a thread samples RSS every
`interval_s` instead (an allocation freed faster than that can then be missed). Without /proc (non-Linux),
the lifetime peak of getrusage is all there is. CUDA: torch.cuda.max_memory_allocated.

Torch-free at import: only a CUDA meter imports torch.
"""
from __future__ import annotations

import ctypes
import gc
import re
import resource
import threading
from pathlib import Path
from types import TracebackType

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_active: list[PeakMemory] = []  # running CPU meters that rely on VmHWM (see _reset_hwm)
_lifetime_hwm = 0  # the process's high-water mark from before the last reset


def _status_bytes(field: str) -> int | None:
    """A "<field>: N kB" line of /proc/self/status in bytes; None where there is no /proc."""
    try:
        match = re.search(rf"^{field}:\s+(\d+)\s+kB", _STATUS.read_text(), re.M)
    except OSError:  # pragma: no cover - non-Linux
        return None
    return int(match.group(1)) * 1024 if match else None


def rss_bytes() -> int:
    """This process's resident memory now (the lifetime peak where /proc is missing)."""
    rss = _status_bytes("VmRSS")
    return rss if rss is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_rss_bytes() -> int:
    """This process's high-water RSS over its life (across the resets meters make). VmHWM restarts at exec,
    unlike ru_maxrss, which in a child counts the pages of the parent it was forked from."""
    hwm = _status_bytes("VmHWM")
    if hwm is None:  # pragma: no cover - non-Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return max(hwm, _lifetime_hwm)


def _reset_hwm() -> bool:
    """Reset VmHWM to the current RSS, first handing the mark so far to every running meter. False when
    the kernel refuses, or accepts the write but keeps an old, higher mark."""
    global _lifetime_hwm
    hwm = _status_bytes("VmHWM")
    if hwm is None:
        return False
    _lifetime_hwm = max(_lifetime_hwm, hwm)
    for meter in _active:
        meter._peak = max(meter._peak, hwm)
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    after, rss = _status_bytes("VmHWM"), _status_bytes("VmRSS")
    return after is not None and rss is not None and after <= rss + 2**20


def settle_heap() -> None:
    """A full garbage collection, after which what survived is left out of later ones (gc.freeze). The run calls it
    between units: PeakMemory's own collection at a unit's start then walks only what the previous unit left, not the
    ~600,000 objects of torch, transformers and GPTQModel's modules (0.3 s a collection here, at every unit and every
    quantization: 14 times in the tiny recipe). Only objects alive between units are kept out (modules, caches,
    the run's records), and a unit's garbage is collected before that, so no cycle a unit leaves behind is frozen."""
    gc.collect()
    gc.freeze()


class PeakMemory:
    """Peak memory of `device` between `start()` (or entering the block) and now, absolute and above the
    memory in use at the start. `kind` says how it was measured: "rss_hwm", "rss_sampled" or
    "cuda_max_allocated"."""

    def __init__(self, device: str = "cpu", interval_s: float = 0.002) -> None:
        self.device = str(device)
        self.cuda = self.device.startswith("cuda")
        self.kind = "cuda_max_allocated" if self.cuda else "rss_hwm"
        self.interval_s = interval_s
        self.start_bytes = 0
        self._peak = 0
        self._frozen = False
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> PeakMemory:
        if self.cuda:
            # late: only a CUDA measurement needs torch; the run's parent imports this module before tame()
            import torch

            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start_bytes = self._peak = torch.cuda.memory_allocated(self.device)
            return self
        gc.collect()  # garbage freed mid-measurement would hide the allocations that follow it under the base
        self.start_bytes = self._peak = rss_bytes()
        if _reset_hwm():
            _active.append(self)
        else:
            self.kind = "rss_sampled"
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        assert self._stop is not None
        while not self._stop.wait(self.interval_s):
            self._peak = max(self._peak, rss_bytes())

    @property
    def peak_bytes(self) -> int:
        """The absolute peak so far (bytes in use, not above the start); after `stop()`, the peak up to then."""
        if self._frozen:
            return self._peak
        if self.cuda:
            # late: only a CUDA measurement needs torch; the run's parent imports this module before tame()
            import torch

            torch.cuda.synchronize(self.device)
            return max(self._peak, int(torch.cuda.max_memory_allocated(self.device)))
        current = _status_bytes("VmHWM") if self.kind == "rss_hwm" else rss_bytes()
        self._peak = max(self._peak, current or 0)
        return self._peak

    def peak_above_base(self) -> int:
        return max(0, self.peak_bytes - self.start_bytes)

    above_start_bytes = property(peak_above_base)

    def stop(self) -> PeakMemory:
        """Freeze the peak: later reads return what was reached up to now."""
        self._peak = self.peak_bytes
        if self._stop is not None:
            self._stop.set()
            if self._thread is not None:
                self._thread.join()
        if self in _active:
            _active.remove(self)
        self._frozen = True
        return self

    def __enter__(self) -> PeakMemory:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


# The CPU meter's former name; pipeline/app/runner.py still imports it.


# ---------------------------------------------------------------- checkpoint pages mapped by a loader

_MADV_PAGEOUT = 21  # Linux 5.4+: reclaim; clean file pages go, dirty private (copy-on-write) ones stay


def _mapped_ranges(folder: Path, suffix: str = ".safetensors") -> list[tuple[int, int]]:
    """Address ranges of this process's memory maps of *<suffix> files under `folder`."""
    root = str(Path(folder).resolve())
    out: list[tuple[int, int]] = []
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:  # pragma: no cover - non-Linux
        return out
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].endswith(suffix) and parts[5].startswith(root):
            start, end = (int(x, 16) for x in parts[0].split("-"))
            out.append((start, end))
    return out


def drop_mapped_pages(folder: Path, suffix: str = ".safetensors") -> int:
    """Take the clean pages of every memory-mapped *.safetensors file (or *<suffix>: a GGUF) under `folder` out of
    this process's resident set (madvise MADV_PAGEOUT: a reclaim request; a page the loader modified in place —
    torch maps checkpoints private and writable, and GPTQModel rewrites zero points in place — is dirty and stays,
    and a clean one is read again from the file if touched). Returns the number of ranges. A loader that maps a whole
    checkpoint and reads it tensor by tensor (transformers, for bitsandbytes) otherwise keeps every page it read
    resident until the map closes. (MADV_DONTNEED would also drop the modified pages of a private map, silently
    reverting them to the file: a GPTQ checkpoint then measured perplexity 3e9.)"""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:  # pragma: no cover - not glibc
        return 0
    ranges = _mapped_ranges(folder, suffix)
    for start, end in ranges:
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_PAGEOUT)
    return len(ranges)


class MappedPagesTrimmed:
    """While the block runs, a thread drops the mapped checkpoint pages under `folder` every `interval_s` (and once
    at the end): the resident set holds what the loader made of the weights, not the file it read them from."""

    def __init__(self, folder: Path, interval_s: float = 0.1, suffix: str = ".safetensors") -> None:
        self.folder, self.interval_s, self.suffix = Path(folder), interval_s, suffix
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            drop_mapped_pages(self.folder, self.suffix)

    def __enter__(self) -> MappedPagesTrimmed:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        drop_mapped_pages(self.folder, self.suffix)

"""Peak resident memory of a block of code, above the RSS at its start.

`resource.getrusage` only knows the process-lifetime peak, so a thread samples
/proc/self/statm while the block runs (Linux; elsewhere the lifetime peak is used).
"""
from __future__ import annotations

import os
import resource
import threading
from types import TracebackType

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:  # pragma: no cover - non-Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakRSS:
    """with PeakRSS() as m: ...; m.peak_bytes (absolute), m.above_start_bytes."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self.start_bytes = 0
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_bytes = max(self.peak_bytes, rss_bytes())

    def __enter__(self) -> "PeakRSS":
        self.start_bytes = self.peak_bytes = rss_bytes()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak_bytes = max(self.peak_bytes, rss_bytes())

    @property
    def above_start_bytes(self) -> int:
        return max(0, self.peak_bytes - self.start_bytes)

"""Admission: at most `slots` sequences generate at once (the batch); up to `max_queue` more wait for a slot, each at
most `timeout_s`; one beyond that, or one that waited too long, is refused (Busy: 503 with Retry-After). A slot is
released exactly once, whichever way its request ends (finished, error, client gone, cancelled by the drain)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from fastapi.responses import StreamingResponse


class Busy(Exception):
    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason  # "queue_full" or "queue_timeout" (the metrics' label)


@dataclass
class Admission:
    slots: int
    max_queue: int
    timeout_s: float
    active: int = 0
    waiting: int = 0
    rejected: int = 0
    _sem: asyncio.Semaphore | None = field(default=None, repr=False)

    async def acquire(self) -> None:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.slots)
        if self.active >= self.slots and self.waiting >= self.max_queue:
            self.rejected += 1
            raise Busy(f"the queue is full ({self.max_queue} requests waiting for {self.slots} slots)", "queue_full")
        self.waiting += 1
        try:
            await asyncio.wait_for(self._sem.acquire(), self.timeout_s)
        except TimeoutError:  # asyncio.wait_for's timeout (asyncio.TimeoutError is TimeoutError from Python 3.11)
            self.rejected += 1
            raise Busy(f"no slot within {self.timeout_s:g} s ({self.slots} slots busy)", "queue_timeout") from None
        finally:
            self.waiting -= 1
        self.active += 1

    def release(self) -> None:
        assert self._sem is not None  # made by the acquire() this release pairs with
        self.active -= 1
        self._sem.release()


class Slot:
    """One admitted sequence's slot, released exactly once whichever way the request ends."""

    def __init__(self, adm: Admission) -> None:
        self._adm, self._held = adm, True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._adm.release()


class SlotStream(StreamingResponse):
    """A stream whose slot is released when the response ends, even if its body generator never started (a client
    gone before the first byte: an unstarted generator's `finally` never runs)."""

    def __init__(self, body, slot: Slot) -> None:
        super().__init__(body, media_type="text/event-stream")
        self._slot = slot

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._slot.release()

"""What a unit is, as a stage declares it and as its function sees it: Unit, UnitContext, the names of the files
the runner adds to a unit's folder, and the tests' fault injection. Plain data: the runner (pipeline/app/runner.py)
runs units, the stages (pipeline/stages/) build them.
"""
from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
METRICS = "metrics.json"  # an output like any other, so downstream hashes see changed figures
FAULT_ENV = "COMPRESS_FAULT"  # "<unit key>:<point>", e.g. "quantize/w4:mid" — the process SIGKILLs itself there
log = logging.getLogger("compress")


@dataclass
class Unit:
    key: str  # "load", "quantize/w4g64", "validate/baseline/quality": pipeline/base/stage_keys.py is the grammar
    config: Any  # JSON-able: everything from the recipe this unit depends on
    fn: Callable[[UnitContext], dict]  # writes outputs into ctx.out, returns metrics
    deps: list[str] = field(default_factory=list)
    always: bool = False  # never skipped (cheap units whose output is the report itself)
    # entry modules (and data files) under pipeline/ that compute this unit's outputs; what they import is
    # found by pipeline.base.codehash, so the list names where the code starts, not every file it uses
    code: tuple[str, ...] = ()


@dataclass
class UnitContext:
    key: str
    out: Path  # temporary output folder, renamed into place on success
    work: Path  # persistent scratch for this unit (checkpoints that survive a kill)
    run_dir: Path
    seed: int
    device: str
    manifests: dict[str, dict]  # upstream manifests by key

    def dep(self, key: str) -> Path:
        return self.run_dir / key

    def fault(self, point: str) -> None:
        fault_point(self.key, point)


def fault_point(key: str, point: str) -> None:
    """Tests' fault injection: COMPRESS_FAULT="<key>:<point>" SIGKILLs the process there;
    "<key>:<point>:pause" holds it there (lock held, stage not started) until a signal ends it."""
    wanted = os.environ.get(FAULT_ENV, "")
    if wanted == f"{key}:{point}":
        log.warning("fault injection: killing the process at %s:%s", key, point)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)
    if wanted == f"{key}:{point}:pause":
        log.warning("fault injection: pausing at %s:%s", key, point)
        while True:
            time.sleep(0.1)

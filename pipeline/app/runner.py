"""Stage order, content-hash manifests, resume, atomic outputs, locks, report.json.

A run is a list of Units (one per stage, or per variant for per-variant stages).
Each unit writes into a temporary folder; the runner adds manifest.json (the hash of
everything the unit depends on + the sha256 of every output file) and renames the folder
into place. A rerun skips a unit whose inputs hash matches and whose outputs verify.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from pipeline.base.codehash import LOADED, code_hash  # a unit's code: the files its entry modules import, as loaded
from pipeline.base.errors import CompressError, LockedError, StageError
from pipeline.base.fileio import sha256_file
from pipeline.base.memory import PeakMemory, settle_heap
from pipeline.base.unit import MANIFEST, METRICS, Unit, UnitContext, fault_point
from pipeline.results import merge, schema

log = logging.getLogger("compress")


def canonical_hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def hash_outputs(folder: Path) -> dict[str, dict]:
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            out[p.relative_to(folder).as_posix()] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    return out


def read_manifest(folder: Path) -> dict | None:
    try:
        return json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def verify_outputs(folder: Path, manifest: dict) -> str | None:
    """None if every recorded output exists with its sha256, else what is wrong."""
    for rel, meta in manifest.get("outputs", {}).items():
        p = folder / rel
        if not p.is_file():
            return f"{rel} is missing"
        if p.stat().st_size != meta["bytes"] or sha256_file(p) != meta["sha256"]:
            return f"{rel} does not match its recorded sha256"
    return None


class RunLock:
    """An OS lock on <run>/.lock: released by the kernel when the process dies, so never stale."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / ".lock"
        self.fd: int | None = None

    def __enter__(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise LockedError(f"run folder {self.path.parent} is in use by another compress process "
                              f"(pid {holder}); wait for it to finish or choose another [run].name") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self.fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)


class Runner:
    """Runs units and records each one in the report (through pipeline.results, its only writer)."""

    def __init__(self, run_dir: Path, seed: int, device: str, versions: dict, report=None,
                 run_id: str | None = None, identity_versions: dict | None = None) -> None:
        self.run_dir, self.seed, self.device, self.versions = run_dir, seed, device, versions
        # what a unit's inputs hash counts (pipeline.plan.identity_versions); `versions` is what the report records
        self.identity = versions if identity_versions is None else identity_versions
        self.run_id = run_id or schema.new_run_id()
        self.report = report or schema.new_report(run_id=self.run_id, name=Path(run_dir).name, recipe="",
                                                  device=device, seed=seed, versions=versions)
        self.manifests: dict[str, dict] = {}
        self.failed: dict[str, str] = {}  # unit key -> its error line (failed or blocked units)
        self.code = LOADED  # the package's files as this process loaded them: what a unit's identity hashes

    def run_or_record(self, unit: Unit) -> dict | None:
        """run_unit, except that a unit failure (StageError: the unit raised) is recorded in the report and the run
        goes on with the units that do not depend on it; a unit whose upstream failed is recorded as blocked. One
        variant's failure does not hide the others' figures; `raise_failures` ends the run with exit 4 after them.
        Interrupts, locks and recipe errors still stop the run at once."""
        upstream = next((d for d in unit.deps if d in self.failed), None)
        if upstream is not None:
            self._record_failure(unit, "blocked", f"not run: upstream unit {upstream} failed")
            return None
        try:
            return self.run_unit(unit)
        except StageError as e:
            log.error("[%s] failed: %s (the run goes on with the units that do not depend on it)", unit.key, e)
            self._record_failure(unit, "failed", str(e))
            return None

    def raise_failures(self) -> None:
        """The run's exit 4 when any unit failed, naming each one that failed (not those it blocked)."""
        failed = {k: self.report.stages[k].error for k in self.failed if self.report.stages[k].status == "failed"}
        if failed:
            lines = "; ".join(f"{k}: {e}" for k, e in failed.items())
            blocked = len(self.failed) - len(failed)
            raise StageError(f"{len(failed)} unit(s) failed ({blocked} more not run because of them): {lines}")

    def _record_failure(self, unit: Unit, status: str, error: str) -> None:
        self.failed[unit.key] = error
        merge.record_failure(self.report, unit.key, status, error)
        schema.save(self.report, self.run_dir)

    def inputs_hash(self, unit: Unit) -> str:
        missing = [d for d in unit.deps if d not in self.manifests]
        if missing:
            raise StageError(f"{unit.key}: upstream unit(s) {missing} did not run")
        deps = {d: self.manifests[d]["outputs_hash"] for d in unit.deps}
        code = code_hash(unit.code, self.code.root, self.code)
        return canonical_hash({"key": unit.key, "config": unit.config, "deps": deps, "code": code,
                               "versions": self.identity, "seed": self.seed, "device": self.device})

    def run_unit(self, unit: Unit) -> dict:
        final = self.run_dir / unit.key
        h = self.inputs_hash(unit)
        old = read_manifest(final)
        if old and old.get("inputs_hash") == h and not unit.always:
            problem = verify_outputs(final, old)
            if problem is None:
                log.info("[%s] up to date, skipped (inputs unchanged, outputs verified)", unit.key)
                self._record(unit, old, skipped=True)
                return old
            log.info("[%s] rerunning: %s", unit.key, problem)
        elif old:
            log.info("[%s] rerunning: %s", unit.key, "always reruns" if unit.always else "inputs changed")
        return self._execute(unit, final, h)

    def _execute(self, unit: Unit, final: Path, h: str) -> dict:
        tmp = final.with_name(final.name + ".tmp")
        for stale in (tmp, final.with_name(final.name + ".old")):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)
        work = self.run_dir / ".work" / unit.key / h[:16]
        work.mkdir(parents=True, exist_ok=True)
        ctx = UnitContext(unit.key, tmp, work, self.run_dir, self.seed, self.device, self.manifests)
        log.info("[%s] running -> %s", unit.key, final)
        fault_point(unit.key, "start")
        settle_heap()
        t0 = time.perf_counter()
        try:
            with PeakMemory() as mem:
                metrics = unit.fn(ctx) or {}
        except CompressError:
            raise
        except Exception as e:
            raise StageError(f"stage {unit.key} failed: {type(e).__name__}: {e}") from e
        fault_point(unit.key, "before_commit")
        edited = self.code.changed(unit.code)
        if edited:  # its identity is the loaded code; workers started from the disk would have run the edited one
            raise StageError(f"stage {unit.key}: {', '.join(edited)} changed on disk during the run (this process "
                             "runs the code it loaded when the run started): its outputs are not recorded; run again")
        (tmp / METRICS).write_text(json.dumps(metrics, indent=2, default=str))
        outputs = hash_outputs(tmp)
        manifest = {"key": unit.key, "run_id": self.run_id, "inputs_hash": h, "config": unit.config, "deps": unit.deps,
                    "versions": self.versions, "seed": self.seed, "device": self.device,
                    "time_s": round(time.perf_counter() - t0, 3),
                    # a unit that measures in a fresh worker process reports that process's peak
                    "peak_rss_bytes": max(mem.peak_bytes, int(metrics.get("worker_peak_rss_bytes") or 0)),
                    "peak_rss_above_start_bytes": mem.above_start_bytes,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "outputs": outputs, "outputs_hash": canonical_hash(outputs), "metrics": metrics}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str))
        if final.exists():
            os.replace(final, final.with_name(final.name + ".old"))
        os.replace(tmp, final)
        shutil.rmtree(final.with_name(final.name + ".old"), ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
        log.info("[%s] done in %.1f s", unit.key, manifest["time_s"])
        self._record(unit, manifest, skipped=False)
        return manifest

    def _record(self, unit: Unit, manifest: dict, skipped: bool) -> None:
        self.manifests[unit.key] = manifest
        merge.record(self.report, unit.key, manifest, skipped)
        schema.save(self.report, self.run_dir)

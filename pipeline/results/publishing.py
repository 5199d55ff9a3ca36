"""The publish rule, stated once. An export folder may be pushed only if
  (a) the report that lists it is final for the run that produced it: status complete (or gates_failed with
      partial), gates evaluated, and the report's run id is the one in recipe.lock.toml;
  (b) its files hash to its manifest, whose outputs_hash is the one this report recorded (publish/plan.py
      re-hashes every file);
  (c) no gate of its model blocks (warn-only gates never do: `gates.blocks`);
  (d) the report lists it among the run's exports (folders the report does not list are never pushed).
`compress push` and the run's own [publish] step both plan through `eligible`.
"""
from __future__ import annotations

import tomllib
from pathlib import Path

from pipeline.base.errors import PublishError
from pipeline.results.gates import blocking_by_model, failed_gates
from pipeline.results.schema import FINAL, ExportEntry, Gate, PublishSection, Report

LOCK = "recipe.lock.toml"


class PublishRefused(PublishError):
    """The publish rule forbids publishing; `section` is the report entry saying why."""

    def __init__(self, message: str, failed: list[Gate] | None = None):
        super().__init__(message)
        self.section = PublishSection(status="refused", reason=message,
                                      failed_gates=[g.model_dump() for g in failed or []])


def describe(g: Gate) -> str:
    return f"{g.model}/{g.gate} (value {g.value}, bound {g.bound})"


def lock_run_id(run_dir: Path) -> str | None:
    path = Path(run_dir) / LOCK
    try:
        return (tomllib.loads(path.read_text(encoding="utf-8")).get("lock") or {}).get("run_id")
    except (OSError, tomllib.TOMLDecodeError):
        return None


def check_final(run_dir: Path, report: Report) -> None:
    """(a): the report is the final word of the run recorded in the lock."""
    run = report.run
    if run.status not in FINAL or not run.gates_evaluated:
        why = {"running": "still running, or killed before it finished",
               "interrupted": "interrupted",
               "failed": f"failed: {run.error or 'see report.md'}"}.get(run.status, run.status)
        raise PublishRefused(f"refusing to publish: run {run.id or '?'} in {run_dir} did not finish "
                             f"(status {run.status}: {why}); rerun `compress run` until it completes. "
                             "Nothing was pushed")
    lock_id = lock_run_id(run_dir)
    if not run.id or lock_id != run.id:
        raise PublishRefused(f"refusing to publish: report.json (run {run.id}) and {LOCK} (run {lock_id}) in "
                             f"{run_dir} do not come from the same run; rerun `compress run`. Nothing was pushed")


def eligible(run_dir: Path, report: Report, partial: bool) -> tuple[dict[str, ExportEntry], dict[str, str]]:
    """({name: export} that may be pushed, {name: why not} for listed exports that may not). Raises
    PublishRefused when nothing may be pushed."""
    check_final(run_dir, report)
    if not report.exports:
        raise PublishRefused(f"refusing to publish: the report of {run_dir} lists no exports")
    failed = failed_gates(report)
    if failed and not partial:
        raise PublishRefused(
            f"refusing to publish: {len(failed)} gate(s) failed: " + "; ".join(describe(g) for g in failed)
            + ". Nothing was pushed; use --partial (or [publish].partial = true) to push only the models whose "
              "gates passed", failed)
    blocked = blocking_by_model(report)
    allowed, skipped = {}, {}
    for name, export in report.exports.items():
        if name in blocked:
            skipped[name] = "gate failed: " + "; ".join(describe(g) for g in blocked[name])
        else:
            allowed[name] = export
    if not allowed:
        raise PublishRefused("refusing to publish: no export passed its gates ("
                             + "; ".join(f"{k}: {v}" for k, v in skipped.items()) + ")", failed)
    return allowed, skipped

"""`compress run`: lock the run folder, write the reproducibility lock, run the units in order,
apply the gates, render the report, export, publish. Returns the process exit code."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from pipeline.errors import CompressError, GateFailure
from pipeline.plan import Plan, versions
from pipeline.runner import Runner, RunLock, Unit, atomic_write_text

log = logging.getLogger("compress")
SCHEMA_VERSION = 1


def build_units(recipe) -> tuple[list[Unit], list[Unit]]:
    """(units up to validate, export units). Gates are applied between the two."""
    from pipeline.stages import calibrate, draft, export, load, quantize, validate

    from pipeline.plan import stage_names

    units = [load.unit(recipe)]
    if "calibrate" in stage_names(recipe):
        units.append(calibrate.unit(recipe))
    units += quantize.units(recipe)
    if recipe.draft is not None:
        units.append(draft.unit(recipe))
    val = validate.units(recipe)
    return units + val, export.units(recipe, [u.key for u in val])


def lock_text(recipe, vers: dict, runner_versions: dict) -> str:
    import tomli_w

    from pipeline import data
    from pipeline.sources import parse
    from pipeline.stages.export import _drop_none

    src = parse(recipe.model.source, recipe.model.gguf_file)
    files = {}
    for ds in sorted({recipe.calibration.dataset, recipe.validate_.perplexity.dataset}):  # a set: sort for a stable lock
        ref = data.resolve(ds)
        files[ds] = data.fingerprint(ref) or "hf-cache"
    from pipeline.data import sha256_file

    lock = {"lock": {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "versions": vers,
                     "model_file": str(src.path), "model_sha256": sha256_file(src.path) if src.path.is_file() else "",
                     "data_sha256": files, "device": runner_versions.get("device", "")},
            "recipe": _drop_none(recipe.dump())}
    return "# Resolved recipe + versions + hashes: rerun with `compress run recipe.lock.toml` is not needed;\n" \
           "# this file records exactly what produced the run folder.\n" + tomli_w.dumps(lock)


def new_report(recipe, recipe_path: Path, device: str, vers: dict) -> dict:
    return {"schema_version": SCHEMA_VERSION,
            "run": {"name": recipe.run.name, "recipe": str(recipe_path), "status": "running", "exit_code": None,
                    "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "finished": None, "device": device,
                    "seed": recipe.run.seed, "versions": vers},
            "model": None, "baseline": None, "calibration": None, "variants": {}, "draft": None, "gates": [],
            "exports": {}, "publish": None, "stages": {}}


def execute(recipe, recipe_path: Path, plan: Plan) -> int:
    run_dir = Path(recipe.run.output_dir) / recipe.run.name
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        from pipeline.errors import StageError

        raise StageError(f"cannot write to the run folder {run_dir}: {e.strerror}") from None
    with RunLock(run_dir):
        return _execute_locked(recipe, recipe_path, plan, run_dir)


def _execute_locked(recipe, recipe_path: Path, plan: Plan, run_dir: Path) -> int:
    from pipeline.env import tame

    tame()
    import torch

    from pipeline.models import resolve_device

    if recipe.run.threads:
        torch.set_num_threads(recipe.run.threads)
    device = resolve_device(recipe.run.device)
    torch.manual_seed(recipe.run.seed)
    vers = versions()
    atomic_write_text(run_dir / "recipe.lock.toml", lock_text(recipe, vers, {"device": device}))
    report = new_report(recipe, recipe_path, device, vers)
    runner = Runner(run_dir, recipe.run.seed, device, vers, report)
    log.info("run %s -> %s (%s)", recipe.run.name, run_dir, device)
    try:
        head, exports = build_units(recipe)
        total = len(head) + len(exports)
        for i, unit in enumerate(head, 1):
            log.info("stage %d/%d: %s", i, total, unit.key)
            runner.run_unit(unit)
        failed = apply_gates(report, recipe)
        runner.save_report()
        for i, unit in enumerate(exports, len(head) + 1):
            log.info("stage %d/%d: %s", i, total, unit.key)
            runner.run_unit(unit)
        if recipe.publish is not None:
            publish(run_dir, recipe, report, gates_failed=bool(failed))
        code = GateFailure.exit_code if failed else 0
        finish(runner, report, "gates_failed" if failed else "complete", code)
        return code
    except CompressError as e:
        report["run"]["error"] = str(e)
        finish(runner, report, "failed", e.exit_code)
        raise
    except KeyboardInterrupt:
        finish(runner, report, "interrupted", 130)
        raise


def apply_gates(report: dict, recipe) -> list[dict]:
    from pipeline.eval.gates import evaluate_gates, gates_table

    gates = evaluate_gates(report, recipe.validate_.gates)
    report["gates"] = gates
    if gates:
        log.info("gates:\n%s", gates_table(gates))
    return [g for g in gates if not g["passed"] and g.get("severity", "fail") == "fail"]


def publish(run_dir: Path, recipe, report: dict, gates_failed: bool) -> None:
    """Push the exports. A refusal because gates failed is recorded; the exit code stays the gates' (5)."""
    from pipeline.publish.hub import PublishRefused, publish_run

    try:
        report["publish"] = publish_run(run_dir, recipe.publish, log)
    except PublishRefused as e:
        report["publish"] = e.section
        if not gates_failed:
            raise
        log.warning("publish: %s", e)


def finish(runner: Runner, report: dict, status: str, code: int) -> None:
    report["run"].update(status=status, exit_code=code, finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    runner.save_report()
    try:
        from pipeline.eval.report import render_report

        render_report(runner.run_dir)
    except Exception as e:  # the report must never hide the run's own outcome
        log.warning("could not render report.md: %s: %s", type(e).__name__, e)
    log.info("report: %s", runner.run_dir / "report.md")


def summary_rows(report: dict) -> list[tuple[str, str, str, str]]:
    rows = []
    for key, s in report.get("stages", {}).items():
        rows.append((key, s["status"], f"{s['time_s']:.1f}", f"{s['peak_rss_bytes'] / 2**20:.0f}"))
    return rows


def load_report(run_dir: Path) -> dict:
    return json.loads((run_dir / "report.json").read_text())

"""The run after tame() (pipeline/app/execute.py locks the folder and calls it): the reproducibility lock, the units
in order (here, or as Ray tasks), the gates, the exports, publishing, the report. It imports torch, the stages
(transformers, ...), the renderers and the Hub client at its top: it is imported only after tame() has set the
environment they read on import."""
from __future__ import annotations

import logging
import shutil
import signal
from contextlib import contextmanager
from pathlib import Path

import tomli_w
import torch

from pipeline import data
from pipeline.app.runner import Runner
from pipeline.app.units import build_units
from pipeline.base.errors import CompressError, GateFailure, Interrupted, PublishError, StageError
from pipeline.base.fileio import atomic_write_text, drop_none, sha256_file
from pipeline.base.unit import Unit
from pipeline.eval.tasks_config import data_lock
from pipeline.model.models import resolve_device
from pipeline.model.sources import parse
from pipeline.plan import Plan, identity_versions, versions
from pipeline.publish.hub import publish_run
from pipeline.results import schema
from pipeline.results.gates import evaluate_gates, failed_gates, gates_table
from pipeline.results.publishing import PublishRefused
from pipeline.results.render import render_report
from pipeline.stages.kinds import Export

log = logging.getLogger("compress")


def lock_text(recipe, vers: dict, device: str, run_id: str) -> str:
    src = parse(recipe.model.source, recipe.model.gguf_file)
    files = {}
    # a set: sort for a stable lock
    for ds in sorted({recipe.calibration.dataset, recipe.validate_.perplexity.dataset}):
        files[ds] = data.fingerprint(data.resolve(ds)) or "hf-cache"
    files.update(data_lock(recipe.validate_.tasks))  # [validate.tasks]: each data file read, by its pinned sha256
    lock = {"lock": {"run_id": run_id, "created": schema.now(), "versions": vers,
                     "model_file": str(src.path),
                     "model_sha256": sha256_file(src.path) if src.path is not None and src.path.is_file() else "",
                     "data_sha256": files, "device": device},
            "recipe": drop_none(recipe.dump())}
    return "# Resolved recipe + versions + hashes: rerun with `compress run recipe.lock.toml` is not needed;\n" \
           "# this file records exactly what produced the run folder.\n" + tomli_w.dumps(lock)


@contextmanager
def stop_signals():
    """SIGTERM (and SIGINT) raise Interrupted in the main thread, so the run can say so in its report."""
    def stop(signum, frame):
        raise Interrupted(signum)

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def execute_locked(recipe, recipe_path: Path, run_dir: Path, plan: Plan | None = None) -> int:
    """The run, its folder locked and tame() done (pipeline/app/execute.py execute)."""
    if recipe.run.threads:
        torch.set_num_threads(recipe.run.threads)
    device = run_device(recipe)
    torch.manual_seed(recipe.run.seed)
    vers, run_id = versions(), schema.new_run_id()
    report = schema.new_report(run_id=run_id, name=recipe.run.name, recipe=str(recipe_path), device=device,
                               seed=recipe.run.seed, versions=vers)
    if plan is not None:
        report.run.predicted_peak_bytes = dict(plan.memory)
        report.run.offloaded = sorted(k for k, v in plan.offload.items() if v)
        report.run.memory_limit_bytes = plan.memory_limit if recipe.run.max_memory_gb else None
    runner = Runner(run_dir, recipe.run.seed, device, vers, report, run_id, identity_versions(vers))
    with stop_signals():
        try:
            # the report goes first: from here on, nothing earlier runs' report said can be pushed
            schema.save(report, run_dir)
            atomic_write_text(run_dir / "recipe.lock.toml", lock_text(recipe, vers, device, run_id))
            log.info("run %s (%s) -> %s (%s)", recipe.run.name, run_id, run_dir, device)
            head, exports = build_units(recipe)
            remove_stale_exports(run_dir, [u.key for u in exports])
            total = len(head) + len(exports)
            with unit_executor(recipe, runner, run_dir, plan, head + exports) as run_units:
                run_units(head, 1, total)
                apply_gates(report, recipe, run_dir)
                run_units(exports, len(head) + 1, total)
            runner.raise_failures()  # exit 4 after every unit that could run has run and been reported

            code = GateFailure.exit_code if failed_gates(report) else 0
            finish(run_dir, report, "gates_failed" if code else "complete", code)
        except CompressError as e:
            _stopped(run_dir, report, "interrupted" if isinstance(e, Interrupted) else "failed", e.exit_code, str(e))
            raise
        except KeyboardInterrupt:
            _stopped(run_dir, report, "interrupted", 130, "interrupted (SIGINT)")
            raise Interrupted(signal.SIGINT) from None
        except OSError as e:  # writing a manifest, the report or the lock (disk full, permissions)
            err = StageError(f"could not write the run's results under {run_dir}: {e.strerror or e} "
                             f"({e.filename or 'no file name'})")
            _stopped(run_dir, report, "failed", err.exit_code, str(err))
            raise err from None
        except Exception as e:  # a bug (exit 1): the report still says the run failed, with the error line
            _stopped(run_dir, report, "failed", CompressError.exit_code, f"internal error: {type(e).__name__}: {e}")
            raise
    if recipe.publish is not None:
        code = publish_in_run(run_dir, recipe, report, code)
    return code


def run_device(recipe) -> str:
    """[run] device resolved where the units run: this machine, or the Ray cluster's nodes."""
    if recipe.run.executor == "ray":
        # late: Ray is the optional [ray] extra, loaded only for executor = "ray"
        from pipeline.app.ray_executor import alive_nodes, cluster_device, connect

        connect(recipe.run.ray_address)  # unreachable: exit 2 naming the address, before any work
        return cluster_device(recipe.run.device, alive_nodes(), recipe.run.ray_address)
    return resolve_device(recipe.run.device)


@contextmanager
def unit_executor(recipe, runner: Runner, run_dir: Path, plan: Plan | None, units: list[Unit]):
    """run_units(units, first_index, total): one after another here ("local"), or as Ray tasks ("ray")."""
    if recipe.run.executor == "ray":
        # late: Ray is the optional [ray] extra, loaded only for executor = "ray"
        from pipeline.app.ray_executor import RayExecutor

        ex = RayExecutor(recipe, runner, run_dir, plan)
        try:
            ex.start([u.key for u in units])
            yield lambda batch, first, total: ex.run(batch)
        finally:
            ex.close()
        return

    def local(batch: list[Unit], first: int, total: int) -> None:
        for i, unit in enumerate(batch, first):
            log.info("stage %d/%d: %s", i, total, unit.key)
            runner.run_or_record(unit)

    yield local


def remove_stale_exports(run_dir: Path, export_keys: list[str]) -> None:
    """Export folders of models no longer in the recipe are removed: no report of this run lists them, and
    nothing may ever push them."""
    root, keep = run_dir / Export.stage, {Export.name_of(k) for k in export_keys}
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        if folder.name not in keep:
            log.info("removing %s: not an export of this recipe", folder)
            shutil.rmtree(folder) if folder.is_dir() else folder.unlink()


def apply_gates(report: schema.Report, recipe, run_dir: Path) -> None:
    report.gates = evaluate_gates(report, recipe.validate_.gates)
    report.run.gates_evaluated = True
    schema.save(report, run_dir)
    if report.gates:
        log.info("gates:\n%s", gates_table(report.gates))


def publish_in_run(run_dir: Path, recipe, report: schema.Report, code: int) -> int:
    """The run's [publish] step, after the final report is on disk: the same rule as `compress push`. A
    refusal because gates failed keeps the gates' exit code (5); any other publish problem is exit 6. The
    run's own status stays what the stages and gates made it, so `compress push` can retry."""
    try:
        section = publish_run(run_dir, recipe.publish, log)
    except PublishRefused as e:
        section = e.section
        if code == 0:
            _record_publish(run_dir, report, section, PublishError.exit_code)
            raise
        log.warning("publish: %s", e)
    except PublishError as e:
        _record_publish(run_dir, report, schema.PublishSection(status="failed", reason=str(e)), e.exit_code)
        raise
    _record_publish(run_dir, report, section, code)
    return code


def _record_publish(run_dir: Path, report: schema.Report, section: schema.PublishSection, code: int) -> None:
    report.publish, report.run.exit_code = section, code
    schema.save(report, run_dir)
    _render(run_dir)


def finish(run_dir: Path, report: schema.Report, status: schema.RunStatus, code: int,
           error: str | None = None) -> None:
    report.run.status, report.run.exit_code, report.run.finished = status, code, schema.now()
    if error is not None:
        report.run.error = error
    schema.save(report, run_dir)
    _render(run_dir)


def _stopped(run_dir: Path, report: schema.Report, status: schema.RunStatus, code: int, error: str) -> None:
    """Record a run that did not finish; a second failure while writing that record is only logged."""
    try:
        finish(run_dir, report, status, code, error)
    except OSError as e:
        log.error("could not record status %r in %s: %s", status, run_dir / schema.REPORT, e.strerror or e)


def _render(run_dir: Path) -> None:
    try:
        render_report(run_dir)
    except Exception as e:  # the report must never hide the run's own outcome
        log.warning("could not render report.md: %s: %s", type(e).__name__, e)
    log.info("report: %s", run_dir / "report.md")

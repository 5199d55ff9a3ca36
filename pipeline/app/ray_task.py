"""What runs on a Ray node for pipeline/app/ray_executor.py: the node probe, and one attempt of one unit.

Admission. Before a node's first task the driver probes it (pipeline/app/ray_nodes.py: the run folder seen both
ways, the node's own library versions against the driver's) and writes <run>/.ray-probe/admitted-<node id> holding
the driver's session token. An attempt first compares its node's versions with the driver's (they are part of every
unit's identity, but the inputs hash is computed from the driver's: a node with another transformers would pass it),
then waits for its node's admission file (ADMIT_WAIT_S): without it (a node that joined after the driver last
looked, or one that cannot see the run folder) it raises NodeNotAdmitted; the driver probes the node and submits the
unit again.

Attempts. Ray runs a task lost with its worker or node again (MAX_RETRIES), and an attempt Ray gave up on may still
be running (a node cut off, not dead). So each attempt writes only its own folder,
<run>/.work/<key>/<hash16>-<attempt>/: ray-task.json (node, start time), out.tmp -> out (the unit's outputs and
manifest, by the runner's own tmp+rename) and scratch/ (the unit's ctx.work, seeded with a copy of the newest earlier
attempt's, so a retried draft resumes from its checkpoint). It is committed with one rename onto <run>/<key>: a
rename onto a folder that is not empty fails, so exactly one attempt commits; an attempt finding the unit committed
with its inputs hash discards its own folder and returns the committed manifest. The driver removes an outdated unit
folder before it submits the unit, so a committed folder with the hash is always one of the unit's own attempts.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path

import ray

from pipeline.app.runner import Runner, read_manifest
from pipeline.base.env import tame
from pipeline.base.errors import StageError
from pipeline.base.stage_keys import UnitKey
from pipeline.plan import versions
from pipeline.recipe import Recipe

log = logging.getLogger("compress")

# tests: a node whose environment sets this sees the filesystem under another root (a node without the run folder)
PROBE_ROOT_ENV = "COMPRESS_RAY_PROBE_ROOT"
# tests: a node whose environment sets this JSON ({"transformers": "0.0"}) reports those as its library versions
VERSIONS_ENV = "COMPRESS_RAY_NODE_VERSIONS"
PROBE_DIR = ".ray-probe"
ATTEMPT_FILE = "ray-task.json"
ADMIT_WAIT_S = float(os.environ.get("COMPRESS_RAY_ADMIT_WAIT_S", "10"))  # an attempt waits this long for admission


class NodeNotAdmitted(StageError):
    """An attempt started on a node the driver has not probed yet; the driver probes it and submits again."""


def this_node() -> tuple[str, str]:
    """(node id, "<id12> (<ip>)") of the node this process runs on."""
    node_id = ray.get_runtime_context().get_node_id()
    return node_id, f"{node_id[:12]} ({ray.util.get_node_ip_address()})"


def node_versions() -> dict[str, str]:
    """The library versions installed where this runs (pipeline.plan.versions: what goes into every identity)."""
    return {**versions(), **json.loads(os.environ.get(VERSIONS_ENV) or "{}")}


def version_mismatch(driver: dict, node: dict, node_name: str) -> str | None:
    """None when the node's versions are the driver's, else one line naming each difference, both sides."""
    diffs = [f"{k} {driver.get(k, 'not recorded')} on the driver, {node.get(k, 'not recorded')} on the node"
             for k in sorted(set(driver) | set(node)) if driver.get(k) != node.get(k)]
    if not diffs:
        return None
    return (f"node {node_name} has other library versions than the driver ({'; '.join(diffs)}): they are part of "
            "every unit's identity, install the same versions on every node")


def probe_task(run_dir: str, token: str) -> tuple[str, str, str | None, dict]:
    """On one node: read the driver's probe file, write this node's own; (node id, node, problem or None, versions)."""
    node_id, node = this_node()
    root = os.environ.get(PROBE_ROOT_ENV, "")
    probe = Path(root + run_dir if root else run_dir) / PROBE_DIR
    problem = None
    try:
        seen = (probe / f"driver-{token}").read_text()
        if seen != token:
            problem = f"{probe / f'driver-{token}'} holds other content"
        else:
            (probe / f"node-{node_id}-{token}").write_text(token)
    except OSError as e:
        problem = f"{e.filename or probe}: {e.strerror or e}"
    return node_id, node, problem, node_versions()


def admitted_file(run_dir: Path, node_id: str) -> Path:
    return Path(run_dir) / PROBE_DIR / f"admitted-{node_id}"


def check_node(run_dir: Path, node_id: str, node: str, driver_versions: dict, token: str) -> None:
    """Before an attempt does anything: this node's own versions are the driver's, and the driver admitted it.
    Either refusal is NodeNotAdmitted: the driver probes the node (leaving it out when it joined late) and submits
    the unit again, away from it."""
    problem = version_mismatch(driver_versions, node_versions(), node)
    if problem:
        raise NodeNotAdmitted(problem)
    deadline = time.monotonic() + ADMIT_WAIT_S  # the driver looks for new nodes every few seconds
    while True:
        try:
            if admitted_file(run_dir, node_id).read_text() == token:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise NodeNotAdmitted(f"node {node} has not been probed by this run's driver")
        time.sleep(0.5)


# ---------------------------------------------------------------- one attempt of one unit


def attempt_dir(run_dir: Path, key: str, h: str, attempt: str) -> Path:
    return Path(run_dir) / ".work" / key / f"{h[:16]}-{attempt}"


def attempts_of(run_dir: Path, key: str, h: str) -> list[dict]:
    """Every attempt of a unit at this inputs hash that left its record, oldest first."""
    out = []
    for f in (Path(run_dir) / ".work" / key).glob(f"{h[:16]}-*/{ATTEMPT_FILE}"):
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue  # being written, or removed by the attempt that committed
    return sorted(out, key=lambda r: r.get("task_start", 0))


def seed_scratch(folder: Path, run_dir: Path, key: str, h: str, attempt: str) -> None:
    """folder/scratch, a copy of the newest earlier attempt's (checkpoints survive a lost attempt); empty if none.
    Unit code replaces its scratch files atomically (fileio.atomic_path), so a copy never holds half a file; its
    temporary files are left out, and a copy that fails (an attempt still writing) is dropped."""
    scratch = folder / "scratch"
    earlier = [r for r in attempts_of(run_dir, key, h) if r.get("attempt") != attempt]
    src = attempt_dir(run_dir, key, h, earlier[-1]["attempt"]) / "scratch" if earlier else None
    if src is not None and src.is_dir():
        try:
            shutil.copytree(src, scratch, ignore=shutil.ignore_patterns(".*.tmp-*"))
            log.info("[%s] scratch copied from attempt %s", key, earlier[-1]["attempt"])
            return
        except (OSError, shutil.Error) as e:
            log.info("[%s] scratch of attempt %s not copied (%s): starting empty", key, earlier[-1]["attempt"], e)
            shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(exist_ok=True)


def session_file(run_dir: Path) -> Path:
    """Holds the token of the driver now running the run (written when it starts, removed when it ends)."""
    return Path(run_dir) / PROBE_DIR / "session"


def is_current(run_dir: Path, token: str) -> bool:
    """Whether the driver that submitted an attempt (its token) is the one now running the run."""
    try:
        return session_file(run_dir).read_text() == token
    except OSError:
        return False


def commit_attempt(private: Path, final: Path, h: str, current=lambda: True) -> tuple[dict, bool]:
    """Make one attempt's complete folder the unit's folder; (the manifest now there, whether it is this attempt's).
    Exactly one attempt commits: the rename fails once `final` holds a unit. A committed unit with this inputs hash
    wins over this attempt's folder, which is discarded; a folder with another hash is stale and moved away, but only
    by an attempt of the driver now running (`current()`): a late attempt of a superseded run (another recipe, another
    hash) never replaces, nor commits: its folder is discarded and StageError says so."""
    final.parent.mkdir(parents=True, exist_ok=True)
    if not current():
        there = read_manifest(final)
        shutil.rmtree(private, ignore_errors=True)
        if there is not None and there.get("inputs_hash") == h:
            return there, False
        raise StageError(f"{final}: this attempt (inputs hash {h[:16]}) belongs to a run that is no longer the one "
                         "running this folder: its outputs are discarded, the unit there is left as it is")
    for _ in range(3):
        try:
            os.rename(private, final)
            return read_manifest(final) or {}, True
        except FileNotFoundError:  # our folder is gone: the attempt that committed removed it after committing
            pass
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                raise
        there = read_manifest(final)
        if there is not None and there.get("inputs_hash") == h:
            shutil.rmtree(private, ignore_errors=True)
            return there, False
        if not private.is_dir():
            break
        aside = final.with_name(f"{final.name}.stale-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(final, aside)
        except FileNotFoundError:
            continue
        shutil.rmtree(aside, ignore_errors=True)
    raise StageError(f"{final}: neither this attempt's outputs nor another attempt's with inputs hash {h[:16]} "
                     "could be committed there")


def unit_task(recipe_data: dict, key: str, h: str, run: dict, manifests: dict) -> dict:
    """On a worker: one attempt. Rebuild the unit from the recipe, run it into the attempt's folder, commit it."""
    task_start = time.time()
    node_id, node = this_node()
    run_dir = Path(run["run_dir"])
    check_node(run_dir, node_id, node, run["versions"], run["token"])
    attempt = uuid.uuid4().hex[:12]
    folder = attempt_dir(run_dir, key, h, attempt)
    folder.mkdir(parents=True)
    (folder / ATTEMPT_FILE).write_text(json.dumps({"attempt": attempt, "node": node, "task_start": task_start}))
    _task_logging()
    runner, unit = _rebuild(recipe_data, key, h, run, manifests, node)
    seed_scratch(folder, run_dir, key, h, attempt)
    unit_start = time.time()
    manifest, committed = runner.run_attempt(unit, h, folder)
    attempts = attempts_of(run_dir, key, h)
    for other in attempts:  # this unit is committed: no attempt's folder is needed any more
        shutil.rmtree(attempt_dir(run_dir, key, h, other["attempt"]), ignore_errors=True)
    shutil.rmtree(folder, ignore_errors=True)
    return {"manifest": manifest, "node": node, "task_start": task_start, "unit_start": unit_start,
            "unit_end": time.time(), "attempt": attempt, "committed": committed, "attempts": attempts}


def _task_logging() -> None:
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False  # Ray's root handler would print every line a second time


def _rebuild(recipe_data: dict, key: str, h: str, run: dict, manifests: dict, node: str):
    """(a TaskRunner, the unit) rebuilt from the recipe; refused when this node computes another inputs hash."""
    tame()
    # late: after tame(), which sets the environment torch, transformers and GPTQModel read on import
    import torch

    from pipeline.app.units import build_units

    if run["threads"]:
        torch.set_num_threads(run["threads"])
    torch.manual_seed(run["seed"])

    UnitKey.parse(key)  # a key outside the grammar: UnitKeyError naming what is wrong
    head, exports = build_units(Recipe.model_validate(recipe_data))
    units = {u.key: u for u in head + exports}
    if key not in units:
        raise StageError(f"{key}: node {node} builds no such unit from the recipe (its units: {sorted(units)})")
    unit = units[key]
    runner = task_runner_cls()(Path(run["run_dir"]), run["seed"], run["device"], run["versions"], None, run["run_id"],
                               run.get("identity_versions"))
    runner.manifests = dict(manifests)
    runner.token = run["token"]
    if runner.inputs_hash(unit) != h:
        raise StageError(f"{key}: node {node} computes another inputs hash than the driver: is the same compress "
                         "(code and library versions) installed on every node?")
    return runner, unit


def task_runner_cls():
    class TaskRunner(Runner):
        token: str | None = None  # the submitting driver's session (run["token"]); None: not checked
        def _record(self, unit, manifest, skipped):  # the driver records; a task never writes report.json
            self.manifests[unit.key] = manifest

        def run_attempt(self, unit, h: str, folder: Path) -> tuple[dict, bool]:
            """The runner's own execution into folder/out (its tmp+rename, its manifest), with ctx.work pointed at
            folder/scratch; then the one commit onto the unit's folder."""
            scratch = folder / "scratch"
            private = dataclasses.replace(unit, fn=lambda ctx: unit.fn(dataclasses.replace(ctx, work=scratch)))
            self._execute(private, folder / "out", h)
            token = self.token
            manifest, committed = commit_attempt(folder / "out", self.run_dir / unit.key, h,
                                                 lambda: token is None or is_current(self.run_dir, token))
            if not committed:
                log.info("[%s] already committed by another attempt: this attempt's outputs discarded", unit.key)
            return manifest, committed

    return TaskRunner

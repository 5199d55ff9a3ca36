"""`[run] executor = "ray"`: every unit whose upstream units are done runs as a Ray task, in parallel where the
unit graph (Unit.deps) allows.

The run folder stays the single source of truth. The driver (this process) holds the run lock and owns
report.json; a task rebuilds its unit from the recipe (build_units: unit functions are closures over the recipe,
so the recipe's dict and the unit key travel, never a closure), runs it into its attempt's own folder with the
runner's tmp+rename, commits it onto the unit's folder with one rename (exactly one attempt commits) and returns the
manifest now there; the driver merges it into the report exactly as the local executor does. Resume and the publish
rule are therefore unchanged. What runs on a node: pipeline/app/ray_task.py.

Resources per task, and which units get a node to themselves: pipeline/app/ray_nodes.py (options_for).

Before a node's first task, at the start or whenever it joined, the driver probes it: it reads a probe file the
driver wrote in the run folder and writes one back, and reports its own library versions, which must be the
driver's; a node that fails at the start is refused by name (exit 4), one that joins later and fails is left out
with a warning naming it (units are submitted away from it: Ray's node-id label). A task lost with its worker or
node is retried by Ray (MAX_RETRIES); past that the run fails with exit 4 naming the node. A unit commits only
through the rename, so a lost task never leaves a unit that looks complete.

Nothing here imports ray at module import: `compress check` only asks importlib whether it is installed.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path

import ray
from ray import exceptions as rex

from pipeline.app.ray_nodes import (  # noqa: F401 (API)
    NODE_RESOURCE,
    Admission,
    alive_nodes,
    cluster_device,
    connect,
    exclusive,
    node_name,
    options_for,
    probe_nodes,
    refuse_unfit,
)
from pipeline.app.ray_task import NodeNotAdmitted, attempts_of, unit_task
from pipeline.app.runner import read_manifest, verify_outputs
from pipeline.base.errors import CompressError, StageError
from pipeline.base.fileio import atomic_write_text
from pipeline.base.unit import Unit, fault_point
from pipeline.results import schema

log = logging.getLogger("compress")

EXTRA = "pip install -e '.[ray]'"
MAX_RETRIES = int(os.environ.get("COMPRESS_RAY_MAX_RETRIES", "2"))
RESUBMITS = 3  # a unit whose attempt found its node not admitted yet is submitted again at most this often
TASKS_FILE = "ray_tasks.json"  # the driver's record of each task: node, submit/start times (benchmarks read it)
PROGRESS_S = 2  # how often the driver looks at queued tasks and new nodes (a line only when something changed)


def clear_unit_folder(final: Path) -> None:
    """A unit's outdated folder is removed before the unit is submitted: from then on, a folder there carrying the
    unit's inputs hash was committed by one of its attempts (pipeline/app/ray_task.py commit_attempt)."""
    if final.exists():
        aside = final.with_name(f"{final.name}.stale-{uuid.uuid4().hex[:8]}")
        os.rename(final, aside)
        shutil.rmtree(aside, ignore_errors=True)


class RayExecutor:
    """Runs lists of units on the cluster; the Runner given records every result into the report."""

    def __init__(self, recipe, runner, run_dir: Path, plan) -> None:
        self.recipe, self.runner, self.run_dir, self.plan = recipe, runner, Path(run_dir), plan
        self.recipe_data = recipe.dump()
        self.tasks: dict[str, dict] = {}
        # looked up at each call, so tests can replace this module's alive_nodes / probe_nodes
        self.admission = Admission(self.run_dir, runner.versions, lambda: alive_nodes(),
                                   lambda *a: probe_nodes(*a))

    def start(self, all_keys: list[str]) -> None:
        connect(self.recipe.run.ray_address)
        nodes = alive_nodes()
        refuse_unfit(all_keys, self.plan, self.runner.device, self.recipe.run.threads, nodes)
        names = self.admission.admit_new(nodes)
        log.info("ray: %d node(s): %s; run folder %s seen by all, library versions the driver's", len(names),
                 ", ".join(names), self.run_dir)

    def close(self) -> None:
        self.admission.close()
        if ray.is_initialized():
            ray.shutdown()

    def _admit(self) -> None:
        """Nodes that joined since the last look are probed before any task can start on them."""
        for name in self.admission.admit_new():
            log.info("ray: node %s joined: run folder seen, library versions the driver's", name)

    def _submit(self, unit, h: str):
        r = self.recipe.run
        opts = {**options_for(unit.key, self.plan, self.runner.device, r.threads), "max_retries": MAX_RETRIES,
                **self.admission.selector()}  # never on a node left out
        run = {"run_dir": str(self.run_dir.resolve()), "seed": self.runner.seed, "device": self.runner.device,
               "versions": self.runner.versions, "identity_versions": self.runner.identity,
               "run_id": self.runner.run_id, "threads": r.threads,
               "token": self.admission.token}
        manifests = {k: v for k, v in self.runner.manifests.items()}
        clear_unit_folder(self.run_dir / unit.key)
        self.tasks.setdefault(unit.key, {"submits": 0})
        self.tasks[unit.key].update(submitted=time.time(), hash=h, submits=self.tasks[unit.key]["submits"] + 1)
        return ray.remote(unit_task).options(**opts).remote(self.recipe_data, unit.key, h, run, manifests)

    def _node_of(self, key: str) -> str | None:
        """The node the newest attempt of a submitted task started on (its ray-task.json in the run folder), None
        while it is queued."""
        attempts = attempts_of(self.run_dir, key, self.tasks[key]["hash"]) if key in self.tasks else []
        return attempts[-1].get("node") if attempts else None

    def _started_node(self, key: str) -> str:
        return self._node_of(key) or "unknown (the task never started)"

    def _collect(self, unit, ref) -> bool:
        """Record a finished task's unit; False when its attempt found its node not admitted (submit it again)."""
        try:
            out = ray.get(ref)
        except rex.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, NodeNotAdmitted) and self.tasks[unit.key]["submits"] <= RESUBMITS:
                log.info("[%s] %s: probing it, then submitting the unit again", unit.key, cause)
                return False
            if isinstance(cause, CompressError):
                raise cause from None
            raise StageError(f"stage {unit.key} failed on node {self._started_node(unit.key)}: "
                             f"{type(cause).__name__}: {cause}") from None
        except rex.RayError as e:
            raise StageError(f"stage {unit.key}: its Ray task was lost on node {self._started_node(unit.key)} "
                             f"({type(e).__name__}, after {MAX_RETRIES} retries); rerun to resume: "
                             f"{str(e).splitlines()[0] if str(e) else ''}") from None
        keep = ("node", "task_start", "unit_start", "unit_end", "attempt", "committed", "attempts")
        self.tasks[unit.key].update({k: out[k] for k in keep}, received=time.time())
        if len(out["attempts"]) > 1:
            log.info("[%s] %d attempts, on %s", unit.key, len(out["attempts"]),
                     ", ".join(a.get("node", "?") for a in out["attempts"]))
        self.runner._record(unit, out["manifest"], skipped=False)
        self.runner.report.stages[unit.key].node = out["node"]

        schema.save(self.runner.report, self.run_dir)

        fault_point(unit.key, "recorded")  # tests: the driver killed right after recording a unit
        return True

    def run(self, units: list) -> None:
        """Every unit once its deps are recorded; up-to-date units are skipped here, as the local runner does."""
        pending, shown = list(units), None
        running: dict[ray.ObjectRef, Unit] = {}
        while pending or running:
            self._admit()
            self._submit_ready(pending, running)
            if not running:
                if pending:
                    raise StageError(f"units {[u.key for u in pending]} wait for upstream units that did not run")
                break
            line = self._progress(running, pending)
            if line != shown:
                log.info("%s", line)
                shown = line
            ready, _ = ray.wait(list(running), num_returns=1, timeout=PROGRESS_S)
            for ref in ready:
                unit = running.pop(ref)
                if not self._collect(unit, ref):
                    self._admit()
                    running[self._submit(unit, self.tasks[unit.key]["hash"])] = unit
                    continue
                log.info("[%s] done on %s", unit.key, self.runner.report.stages[unit.key].node)
        self._finish(units)

    def _submit_ready(self, pending: list, running: dict) -> None:
        for unit in self._ready(pending):
            h = self.runner.inputs_hash(unit)
            old = read_manifest(self.run_dir / unit.key)
            if old and old.get("inputs_hash") == h and not unit.always \
                    and verify_outputs(self.run_dir / unit.key, old) is None:
                log.info("[%s] up to date, skipped (inputs unchanged, outputs verified)", unit.key)
                self.runner._record(unit, old, skipped=True)
                continue
            running[self._submit(unit, h)] = unit
            log.info("[%s] submitted to Ray", unit.key)

    def _finish(self, units: list) -> None:
        """The report's stages and variants in recipe order (tasks finish in any order); ray_tasks.json."""
        order = [u.key for u in units]
        stages = self.runner.report.stages
        self.runner.report.stages = {**{k: v for k, v in stages.items() if k not in order},
                                     **{k: stages[k] for k in order if k in stages}}
        variants = self.runner.report.variants
        self.runner.report.variants = {q.name: variants[q.name] for q in self.recipe.quantize if q.name in variants} \
            | {k: v for k, v in variants.items() if k not in {q.name for q in self.recipe.quantize}}
        atomic_write_text(self.run_dir / TASKS_FILE, json.dumps(self.tasks, indent=2))

    def _ready(self, pending: list):
        """Pending units whose deps are recorded, removed from pending; a skip can make more ready at once."""
        while True:
            ready = [u for u in pending if all(d in self.runner.manifests for d in u.deps)]
            if not ready:
                return
            unit = ready[0]
            pending.remove(unit)
            yield unit

    def _progress(self, running: dict, pending: list) -> str:
        done: dict[str, int] = {}
        for t in self.tasks.values():
            if "received" in t:
                done[t["node"]] = done.get(t["node"], 0) + 1
        skipped = sum(1 for s in self.runner.report.stages.values() if s.status == "skipped")
        return progress_line({u.key: self._node_of(u.key) for u in running.values()}, len(pending), done, skipped)


def progress_line(running: dict[str, str | None], waiting: int, done: dict[str, int], skipped: int = 0) -> str:
    """The console's view of the cluster: per node the units running there and how many it finished; then the
    queue (submitted tasks no node has started yet, units waiting for upstream units) and the up-to-date skips."""
    nodes = sorted(set(done) | {n for n in running.values() if n})
    per_node = [f"{n}: running {', '.join(k for k, m in running.items() if m == n) or '-'}, {done.get(n, 0)} done"
                for n in nodes]
    queued = [k for k, m in running.items() if m is None]
    return ("ray: " + "; ".join(per_node + [f"queued {len(queued) + waiting} ({len(queued)} submitted"
                                            + (f": {', '.join(queued)}" if queued else "")
                                            + f", {waiting} waiting for upstream units)"])
            + (f"; {skipped} up to date" if skipped else ""))

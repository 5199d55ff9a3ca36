"""`[run] executor = "ray"`: every unit whose upstream units are done runs as a Ray task, in parallel where the
unit graph (Unit.deps) allows.

The run folder stays the single source of truth. The driver (this process) holds the run lock and owns
report.json; a task rebuilds its unit from the recipe (build_units: unit functions are closures over the recipe,
so the recipe's dict and the unit key travel, never a closure), runs it with the runner's own tmp+rename commit,
writes only its unit folder (and its .work scratch) and returns the manifest; the driver merges it into the report
exactly as the local executor does. Resume and the publish rule are therefore unchanged.

Resources per task: `num_gpus` 1 when the run's device is cuda, `num_cpus` = [run].threads (1 when unset),
`memory` = `compress check`'s predicted peak for the unit (pipeline/plan.py Plan.memory). Speed units are never
co-scheduled: every node offers the custom resource {"compress_node": 1}; an ordinary unit asks for 0.01 of it,
a speed unit (validate/<model>/speed) for all of it, so Ray puts nothing beside a speed unit and a speed unit
beside nothing. Start each node with `ray start ... --resources '{"compress_node": 1}'` (a Ray instance started
by compress itself, ray_address unset, has it).

Before the first task each node reads a probe file the driver wrote in the run folder and writes one back; a node
that cannot is refused by name. A task lost with its worker or node is retried by Ray (MAX_RETRIES); past that the
run fails with exit 4 naming the node. A unit commits only through the rename, so a lost task never leaves a
unit that looks complete.

Nothing here imports ray at module import: `compress check` only asks importlib whether it is installed.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from pipeline.core.errors import CompressError, RecipeError, StageError

log = logging.getLogger("compress")

EXTRA = "pip install -e '.[ray]'"
NODE_RESOURCE = "compress_node"  # one per node: speed units take all of it
SHARE = 0.01  # what an ordinary unit takes of it
MAX_RETRIES = int(os.environ.get("COMPRESS_RAY_MAX_RETRIES", "2"))
# tests: a node whose environment sets this sees the filesystem under another root (a node without the run folder)
PROBE_ROOT_ENV = "COMPRESS_RAY_PROBE_ROOT"
TASKS_FILE = "ray_tasks.json"  # the driver's record of each task: node, submit/start times (benchmarks read it)
CONNECT_TIMEOUT_S = 12  # a throwaway ray.init in a child process; with the 10 s TCP check, exit 2 within 30 s
PROGRESS_S = 2  # how often the driver looks at which queued tasks have started (a line only when something changed)


def is_speed(key: str) -> bool:
    return key.startswith("validate/") and key.endswith("/speed")


def this_node() -> str:
    import ray

    return f"{ray.get_runtime_context().get_node_id()[:12]} ({ray.util.get_node_ip_address()})"


# ---------------------------------------------------------------- on the worker


def _probe_task(run_dir: str, token: str) -> tuple[str, str | None]:
    """On one node: read the driver's probe file, write this node's own; (node, None) or (node, what failed)."""
    node = this_node()
    root = os.environ.get(PROBE_ROOT_ENV, "")
    base = Path(root + run_dir) if root else Path(run_dir)
    probe = base / ".ray-probe"
    try:
        seen = (probe / f"driver-{token}").read_text()
        if seen != token:
            return node, f"{probe / f'driver-{token}'} holds other content"
        (probe / f"node-{node.split()[0]}-{token}").write_text(token)
    except OSError as e:
        return node, f"{e.filename or probe}: {e.strerror or e}"
    return node, None


def _unit_task(recipe_data: dict, key: str, h: str, run: dict, manifests: dict) -> dict:
    """On a worker: rebuild the unit from the recipe, run it with the runner's atomic commit, return its manifest."""
    task_start = time.time()
    node = this_node()
    run_dir = Path(run["run_dir"])
    work = run_dir / ".work" / key / h[:16]
    work.mkdir(parents=True, exist_ok=True)
    (work / "ray-task.json").write_text(json.dumps({"node": node, "task_start": task_start}))
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False  # Ray's root handler would print every line a second time
    from pipeline.core.env import tame

    tame()
    import torch

    from pipeline.core.units import build_units
    from pipeline.recipe import Recipe

    if run["threads"]:
        torch.set_num_threads(run["threads"])
    torch.manual_seed(run["seed"])
    recipe = Recipe.model_validate(recipe_data)
    head, exports = build_units(recipe)
    unit = {u.key: u for u in head + exports}[key]
    runner = _task_runner_cls()(run_dir, run["seed"], run["device"], run["versions"], None, run["run_id"])
    runner.manifests = dict(manifests)
    if runner.inputs_hash(unit) != h:
        raise StageError(f"{key}: node {node} computes another inputs hash than the driver: is the same compress "
                         "(code and library versions) installed on every node?")
    unit_start = time.time()
    manifest = runner._execute(unit, run_dir / key, h)
    return {"manifest": manifest, "node": node, "task_start": task_start, "unit_start": unit_start,
            "unit_end": time.time()}


def _task_runner_cls():
    from pipeline.core.runner import Runner

    class TaskRunner(Runner):
        def _record(self, unit, manifest, skipped):  # the driver records; a task never writes report.json
            self.manifests[unit.key] = manifest

    return TaskRunner


# ---------------------------------------------------------------- on the driver


def answers(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> str | None:
    """None when a Ray cluster answers at address, else why not. The connection is tried in a child process that is
    killed after timeout_s: ray.init itself retries an address that accepts TCP but does not speak Ray's protocol
    (another service, a stale "auto" address) for minutes."""
    code = "import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); ray.shutdown()"
    try:
        p = subprocess.run([sys.executable, "-c", code, address], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"no Ray cluster answered there within {timeout_s:g} s"
    if p.returncode == 0:
        return None
    lines = [ln.strip() for ln in p.stderr.splitlines() if ln.strip()]
    return lines[-1] if lines else f"ray.init exited {p.returncode}"


def connect(address: str | None) -> None:
    """ray.init, or exit 2 naming the address when nothing answers there (a TCP check first, 10 s at most, then a
    Ray connection in a child process, CONNECT_TIMEOUT_S at most)."""
    import ray

    if ray.is_initialized():
        return
    if not address:
        ray.init(include_dashboard=False, resources={NODE_RESOURCE: 1}, logging_level=logging.WARNING)
        return
    if address != "auto":
        hostport = address.removeprefix("ray://")
        host, _, port = hostport.rpartition(":")
        try:
            socket.create_connection((host or "127.0.0.1", int(port)), timeout=10).close()
        except (OSError, ValueError) as e:
            raise RecipeError(f"[run] ray_address {address!r} is unreachable: {getattr(e, 'strerror', None) or e}") \
                from None
    problem = answers(address)
    if problem:
        raise RecipeError(f"[run] ray_address {address!r}: cannot connect to a Ray cluster: {problem}")
    try:
        ray.init(address=address, logging_level=logging.WARNING)
    except Exception as e:  # ConnectionError, an authentication error, a version mismatch: one line, exit 2
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise RecipeError(f"[run] ray_address {address!r}: cannot connect to a Ray cluster: "
                          f"{type(e).__name__}: {first}") from None


def cluster_device(requested: str, nodes: list[dict], address: str | None) -> str:
    """[run] device resolved against the cluster's nodes, not the driver's machine (a CPU-only head may drive GPU
    nodes): "auto" is cuda when a compress node offers a GPU, else cpu; "cuda" with no such node is refused."""
    gpus = any(n["Resources"].get("GPU") for n in nodes if n["Resources"].get(NODE_RESOURCE))
    if requested == "auto":
        return "cuda" if gpus else "cpu"
    if requested == "cuda" and not gpus:
        where = f"at {address!r}" if address else "started on this machine"
        raise StageError(f"the recipe asks for device = 'cuda' but no node of the Ray cluster {where} offers a GPU")
    return requested


def alive_nodes() -> list[dict]:
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]


def node_name(n: dict) -> str:
    return f"{n['NodeID'][:12]} ({n.get('NodeManagerAddress', '?')})"


def options_for(key: str, plan, device: str, threads: int | None) -> dict:
    from pipeline.results.render import planned

    opts = {"num_cpus": threads or 1, "num_gpus": 1 if device == "cuda" else 0,
            "resources": {NODE_RESOURCE: 1 if is_speed(key) else SHARE}, "max_retries": MAX_RETRIES}
    # a speed unit loads the same model as its quality unit: the plan's figure for "validate/<model>"
    mem = planned(plan.memory, key.removesuffix("/speed") if is_speed(key) else key) if plan is not None else None
    if mem:
        opts["memory"] = int(mem)
    return opts


def refuse_unfit(keys: list[str], plan, device: str, threads: int | None, nodes: list[dict]) -> None:
    """Every unit must fit some node (CPUs, GPUs, memory, the node resource); refused before submission if not."""
    if not any(n["Resources"].get(NODE_RESOURCE) for n in nodes):
        raise RecipeError(f"no node of the Ray cluster offers the resource {NODE_RESOURCE!r}: start each node with "
                          f"`ray start ... --resources '{{\"{NODE_RESOURCE}\": 1}}'` (speed units take a whole node)")
    problems = []
    for key in keys:
        need = options_for(key, plan, device, threads)
        fits = [n for n in nodes if n["Resources"].get("CPU", 0) >= need["num_cpus"]
                and n["Resources"].get("GPU", 0) >= need["num_gpus"]
                and n["Resources"].get("memory", 0) >= need.get("memory", 0)
                and n["Resources"].get(NODE_RESOURCE, 0) >= need["resources"][NODE_RESOURCE]]
        if not fits:
            best_mem = max(n["Resources"].get("memory", 0) for n in nodes) / 2**30
            best_cpu = max(n["Resources"].get("CPU", 0) for n in nodes)
            best_gpu = max(n["Resources"].get("GPU", 0) for n in nodes)
            problems.append(f"{key} needs {need.get('memory', 0) / 2**30:.2f} GiB memory (predicted peak), "
                            f"{need['num_cpus']} CPU, {need['num_gpus']} GPU; the largest node offers "
                            f"{best_mem:.2f} GiB, {best_cpu:g} CPU, {best_gpu:g} GPU")
    if problems:
        raise RecipeError("units no node of the Ray cluster can run (nothing was submitted):\n"
                          + "\n".join(f"  - {p}" for p in problems))


def probe_nodes(run_dir: Path, nodes: list[dict], timeout_s: float = 120) -> None:
    """Each node reads the driver's probe file in the run folder and writes its own, read back here."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    token = uuid.uuid4().hex
    probe = run_dir / ".ray-probe"
    probe.mkdir(exist_ok=True)
    (probe / f"driver-{token}").write_text(token)
    task = ray.remote(_probe_task)
    try:
        refs = {task.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                .remote(str(run_dir.resolve()), token): n for n in nodes}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        for ref, n in refs.items():
            if ref not in ready:
                raise StageError(f"run folder {run_dir}: node {node_name(n)} did not answer the shared-filesystem "
                                 f"probe in {timeout_s:.0f} s")
            node, problem = ray.get(ref)
            back = probe / f"node-{node.split()[0]}-{token}"
            if problem is None and not back.is_file():
                problem = f"its probe file {back} is not visible from the driver"
            if problem:
                raise StageError(f"run folder {run_dir.resolve()} is not on a filesystem node {node} sees: {problem}")
    finally:
        for p in probe.glob(f"*{token}"):
            p.unlink(missing_ok=True)
        try:
            probe.rmdir()
        except OSError:
            pass


class RayExecutor:
    """Runs lists of units on the cluster; the Runner given records every result into the report."""

    def __init__(self, recipe, runner, run_dir: Path, plan) -> None:
        self.recipe, self.runner, self.run_dir, self.plan = recipe, runner, Path(run_dir), plan
        self.recipe_data = recipe.dump()
        self.tasks: dict[str, dict] = {}

    def start(self, all_keys: list[str]) -> None:
        connect(self.recipe.run.ray_address)
        nodes = alive_nodes()
        refuse_unfit(all_keys, self.plan, self.runner.device, self.recipe.run.threads, nodes)
        usable = [n for n in nodes if n["Resources"].get(NODE_RESOURCE)]
        probe_nodes(self.run_dir, usable)
        log.info("ray: %d node(s): %s; run folder %s seen by all", len(usable),
                 ", ".join(node_name(n) for n in usable), self.run_dir)

    def close(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()

    def _submit(self, unit, h: str):
        import ray

        r = self.recipe.run
        opts = options_for(unit.key, self.plan, self.runner.device, r.threads)
        run = {"run_dir": str(self.run_dir.resolve()), "seed": self.runner.seed, "device": self.runner.device,
               "versions": self.runner.versions, "run_id": self.runner.run_id, "threads": r.threads}
        manifests = {k: v for k, v in self.runner.manifests.items()}
        self.tasks[unit.key] = {"submitted": time.time(), "hash": h}
        return ray.remote(_unit_task).options(**opts).remote(self.recipe_data, unit.key, h, run, manifests)

    def _node_of(self, key: str) -> str | None:
        """The node a submitted task started on (its ray-task.json in the run folder), None while it is queued."""
        try:
            return json.loads((self.run_dir / ".work" / key / self.tasks[key]["hash"][:16] / "ray-task.json")
                              .read_text())["node"]
        except (OSError, ValueError, KeyError):
            return None

    def _started_node(self, key: str) -> str:
        return self._node_of(key) or "unknown (the task never started)"

    def _collect(self, unit, ref) -> None:
        import ray
        from ray import exceptions as rex

        try:
            out = ray.get(ref)
        except rex.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, CompressError):
                raise cause from None
            raise StageError(f"stage {unit.key} failed on node {self._started_node(unit.key)}: "
                             f"{type(cause).__name__}: {cause}") from None
        except rex.RayError as e:
            raise StageError(f"stage {unit.key}: its Ray task was lost on node {self._started_node(unit.key)} "
                             f"({type(e).__name__}, after {MAX_RETRIES} retries); rerun to resume: "
                             f"{str(e).splitlines()[0] if str(e) else ''}") from None
        self.tasks[unit.key].update({k: out[k] for k in ("node", "task_start", "unit_start", "unit_end")},
                                    received=time.time())
        self.runner._record(unit, out["manifest"], skipped=False)
        self.runner.report.stages[unit.key].node = out["node"]
        from pipeline.results import schema

        schema.save(self.runner.report, self.run_dir)
        from pipeline.core.runner import fault_point

        fault_point(unit.key, "recorded")  # tests: the driver killed right after recording a unit

    def run(self, units: list) -> None:
        """Every unit once its deps are recorded; up-to-date units are skipped here, as the local runner does."""
        import ray

        from pipeline.core.fileio import atomic_write_text
        from pipeline.core.runner import read_manifest, verify_outputs

        pending, running, shown = list(units), {}, None
        while pending or running:
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
                self._collect(unit, ref)
                log.info("[%s] done on %s", unit.key, self.runner.report.stages[unit.key].node)
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
        done = {}
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

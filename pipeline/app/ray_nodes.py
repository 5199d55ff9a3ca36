"""The Ray cluster as the driver of pipeline/app/ray_executor.py sees it: connecting, the nodes, what each unit asks
for, and the probe that admits a node before its first task.

Resources per task: `num_gpus` 1 when the run's device is cuda, `num_cpus` = [run].threads (1 when unset), `memory`
= `compress check`'s predicted peak for the unit (unit_memory). Units whose figures are timings that gates read
(speed, serve, the speculative speed-up) are never co-scheduled: every node offers the custom resource
{"compress_node": 1}; an ordinary unit asks for 0.01 of it, such a unit for all of it, so Ray puts nothing beside it
and it beside nothing. Start each node with `ray start ... --resources '{"compress_node": 1}'` (a Ray instance
started by compress itself, ray_address unset, has it).

Nothing here imports ray at module import: `compress check` only asks importlib whether it is installed.
"""
from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pipeline.app.ray_task import PROBE_DIR, admitted_file, probe_task, session_file, version_mismatch
from pipeline.base.errors import RecipeError, StageError
from pipeline.base.fileio import atomic_write_text
from pipeline.base.stage_keys import UnitKey
from pipeline.stages.kinds import kind_of

log = logging.getLogger("compress")

NODE_RESOURCE = "compress_node"  # one per node: exclusive units take all of it
NODE_ID_LABEL = "ray.io/node-id"  # the label Ray (2.60) gives every node: its node id
SHARE = 0.01  # what an ordinary unit takes of it
CONNECT_TIMEOUT_S = 12  # a throwaway ray.init in a child process; with the 10 s TCP check, exit 2 within 30 s


def exclusive(key: str) -> bool:
    """A unit that measures time for the gates (speed, served throughput, speculative speed-up): a node of its own.
    Its class says so (pipeline/stages/kinds.py Stage.exclusive); a key outside the grammar is refused."""
    return kind_of(key).exclusive


def unit_memory(plan, key: str) -> int | None:
    """The plan's predicted peak for a unit, as its class finds it (pipeline/stages/kinds.py memory_keys): its own
    figure; else, for a unit measuring one model (quality, speed, tasks, serve/<engine>), that model's figure
    ("validate/<model>"); the speculative unit holds the verifier and the draft, as the draft unit does: that unit's
    figure."""
    k = UnitKey.parse(key)  # a key outside the grammar is refused, with or without a plan
    return None if plan is None else kind_of(k).planned_memory(plan.memory, k)


def options_for(key: str, plan, device: str, threads: int | None) -> dict:
    """What a unit's task asks Ray for (num_cpus, num_gpus, the node resource, memory when the plan has a figure)."""
    opts = {"num_cpus": threads or 1, "num_gpus": 1 if device == "cuda" else 0,
            "resources": {NODE_RESOURCE: 1 if exclusive(key) else SHARE}}
    mem = unit_memory(plan, key)
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


# ---------------------------------------------------------------- connecting


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
    return [n for n in ray.nodes() if n.get("Alive")]


def node_name(n: dict) -> str:
    return f"{n['NodeID'][:12]} ({n.get('NodeManagerAddress', '?')})"


# ---------------------------------------------------------------- admitting nodes


def probe_nodes(run_dir: Path, nodes: list[dict], versions: dict, timeout_s: float = 120) -> None:
    """Each node reads the driver's probe file in the run folder and writes its own, read back here, and reports its
    own library versions, which must be the driver's. Refused (exit 4) naming the node and what failed."""
    token = uuid.uuid4().hex
    probe = run_dir / PROBE_DIR
    probe.mkdir(exist_ok=True)
    (probe / f"driver-{token}").write_text(token)
    task = ray.remote(probe_task)
    try:
        refs = {task.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                .remote(str(run_dir.resolve()), token): n for n in nodes}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        for ref, n in refs.items():
            if ref not in ready:
                raise StageError(f"run folder {run_dir}: node {node_name(n)} did not answer the shared-filesystem "
                                 f"probe in {timeout_s:.0f} s")
            node_id, node, problem, node_versions = ray.get(ref)
            back = probe / f"node-{node_id}-{token}"
            if problem is None and not back.is_file():
                problem = f"its probe file {back} is not visible from the driver"
            if problem:
                raise StageError(f"run folder {run_dir.resolve()} is not on a filesystem node {node} sees: {problem}")
            problem = version_mismatch(versions, node_versions, node)
            if problem:
                raise StageError(problem)
    finally:
        for p in probe.glob(f"*{token}"):
            p.unlink(missing_ok=True)


class Admission:
    """The nodes this run's driver has probed. A node is probed before its first task, whenever it joined: admit_new
    is called at the start, before each submission and while waiting; an attempt on a node not admitted yet refuses
    to start (pipeline/app/ray_task.py check_node) and the driver admits the node and submits the unit again."""

    def __init__(self, run_dir: Path, versions: dict, list_nodes, probe) -> None:
        self.run_dir, self.versions, self.list_nodes, self.probe = Path(run_dir), versions, list_nodes, probe
        self.token = uuid.uuid4().hex  # what admitted-<node id> holds for this driver
        self.admitted: dict[str, str] = {}
        self.left_out: dict[str, str] = {}  # node id -> why: nodes that joined later and were refused
        self.session_written = False

    def claim_session(self) -> None:
        """This driver is the one running the run folder now: a late attempt of an earlier driver commits nothing.
        Written at the first admission, so a run refused before it (no node can hold a unit) writes nothing."""
        if not self.session_written:
            session_file(self.run_dir).parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(session_file(self.run_dir), self.token)
            self.session_written = True

    def admit_new(self, nodes: list[dict] | None = None) -> list[str]:
        """Probe every usable node not admitted yet; their names. At the start a refused node is StageError naming
        it (the cluster the run starts on is the one asked for); a node that joins later and is refused (other
        library versions, no run folder) is left out with a warning: no unit is submitted to it (`left_out`)."""
        self.claim_session()
        nodes = self.list_nodes() if nodes is None else nodes
        new = [n for n in nodes if n["Resources"].get(NODE_RESOURCE) and n["NodeID"] not in self.admitted
               and n["NodeID"] not in self.left_out]
        if not new:
            return []
        if not self.admitted:
            self.probe(self.run_dir, new, self.versions)
        else:
            new = [n for n in new if self._probe_late(n)]

        (self.run_dir / PROBE_DIR).mkdir(parents=True, exist_ok=True)
        for n in new:
            atomic_write_text(admitted_file(self.run_dir, n["NodeID"]), self.token)
            self.admitted[n["NodeID"]] = node_name(n)
        return [node_name(n) for n in new]

    def _probe_late(self, n: dict) -> bool:
        try:
            self.probe(self.run_dir, [n], self.versions)
            return True
        except StageError as e:
            self.left_out[n["NodeID"]] = str(e)
            log.warning("ray: node %s joined but is left out, no unit goes to it: %s", node_name(n), e)
            return False

    def selector(self) -> dict:
        """Ray task options that keep units off the left-out nodes (Ray's default node-id label)."""
        if not self.left_out:
            return {}
        return {"label_selector": {NODE_ID_LABEL: f"!in({', '.join(sorted(self.left_out))})"}}

    def close(self) -> None:
        shutil.rmtree(self.run_dir / PROBE_DIR, ignore_errors=True)

"""`[run] executor = "ray"` on a real two-node Ray cluster started on this machine (loopback only).

The head and the second node are started with `ray start` under a private temp dir; the finaliser kills exactly
the processes of that cluster (their command lines name its temp dir or its GCS port), never another Ray.
"""
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.test_tiny_recipe import RECIPE as RECIPE_PATH
from tests.e2e.test_tiny_recipe import ROOT, run_tiny

pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.slow]

RAY = Path(sys.executable).parent / "ray"
RAY_SETS = ('run.executor="ray"',)
# loopback cluster without Ray's token authentication (Ray 2.60 otherwise uses a token file in ~/.ray)
AUTH = {"RAY_AUTH_MODE": "disabled"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_pids(marks: list[str]) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(m in cmd for m in marks):
            pids.append(int(d.name))
    return pids


class Cluster:
    def __init__(self, temp: Path) -> None:
        self.temp, self.port = temp, free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0",
                    **AUTH,
                    # Ray starts its workers (where compress's units run) at niceness 15: beside the other xdist
                    # worker and .ci/run's background run they got a few percent of a core (the whole-recipe test:
                    # 47 s alone, 366 s beside two busy processes); at 0 they share the cores as the rest does
                    "RAY_worker_niceness": "0",
                    "RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "4",
                    "RAY_health_check_timeout_ms": "500"}
        self.env.pop("COMPRESS_FAULT", None)
        self.node_ports: list[int] = []

    def start_head(self, num_cpus: int = 1) -> None:
        subprocess.run([RAY, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(self.port),
                        "--num-cpus", str(num_cpus), "--resources", json.dumps({"compress_node": 1}),
                        "--temp-dir", str(self.temp), "--include-dashboard=false", "--disable-usage-stats"],
                       env=self.env, capture_output=True, text=True, timeout=120, check=True)

    def add_node(self, extra_env: dict | None = None, resources: dict | None = None) -> int:
        port = free_port()
        subprocess.run([RAY, "start", "--address", self.address, "--node-ip-address", "127.0.0.1",
                        "--num-cpus", "1", "--node-manager-port", str(port),
                        "--resources", json.dumps({"compress_node": 1, **(resources or {})})],
                       env={**self.env, **(extra_env or {})}, check=True, capture_output=True, text=True, timeout=120)
        self.node_ports.append(port)
        self.wait_nodes(1 + len(self.node_ports))
        return port

    def raylet_pid(self, node_port: int) -> int:
        pids = [p for p in cluster_pids([f"--node_manager_port={node_port}"])
                if "raylet" in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace").split("\0")[0]]
        assert len(pids) == 1, pids
        return pids[0]

    def kill_node(self, node_port: int) -> None:
        os.kill(self.raylet_pid(node_port), signal.SIGKILL)
        self.node_ports.remove(node_port)
        self.wait_nodes(1 + len(self.node_ports))

    def wait_nodes(self, n: int, timeout: float = 60) -> None:
        code = ("import ray,sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
                "print(sum(1 for x in ray.nodes() if x['Alive']))")
        deadline = time.time() + timeout
        while time.time() < deadline:
            p = subprocess.run([sys.executable, "-c", code, self.address], env=self.env, capture_output=True,
                               text=True, timeout=60)
            if p.returncode == 0 and p.stdout.strip().splitlines()[-1] == str(n):
                return
            time.sleep(1)
        raise AssertionError(f"the cluster did not reach {n} alive node(s)")

    def stop(self) -> None:
        marks = [str(self.temp), f"127.0.0.1:{self.port}"]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in cluster_pids(marks):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            time.sleep(1)


@pytest.fixture(scope="module")
def cluster():
    import shutil
    import tempfile

    temp = Path(tempfile.mkdtemp(prefix="r25-", dir="/tmp"))  # short: Ray's unix sockets live under it
    c = Cluster(temp)
    try:
        c.start_head()
        yield c
    finally:
        c.stop()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture
def second_node(cluster, request):
    """A plain second node; tests needing another environment start their own."""
    port = cluster.add_node()
    yield port
    if port in cluster.node_ports:
        cluster.kill_node(port)


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def figures(report: dict) -> dict:
    """The report's measured figures, without wall-clock times."""
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items()  # times and memory are measurements of the process, not figures
                    if not (k.endswith("time_s") or "rss" in k or k in ("elapsed_s", "tok_s", "speedup", "wall_s"))}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x
    return strip({k: report.get(k) for k in ("model", "calibration", "baseline", "variants", "gates")})


def test_ray_run_matches_local_and_uses_both_nodes(cluster, second_node, tiny_run, tmp_path):
    """The Ray run's driver is first SIGKILLed right after recording calibrate (COMPRESS_FAULT in its environment
    only; other units may be running on the nodes then); the rerun resumes from the folder, and what the two produce
    together must equal the local run byte for byte.

    Once the rerun has admitted its two nodes, a third joins whose own transformers differs (COMPRESS_RAY_NODE_VERSIONS
    in its environment: what its version probe reports): the driver probes it before its first task and leaves it
    out with a warning naming it and both versions (#42: the run exited 4); no unit runs there."""
    from pipeline.plan import versions

    local_dir, ray_dir, address = tiny_run[0], tmp_path / "tiny", f'run.ray_address="{cluster.address}"'
    killed = run_tiny(tmp_path, *RAY_SETS, address, env={**AUTH, "COMPRESS_FAULT": "calibrate:recorded"}, rc=-9)
    assert "fault injection: killing the process at calibrate:recorded" in killed.stderr
    assert json.loads((ray_dir / "report.json").read_text())["run"]["status"] == "running"
    p, other = start_run(cluster, tmp_path, recipe=RECIPE_PATH), None
    try:
        deadline = time.time() + 300  # joined after the start's admission (a node refused then is exit 4)
        while "library versions the driver's" not in (tmp_path / "out.log").read_text():
            assert p.poll() is None and time.time() < deadline, (tmp_path / "out.log").read_text()[-3000:]
            time.sleep(0.2)
        other = cluster.add_node({"COMPRESS_RAY_NODE_VERSIONS": json.dumps({"transformers": "0.0.1-other"})})
        rc = p.wait(timeout=900)  # a hang guard, not a speed figure
    finally:
        if p.poll() is None:
            p.kill()
        if other in cluster.node_ports:  # the module's later tests start on a two-node cluster
            cluster.kill_node(other)
    out = (tmp_path / "out.log").read_text()
    assert rc == 0, out[-3000:]
    for unit in ("load", "calibrate"):
        assert f"[{unit}] up to date, skipped" in out
    warned = [ln for ln in out.splitlines() if "joined but is left out" in ln]
    assert len(warned) == 1, out[-3000:]
    assert f"transformers {versions()['transformers']} on the driver, 0.0.1-other on the node" in warned[0]
    assert "torch" not in warned[0]
    left_out = re.search(r"node ([0-9a-f]{12} \([^)]+\)) joined but is left out", warned[0]).group(1)
    assert not (ray_dir / ".ray-probe").exists()
    local, remote = (json.loads((d / "report.json").read_text()) for d in (local_dir, ray_dir))
    assert all(s.get("node") != left_out for s in remote["stages"].values())
    assert remote["run"]["status"] == "complete" and not list(ray_dir.rglob("*.tmp"))
    # (1) every quantized checkpoint file byte-identical, and the report's figures equal
    for name in ("gptq-w4g32", "rtn-w4g32"):
        files = sorted(p.relative_to(local_dir) for p in (local_dir / "quantize" / name).rglob("*")
                       if p.is_file() and p.name not in ("manifest.json", "metrics.json") and p.suffix != ".log")
        assert files
        for rel in files:
            assert sha(local_dir / rel) == sha(ray_dir / rel), rel
    assert figures(local) == figures(remote)
    assert list(local["stages"]) == list(remote["stages"])
    # (2) both nodes ran the rerun's units, and the report says which
    ran = {k: s for k, s in remote["stages"].items() if s["status"] == "done"}
    assert {"load", "calibrate"} <= set(remote["stages"]) - set(ran)
    nodes = {s["node"] for s in ran.values()}
    assert None not in nodes and len(nodes) == 2, nodes
    assert left_out not in nodes
    assert all(s["node"] is None for s in local["stages"].values())
    tasks = json.loads((ray_dir / "ray_tasks.json").read_text())
    assert set(tasks) == set(ran)
    assert all(t["submitted"] <= t["task_start"] <= t["unit_start"] <= t["unit_end"] for t in tasks.values())
    # ... at the same time: some two units ran on different nodes in overlapping intervals
    spans = list(tasks.values())
    assert any(a["node"] != b["node"] and a["unit_start"] < b["unit_end"] and b["unit_start"] < a["unit_end"]
               for a in spans for b in spans), spans
    # the console showed, per node, what ran there and what it finished
    progress = [ln for ln in out.splitlines() if "ray: " in ln and "queued" in ln]
    assert any(re.search(r"\): running [a-z]", ln) for ln in progress), out[-3000:]
    assert all(any(f"{n}: running" in ln for ln in progress) for n in nodes), progress
    md = (ray_dir / "report.md").read_text()
    assert "| node |" in md and all(n in md for n in nodes)


@pytest.fixture
def driver_only_cluster():
    """A head with no CPU for units (the driver's node) and the victim node running every unit."""
    import shutil
    import tempfile

    c = Cluster(Path(tempfile.mkdtemp(prefix="r25k-", dir="/tmp")))
    try:
        c.start_head(num_cpus=0)
        yield c
    finally:
        c.stop()
        shutil.rmtree(c.temp, ignore_errors=True)


def short_recipe(tmp_path: Path) -> Path:
    """recipes/tiny.toml without its draft and its RTN variant: load, calibrate, quantize/gptq-w4g32, its
    validation and export. The node tests below ask for units to run while a node joins or dies, not for every kind
    of unit (test_ray_run_matches_local_and_uses_both_nodes runs the whole recipe)."""
    import tomllib

    text = (ROOT / "recipes" / "tiny.toml").read_text()
    rtn = text.index('[[quantize]]\nname = "rtn-w4g32"')
    text = text[:rtn] + text[text.index("[draft]"):]
    text = text[:text.index("[draft]")] + text[text.index("[validate.perplexity]"):]
    recipe = tomllib.loads(text)
    assert [q["name"] for q in recipe["quantize"]] == ["gptq-w4g32"] and "draft" not in recipe, text
    path = tmp_path / "tiny.toml"
    path.write_text(text)
    return path


def start_run(cluster, tmp_path, recipe: Path | None = None) -> subprocess.Popen:
    """`compress run` of the short tiny recipe (or `recipe`) on the cluster, in the background, its output in
    tmp_path/out.log."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **AUTH}
    env.pop("COMPRESS_FAULT", None)
    args = [sys.executable, "-m", "pipeline.app.cli", "run", str(recipe or short_recipe(tmp_path)),
            "--set", f"run.output_dir={json.dumps(str(tmp_path))}", "--set", RAY_SETS[0],
            "--set", f'run.ray_address="{cluster.address}"']
    with open(tmp_path / "out.log", "w") as log:
        return subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def paused_attempt(p: subprocess.Popen, run_dir: Path, key: str, tmp_path: Path) -> dict:
    """Wait for the attempt of `key` that its node's COMPRESS_FAULT pauses at its start: its outputs folder exists
    (created just before the fault point); its ray-task.json record."""
    deadline = time.time() + 300  # a hang guard: the units before it run on 1 CPU of a shared machine
    while not (tmp := list((run_dir / ".work" / key).glob("*-*/out.tmp"))):
        assert p.poll() is None and time.time() < deadline, (tmp_path / "out.log").read_text()[-3000:]
        time.sleep(0.2)
    return json.loads((tmp[0].parent / "ray-task.json").read_text())


def test_killing_a_node_mid_quantize_ray_retries_the_unit_on_a_node_that_joined_later(driver_only_cluster,
                                                                                       tmp_path):
    """Every unit runs on the victim node (the head offers no CPU); the victim pauses at the start of
    quantize/gptq-w4g32 (COMPRESS_FAULT in its environment only). Once that attempt is there, a spare node joins
    (probed by the driver before its first task) and the victim's raylet is SIGKILLed: Ray runs the unit again on the
    spare, whose attempt commits; the run completes (exit 0), and ray_tasks.json lists both attempts."""
    cluster, key = driver_only_cluster, "quantize/gptq-w4g32"
    victim = cluster.add_node({"COMPRESS_FAULT": f"{key}:start:pause"})
    run_dir = tmp_path / "tiny"
    p = start_run(cluster, tmp_path)
    try:
        first = paused_attempt(p, run_dir, key, tmp_path)
        assert not (run_dir / key).exists()
        cluster.add_node()  # the spare
        cluster.kill_node(victim)
        rc = p.wait(timeout=600)  # a hang guard, not a speed figure: 1 CPU per node on a shared machine
    finally:
        if p.poll() is None:
            p.kill()
    out = (tmp_path / "out.log").read_text()
    assert rc == 0, out[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    spare = report["stages"][key]["node"]
    assert report["run"]["status"] == "complete" and spare not in (None, first["node"])
    assert f"ray: node {spare} joined: run folder seen, library versions the driver's" in out
    task = json.loads((run_dir / "ray_tasks.json").read_text())[key]
    assert task["submits"] == 1 and task["committed"] is True  # Ray's retry, not a second submission
    assert [a["node"] for a in task["attempts"]] == [first["node"], spare], task["attempts"]
    assert task["attempts"][0]["attempt"] == first["attempt"] != task["attempt"]
    assert (run_dir / key / "model.safetensors").is_file() and not list((run_dir / ".work" / key).glob("*-*"))
    assert not list(run_dir.rglob("*.tmp"))


def test_a_speed_task_has_its_node_to_itself(cluster, second_node, monkeypatch):
    """The placement rule of pipeline/app/ray_nodes.py on the real cluster, with CPUs not limiting (0.1 each):
    ordinary tasks share a node, nothing runs on a node beside a speed task."""
    import ray

    from pipeline.app.ray_nodes import options_for

    def hold(seconds):
        import time

        import ray

        t0 = time.time()
        time.sleep(seconds)
        return ray.get_runtime_context().get_node_id(), t0, time.time()

    for k, v in AUTH.items():
        monkeypatch.setenv(k, v)
    keys = ["quantize/a", "quantize/b", "validate/a/speed", "quantize/c", "quantize/d", "validate/b/speed"]
    ray.init(address=cluster.address, logging_level="ERROR")
    try:
        task = ray.remote(hold)
        refs = [task.options(**{**options_for(k, None, "cpu", 1), "num_cpus": 0.1}).remote(2) for k in keys]
        spans = dict(zip(keys, ray.get(refs, timeout=120)))
    finally:
        ray.shutdown()

    def overlap(a, b):
        return a[0] == b[0] and a[1] < b[2] and b[1] < a[2]

    ordinary = [k for k in keys if not k.endswith("/speed")]
    assert any(overlap(spans[a], spans[b]) for a in ordinary for b in ordinary if a < b), spans
    for s in ("validate/a/speed", "validate/b/speed"):
        assert not any(overlap(spans[s], spans[k]) for k in keys if k != s), spans


def test_a_node_that_cannot_see_the_run_folder_is_refused_before_any_work(cluster, tmp_path):
    """The second node sees the filesystem under another root (COMPRESS_RAY_PROBE_ROOT in its environment), as a
    node without the shared mount would: it cannot read the driver's probe file."""
    port = cluster.add_node({"COMPRESS_RAY_PROBE_ROOT": str(tmp_path / "elsewhere")})
    try:
        p = run_tiny(tmp_path, *RAY_SETS, f'run.ray_address="{cluster.address}"', env=AUTH, rc=4)
    finally:
        cluster.kill_node(port)
    line = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(line) == 1 and "is not on a filesystem node" in line[0], p.stderr[-3000:]
    assert str((tmp_path / "tiny").resolve()) in line[0] and re.search(r"node [0-9a-f]{12} \(", line[0])
    for stage in ("load", "calibrate", "quantize"):
        assert not (tmp_path / "tiny" / stage).exists()
    assert not (tmp_path / "tiny" / ".ray-probe").exists()


def test_an_address_that_does_not_speak_ray_exits_2_within_30_s_naming_it(tmp_path):
    """A port that accepts TCP and says nothing (another service, a stale address): ray.init alone retries it for
    minutes; the run refuses it in under 30 s."""
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held = []

    def accept():
        try:
            while True:
                held.append(server.accept())  # kept open, never answered
        except OSError:  # closed at the end of the test
            pass

    threading.Thread(target=accept, daemon=True).start()
    address = f"127.0.0.1:{server.getsockname()[1]}"
    try:
        t0 = time.time()
        p = run_tiny(tmp_path, *RAY_SETS, f'run.ray_address="{address}"', env=AUTH, rc=2)
        assert time.time() - t0 < 30
    finally:
        server.close()
    assert f"ray_address {address!r}: cannot connect to a Ray cluster" in p.stderr, p.stderr[-3000:]
    assert not (tmp_path / "tiny" / "load").exists()


def test_unreachable_ray_address_exits_2_within_30_s_naming_it(tmp_path):
    port = free_port()
    t0 = time.time()
    p = run_tiny(tmp_path, *RAY_SETS, f'run.ray_address="127.0.0.1:{port}"', rc=2)
    assert time.time() - t0 < 30
    assert f"127.0.0.1:{port}" in p.stderr and "unreachable" in p.stderr

"""The tiny recipe with 4 quantize variants: local executor vs a two-node Ray cluster started on this machine.

    flock /tmp/compress-cpu.lock python -m research.ray_sweep [--out benchmarks/results/ray_sweep.json]

Prints the wall time of each (a fresh run folder each, so no unit is skipped), their ratio, and per unit the
scheduling overhead the driver recorded in <run>/ray_tasks.json: submission -> task start (Ray placement, worker
lease, first-time worker start) and task start -> unit start (the worker rebuilding the unit from the recipe and
importing the stage). The cluster (head + one node, 1 CPU each, loopback) is stopped by its own processes.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import tomli_w

ROOT = Path(__file__).resolve().parents[1]
RAY = Path(sys.executable).parent / "ray"
EXTRA_VARIANTS = [{"name": "gptq-w8g32", "method": "gptq", "bits": 8, "group_size": 32},
                  {"name": "rtn-w8g32", "method": "rtn", "bits": 8, "group_size": 32}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recipe_with_4_variants(folder: Path) -> Path:
    data = tomllib.loads((ROOT / "recipes" / "tiny.toml").read_text())
    data["quantize"] += EXTRA_VARIANTS
    path = folder / "tiny4.toml"
    path.write_text(tomli_w.dumps(data))
    return path


def run(recipe: Path, out: Path, env: dict, *sets: str) -> float:
    args = [sys.executable, "-m", "pipeline.app.cli", "run", str(recipe),
            "--set", f"run.output_dir={json.dumps(str(out))}"]
    for s in sets:
        args += ["--set", s]
    t0 = time.perf_counter()
    p = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"run failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return wall


def start_cluster(temp: Path, env: dict) -> str:
    port = free_port()
    res = json.dumps({"compress_node": 1})
    subprocess.run([RAY, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus", "1",
                    "--resources", res, "--temp-dir", str(temp), "--include-dashboard=false",
                    "--disable-usage-stats"], env=env, check=True, capture_output=True)
    subprocess.run([RAY, "start", "--address", f"127.0.0.1:{port}", "--node-ip-address", "127.0.0.1", "--num-cpus",
                    "1", "--resources", res], env=env, check=True, capture_output=True)
    return f"127.0.0.1:{port}"


def stop_cluster(marks: list[str]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():
                continue
            try:
                if any(m in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace") for m in marks):
                    os.kill(int(d.name), sig)
            except (OSError, ProcessLookupError):
                pass
        time.sleep(1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    a = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_AUTH_MODE": "disabled"}
    with tempfile.TemporaryDirectory(prefix="rb-", dir="/tmp") as tmp:
        tmp = Path(tmp)
        recipe = recipe_with_4_variants(tmp)
        local = run(recipe, tmp / "local", env)
        address = start_cluster(tmp / "ray-tmp", env)
        try:
            ray = run(recipe, tmp / "ray", env, 'run.executor="ray"', f'run.ray_address="{address}"')
        finally:
            stop_cluster([str(tmp / "ray-tmp"), address])
        tasks = json.loads((tmp / "ray" / "tiny" / "ray_tasks.json").read_text())
        report = json.loads((tmp / "ray" / "tiny" / "report.json").read_text())
    sched = {k: t["task_start"] - t["submitted"] for k, t in tasks.items()}
    rebuild = {k: t["unit_start"] - t["task_start"] for k, t in tasks.items()}
    unit = {k: t["unit_end"] - t["unit_start"] for k, t in tasks.items()}
    nodes = sorted({t["node"] for t in tasks.values()})
    print(f"local executor  {local:7.1f} s wall")
    print(f"ray, 2 nodes    {ray:7.1f} s wall   ratio ray/local {ray / local:.2f}   units on {len(nodes)} node(s)")
    print(f"\n{'unit':<32}{'node':<28}{'submit->task s':>15}{'task->unit s':>13}{'unit s':>8}")
    for k in report["stages"]:
        print(f"{k:<32}{tasks[k]['node']:<28}{sched[k]:>15.2f}{rebuild[k]:>13.2f}{unit[k]:>8.2f}")
    print(f"\nmedian submit->task {statistics.median(sched.values()):.2f} s, task->unit "
          f"{statistics.median(rebuild.values()):.2f} s over {len(tasks)} units")
    if a.out:
        Path(a.out).write_text(json.dumps({
            "machine": f"{os.cpu_count()} CPUs", "recipe": "recipes/tiny.toml + " + ", ".join(
                v["name"] for v in EXTRA_VARIANTS), "local_wall_s": round(local, 2), "ray_wall_s": round(ray, 2),
            "ratio_ray_over_local": round(ray / local, 3), "nodes": nodes,
            "units": {k: {"node": tasks[k]["node"], "submit_to_task_s": round(sched[k], 3),
                          "task_to_unit_s": round(rebuild[k], 3), "unit_s": round(unit[k], 3)}
                      for k in report["stages"]}}, indent=2) + "\n")


if __name__ == "__main__":
    main()

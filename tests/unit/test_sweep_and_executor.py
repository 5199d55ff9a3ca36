"""`[run] executor` checks, the Ray executor's placement rules (no cluster), and `compress sweep`'s spec handling."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.base.errors import RecipeError
from pipeline.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny.toml"


def cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "pipeline.app.cli", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def test_executor_defaults_to_local_and_check_imports_no_ray():
    r = load_recipe(TINY)
    assert r.run.executor == "local" and r.run.ray_address is None
    code = ("import sys; from pipeline.recipe import load_recipe; from pipeline.plan import check; "
            f"check(load_recipe({str(TINY)!r})); check(load_recipe({str(TINY)!r}, ['run.executor=\"ray\"'])); "
            "print('ray' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "False", p.stderr


def test_unknown_executor_is_a_recipe_error():
    with pytest.raises(RecipeError, match="executor"):
        load_recipe(TINY, ['run.executor="slurm"'])


def test_check_refuses_ray_without_the_extra(monkeypatch, capsys):
    import importlib.util

    from pipeline.app import cli as cli_mod

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    monkeypatch.setattr(sys, "argv", ["compress", "check", str(TINY), "--set", 'run.executor="ray"'])
    with pytest.raises(SystemExit) as e:
        cli_mod.main()
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "pip install -e '.[ray]'" in err and "executor" in err


def node(mem_gib, cpus=1, gpus=0, compress_node=1, nid="a" * 40):
    res = {"CPU": cpus, "memory": mem_gib * 2**30}
    if gpus:
        res["GPU"] = gpus
    if compress_node:
        res["compress_node"] = compress_node
    return {"NodeID": nid, "NodeManagerAddress": "10.0.0.1", "Alive": True, "Resources": res}


class FakePlan:
    memory = {"load": 3 * 2**30, "quantize/w4": 40 * 2**30, "validate/w4": 2**30}


def test_task_resources_come_from_the_plan_device_and_threads():
    from pipeline.app.ray_executor import options_for

    o = options_for("quantize/w4", FakePlan, "cuda", 4)
    assert o["num_gpus"] == 1 and o["num_cpus"] == 4 and o["memory"] == 40 * 2**30
    assert o["resources"] == {"compress_node": 0.01}
    assert options_for("validate/w4/quality", FakePlan, "cpu", None)["memory"] == 2**30
    speed = options_for("validate/w4/speed", FakePlan, "cpu", None)
    assert speed["resources"] == {"compress_node": 1} and speed["num_gpus"] == 0 and speed["num_cpus"] == 1
    assert "memory" not in options_for("calibrate", FakePlan, "cpu", None)


def test_a_speed_unit_asks_for_the_memory_of_its_model():
    """The plan names a model's figure "validate/<model>"; its speed unit loads that same model."""
    from pipeline.app.ray_executor import options_for

    assert options_for("validate/w4/speed", FakePlan, "cpu", None)["memory"] == 2**30


def test_progress_line_shows_each_node_running_and_done_and_the_queue():
    from pipeline.app.ray_executor import progress_line

    line = progress_line({"quantize/a": "n1 (10.0.0.1)", "quantize/b": "n2 (10.0.0.2)", "quantize/c": None}, 3,
                         {"n1 (10.0.0.1)": 2}, 1)
    assert line.startswith("ray: n1 (10.0.0.1): running quantize/a, 2 done; n2 (10.0.0.2): running quantize/b, 0 done")
    assert "queued 4 (1 submitted: quantize/c, 3 waiting for upstream units); 1 up to date" in line
    assert progress_line({}, 0, {"n1 (x)": 5}) == "ray: n1 (x): running -, 5 done; queued 0 (0 submitted, 0 waiting " \
                                                 "for upstream units)"


def test_a_unit_no_node_can_hold_is_refused_before_the_probe_and_any_task(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from pipeline.app import ray_executor as rx

    calls = []
    monkeypatch.setattr(rx, "connect", lambda address: calls.append("connect"))
    monkeypatch.setattr(rx, "alive_nodes", lambda: [node(8), node(16, nid="b" * 40)])
    monkeypatch.setattr(rx, "probe_nodes", lambda *a, **k: calls.append("probe"))
    ex = rx.RayExecutor(load_recipe(TINY, ['run.executor="ray"']), SimpleNamespace(device="cpu", versions={}), tmp_path,
                        FakePlan)
    with pytest.raises(RecipeError, match="nothing was submitted") as e:
        ex.start(["load", "quantize/w4"])
    assert "quantize/w4 needs 40.00 GiB memory (predicted peak)" in str(e.value) and "16.00 GiB" in str(e.value)
    assert calls == ["connect"] and ex.tasks == {} and not list(tmp_path.iterdir())


def test_a_unit_no_node_can_hold_is_refused_with_the_figures():
    from pipeline.app.ray_executor import refuse_unfit

    refuse_unfit(["load", "validate/w4/quality"], FakePlan, "cpu", 1, [node(8), node(16, nid="b" * 40)])
    with pytest.raises(RecipeError) as e:
        refuse_unfit(["load", "quantize/w4"], FakePlan, "cpu", 1, [node(8), node(16, nid="b" * 40)])
    msg = str(e.value)
    assert "quantize/w4 needs 40.00 GiB" in msg and "16.00 GiB" in msg and "load" not in msg.split("\n", 1)[1]
    with pytest.raises(RecipeError, match="1 GPU"):
        refuse_unfit(["load"], FakePlan, "cuda", 1, [node(64)])
    with pytest.raises(RecipeError, match="compress_node"):
        refuse_unfit(["load"], FakePlan, "cpu", 1, [node(64, compress_node=0)])


def spec(tmp_path, text):
    p = tmp_path / "sweep.toml"
    p.write_text(text)
    return p


def test_matrix_spec_expands_every_combination(tmp_path):
    from pipeline.app.sweep import load_all, parse_spec

    p = spec(tmp_path, f'[sweep]\nrecipe = "{TINY}"\nset = [\'run.output_dir="{tmp_path}"\']\n'
             '[sweep.matrix]\n"quantize.0.bits" = [3, 4]\n"run.seed" = [0, 1]\n')
    runs = parse_spec(p)
    assert [r.slug for r in runs] == ["bits3-seed0", "bits3-seed1", "bits4-seed0", "bits4-seed1"]
    checked = load_all(runs)
    assert [r.run.name for _, r, _ in checked] == ["tiny-bits3-seed0", "tiny-bits3-seed1", "tiny-bits4-seed0",
                                                  "tiny-bits4-seed1"]
    assert [(r.quantize[0].bits, r.run.seed) for _, r, _ in checked] == [(3, 0), (3, 1), (4, 0), (4, 1)]


def test_sweep_unknown_key_exits_2_naming_it_and_runs_nothing(tmp_path):
    p = spec(tmp_path, f'[sweep]\nrecipes = ["{TINY}"]\nparallel = 3\n')
    r = cli("sweep", p, "--set", f"run.output_dir={json.dumps(str(tmp_path / 'out'))}")
    assert r.returncode == 2 and "sweep.parallel" in r.stderr
    assert not (tmp_path / "out").exists()


def test_sweep_with_a_recipe_failing_check_exits_2_naming_it_and_runs_nothing(tmp_path):
    p = spec(tmp_path, f'[sweep]\nrecipe = "{TINY}"\n[sweep.matrix]\n"quantize.0.bits" = [4, 7]\n')
    r = cli("sweep", p, "--set", f"run.output_dir={json.dumps(str(tmp_path / 'out'))}")
    assert r.returncode == 2, r.stderr
    assert "--set quantize.0.bits=7" in r.stderr and "nothing was run" in r.stderr
    assert not (tmp_path / "out").exists()


def test_sweep_matrix_key_unknown_to_the_recipe_is_refused_naming_the_run(tmp_path):
    from pipeline.app.sweep import load_all, parse_spec

    p = spec(tmp_path, f'[sweep]\nrecipe = "{TINY}"\n[sweep.matrix]\n"quantize.0.bitz" = [4]\n')
    with pytest.raises(RecipeError) as e:
        load_all(parse_spec(p))
    assert "--set quantize.0.bitz=4" in str(e.value) and "nothing was run" in str(e.value)


def test_sweep_runs_sharing_a_folder_are_refused(tmp_path):
    p = spec(tmp_path, f'[sweep]\nrecipes = ["{TINY}", "{TINY}"]\n')
    r = cli("sweep", p, "--set", f"run.output_dir={json.dumps(str(tmp_path / 'out'))}")
    assert r.returncode == 2 and "would share the run folder" in r.stderr


def _recipe_in(path: Path, output_dir: str) -> None:
    """tiny.toml with its run folder under `output_dir`."""
    path.write_text(TINY.read_text().replace("[run]\n", f"[run]\noutput_dir = {json.dumps(output_dir)}\n", 1))


def test_sweep_runs_spelling_one_folder_two_ways_are_refused(tmp_path, monkeypatch):
    """"out" and "$PWD/out" (or "sub/../out") are one folder: the second run would delete the first's exports.
    Two recipes that differ only in that spelling: exit 2 naming both, nothing run."""
    _recipe_in(tmp_path / "a.toml", "out")
    _recipe_in(tmp_path / "b.toml", str(tmp_path / "out"))
    p = spec(tmp_path, '[sweep]\nrecipes = ["a.toml", "b.toml"]\n')
    r = cli("sweep", p, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert "sweep runs a.toml and b.toml would share the run folder" in r.stderr and "nothing was run" in r.stderr
    assert not (tmp_path / "out").exists()

    from pipeline.app.sweep import load_all, parse_spec

    monkeypatch.chdir(tmp_path)
    _recipe_in(tmp_path / "b.toml", "sub/../out")
    folder = tmp_path.resolve() / "out" / "tiny"
    with pytest.raises(RecipeError, match=re.escape(f"would share the run folder {folder} ")):
        load_all(parse_spec(p))


def test_the_device_of_a_ray_run_is_the_clusters_not_the_drivers():
    """A CPU-only head drives GPU nodes: "auto" follows the nodes' GPUs, "cuda" without any is refused by name."""
    from pipeline.base.errors import StageError
    from pipeline.app.ray_executor import NODE_RESOURCE, cluster_device

    cpu = {"Resources": {"CPU": 8.0, NODE_RESOURCE: 1.0}}
    gpu = {"Resources": {"CPU": 16.0, "GPU": 1.0, NODE_RESOURCE: 1.0}}
    other = {"Resources": {"CPU": 8.0, "GPU": 4.0}}  # a node of the cluster that does not run compress units
    assert cluster_device("auto", [cpu, gpu], "auto") == "cuda"
    assert cluster_device("auto", [cpu, other], "auto") == "cpu"
    assert cluster_device("cpu", [gpu], None) == "cpu"
    assert cluster_device("cuda", [cpu, gpu], "10.0.0.1:6379") == "cuda"
    with pytest.raises(StageError, match=r"device = 'cuda' but no node of the Ray cluster at 'h:1' offers a GPU"):
        cluster_device("cuda", [cpu, other], "h:1")

"""Where the heavy libraries load (tests/unit/test_import_graph.py counts the imports that load late and checks each
says why): `compress check` and `compress --help` load none of them, the run machinery loads them only after
tame() has set the environment they read on import, and the tasks worker only after its offline switches."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "gptqmodel", "auto_round", "lm_eval", "ray", "llama_cpp", "vllm", "bitsandbytes",
         "torchao", "datasets", "matplotlib", "huggingface_hub.constants", "gguf", "numpy", "pyarrow", "fastapi")


def loaded_after(code: str) -> list[str]:
    """The HEAVY modules (and pipeline modules) in sys.modules after running `code` in a fresh interpreter."""
    probe = code + "\nimport sys\nprint(' '.join(m for m in sys.modules if m in HEAVY or m.startswith('pipeline.')))"
    p = subprocess.run([sys.executable, "-c", f"HEAVY = {HEAVY!r}\n{probe}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    return p.stdout.split("\n")[-2].split()


def cli(*args: str) -> str:
    return (f"import sys\nfrom pipeline.app.cli import main\nsys.argv = ['compress', {', '.join(map(repr, args))}]\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert e.code in (0, None), e.code\n")


def test_check_of_the_default_recipe_loads_no_heavy_library():
    got = loaded_after(cli("check", "recipes/default.toml"))
    assert "pipeline.plan" in got and "pipeline.quant.methods.gptq" in got  # it did check the recipe
    assert [m for m in got if m in HEAVY] == []


def test_help_loads_neither_heavy_libraries_nor_the_recipe():
    got = loaded_after(cli("--help"))
    assert "pipeline.app.cli" in got
    assert [m for m in got if m in HEAVY or m in ("pipeline.recipe", "pipeline.plan", "pipeline.app.execute")] == []


def test_the_run_machinery_loads_torch_and_the_hub_client_only_after_tame():
    """pipeline/app/execute.py: tame() first, then torch, the stages (transformers, ...), the renderers and the Hub
    client. Imported before tame(), they would read an environment without its settings."""
    got = loaded_after("import pipeline.app.execute, pipeline.app.sweep, pipeline.app.ray_task, pipeline.base.worker")
    assert [m for m in got if m in HEAVY and m != "ray"] == []
    assert "pipeline.app.units" not in got and "pipeline.stages.load" not in got


def test_the_tasks_worker_loads_datasets_only_after_its_offline_switches():
    """pipeline/eval/tasks.py sets HF_DATASETS_OFFLINE and HF_HUB_OFFLINE, which datasets and the Hub client read
    once, on import: importing the module loads neither (nor lm_eval or transformers, which import them)."""
    got = loaded_after("import pipeline.eval.tasks")
    assert [m for m in got if m in ("datasets", "lm_eval", "transformers", "huggingface_hub.constants")] == []

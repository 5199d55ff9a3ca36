"""Editing one method's file reruns that method's variants and what follows them, nothing else (issue 22), through
the CLI: the session's finished tiny run (gptq-w4g32, rtn-w4g32, a draft verified by gptq-w4g32) is rerun by a copy
of the package whose method files the test edits."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny.toml"


def rerun(src: Path, out: Path) -> dict[str, str]:
    """`compress run` of the tiny recipe from the package copy in src; each stage's status."""
    env = {**os.environ, "PYTHONPATH": str(src), "PYTHONUNBUFFERED": "1"}
    vllm_python = ROOT / ".venv-vllm" / "bin" / "python"
    if vllm_python.exists():  # the copy has no .venv-vllm beside it: the first run's vLLM, or every unit's versions
        env.setdefault("COMPRESS_VLLM_PYTHON", str(vllm_python))  # (which name each engine's) would differ
    p = subprocess.run([sys.executable, "-m", "pipeline.app.cli", "run", RECIPE, "--set",
                        f"run.output_dir={json.dumps(str(out))}"], cwd=src, env=env, capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    report = json.loads((out / "tiny" / "report.json").read_text())
    return {k: s["status"] for k, s in report["stages"].items()}


def edit(src: Path, rel: str) -> None:
    with open(src / "pipeline" / rel, "a") as f:
        f.write("\n# edited\n")


def test_editing_a_method_file_reruns_only_its_variants(tiny_run, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT / "pipeline", src / "pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "calibration", src / "calibration")
    out = tmp_path / "runs"
    shutil.copytree(tiny_run[0], out / "tiny", ignore=shutil.ignore_patterns(".lock"))

    edit(src, "quant/methods/torchao.py")  # a method the recipe does not use
    assert set(rerun(src, out).values()) == {"skipped"}

    edit(src, "quant/methods/gptq.py")
    status = rerun(src, out)
    # gptq-w4g32's units, the draft it verifies, and the exports (every card shows every model's gates)
    follows = {k for k in status if k in ("quantize/gptq-w4g32", "draft", "validate/draft/speculative")
               or k.startswith(("validate/gptq-w4g32/", "export/"))}
    assert {k for k, s in status.items() if s == "done"} == follows, status
    assert {k for k, s in status.items() if s == "skipped"} == set(status) - follows
    assert {"load", "calibrate", "quantize/rtn-w4g32", "validate/rtn-w4g32/quality"} <= set(status) - follows

"""`compress sweep`: a matrix of two tiny runs on the local executor, one passing its gate and one failing it.

Each entry's folder starts as a copy of the session's finished tiny run (tests/e2e/conftest.py), as a rerun of a
sweep finds its folders: the entries differ only in a gate, so every unit resumes (verified, skipped) and each run
judges its own gate. A from-scratch tiny run is what test_tiny_recipe.py and the session fixture already prove.
"""
import json
import shutil

import pytest

from tests.e2e.test_tiny_recipe import RECIPE, compress

pytestmark = pytest.mark.slow


def test_sweep_runs_each_matrix_entry_in_its_own_folder_and_exits_with_the_worst_code(tiny_run, tmp_path):
    folders = {"tiny-max_ppl_ratio2.0": ("complete", 0), "tiny-max_ppl_ratio0.5": ("gates_failed", 5)}
    for name in folders:
        shutil.copytree(tiny_run[0], tmp_path / "runs" / name, ignore=shutil.ignore_patterns(".lock"))
    spec = tmp_path / "sweep.toml"
    spec.write_text(f'[sweep]\nrecipe = "{RECIPE}"\nset = [\'run.output_dir="{tmp_path / "runs"}"\']\n'
                    '[sweep.matrix]\n"validate.gates.max_ppl_ratio" = [2.0, 0.5]\n')
    p = compress("sweep", spec, check_rc=5)
    for name, (status, code) in folders.items():
        report = json.loads((tmp_path / "runs" / name / "report.json").read_text())
        assert report["run"]["status"] == status and report["run"]["exit_code"] == code
        assert report["stages"]["quantize/gptq-w4g32"]["status"] == "skipped"  # resumed: only gates differ
        row = next(ln for ln in p.stdout.splitlines() if ln.startswith(name))
        assert f" {code} " in row and status in row and "(ppl ratio" in row
        assert ("0 failed" if code == 0 else "2 failed") in row
    assert "exit 5 (the worst run's)" in p.stdout

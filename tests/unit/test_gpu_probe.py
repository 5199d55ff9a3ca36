"""`compress check` names the GPU it would use without importing torch itself, and refuses run.device = 'cuda'
where this environment's torch cannot use one (a fake nvidia-smi stands in for the driver here)."""
import os
import subprocess
import sys
from pathlib import Path

from pipeline.base.gpu_probe import probe

ROOT = Path(__file__).resolve().parents[2]


def fake_smi(tmp_path: Path, line: str) -> dict:
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(f"#!/bin/sh\necho '{line}'\n")
    smi.chmod(0o755)
    return {**os.environ, "PATH": f"{smi.parent}{os.pathsep}{os.environ['PATH']}"}


def test_a_visible_gpu_with_a_cpu_only_torch_is_named_and_not_usable(tmp_path, monkeypatch):
    env = fake_smi(tmp_path, "NVIDIA H200, 143771")
    monkeypatch.setenv("PATH", env["PATH"])
    gpu = probe()
    assert gpu.name == "NVIDIA H200" and gpu.memory_bytes == 143771 * 2**20
    assert gpu.torch_cuda is False and "has no CUDA" in gpu.note  # this machine's torch is the CPU build


def test_no_nvidia_smi_means_no_gpu(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert probe() is None


def test_check_refuses_cuda_without_a_usable_gpu_and_stays_torch_free(tmp_path):
    env = fake_smi(tmp_path, "NVIDIA H200, 143771")
    code = ("import sys, runpy; sys.argv = ['compress', 'check', 'recipes/tiny.toml', '--set', 'run.device=\"cuda\"'];"
            "import pipeline.app.cli as c\ntry:\n    c.main()\nfinally:\n    print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "[run].device = 'cuda': torch" in p.stderr and "has no CUDA" in p.stderr
    assert p.stdout.strip().endswith("NO-TORCH")
    auto = subprocess.run([sys.executable, "-m", "pipeline.app.cli", "check", "recipes/tiny.toml"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert auto.returncode == 0 and "device    cpu (NVIDIA H200, 140 GiB); torch" in auto.stdout

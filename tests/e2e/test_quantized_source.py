"""A compressed-tensors checkpoint from elsewhere as `[model] source`: the layout llm-compressor writes (its
compressor's config and tensor names, an FP8 KV cache's `self_attn.k_scale`/`v_scale`, a `recipe.yaml` beside),
made here with compressed-tensors itself, and a folder llm-compressor 0.14 wrote (tests/fixtures; it cannot be
installed beside our stack, so it ran in its own venv). `compress run` keeps
its files as written and evaluates it like any checkpoint: its perplexity is the one this folder gives when loaded
directly, with int8 activations and the FP8 KV cache applied (not a re-encoded or dequantized copy)."""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from pydantic import TypeAdapter

from pipeline.quant.registry import QuantVariant
from tests.serve_helpers import tiny_export

ROOT = Path(__file__).resolve().parents[2]
RECIPE_YAML = """default_stage:
  default_modifiers:
    QuantizationModifier:
      targets: [Linear]
      ignore: [lm_head]
      scheme: W8A8
      kv_cache_scheme: {num_bits: 8, type: float, strategy: tensor, dynamic: false, symmetric: true}
"""


def _nll(folder: Path, run: Path) -> float:
    from safetensors.torch import load_file

    from pipeline.eval.perplexity import gptq_windows, perplexity, windowed_nll
    from pipeline.quant.checkpoint import load_checkpoint

    ids = load_file(run / "validate" / "baseline" / "quality" / "eval_ids.safetensors")
    ids = next(iter(ids.values()))
    model = load_checkpoint(folder)
    return perplexity(*windowed_nll(model, ids, gptq_windows(ids.numel(), 64, 2)))


def _run_with_source(src: Path, tmp_path: Path) -> Path:
    """`compress run` of a recipe whose [model] source is SRC (no variants: the baseline is SRC, evaluated)."""
    (tmp_path / "r.toml").write_text(f"""
[run]
name = "ct-source"
seed = 0
threads = 1
output_dir = "{tmp_path / 'out'}"

[model]
source = "{src}"

[calibration]
dataset = "c4"
num_samples = 4
seq_len = 64

[validate.perplexity]
dataset = "wikitext2"
seq_len = 64
max_windows = 2

[validate.speed]
enabled = false
""")
    p = subprocess.run([sys.executable, "-m", "pipeline.app.cli", "run", str(tmp_path / "r.toml")], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-4000:]
    return tmp_path / "out" / "ct-source"


def _without(src: Path, out: Path, drop) -> Path:
    """A copy of SRC whose quantization_config lost what `drop` deletes from it."""
    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    drop(config["quantization_config"])
    (out / "config.json").write_text(json.dumps(config))
    return out


def _evaluated_as_written(src: Path, tmp_path: Path) -> tuple[Path, float]:
    """Run SRC as [model] source: its files kept as written, its figure the one SRC gives loaded directly, and the
    FP8 KV cache in that figure (without the kv_cache_scheme the folder scores differently)."""
    run = _run_with_source(src, tmp_path)
    report = json.loads((run / "report.json").read_text())
    assert "already quantized: compressed-tensors" in report["model"]["provenance"]
    info = json.loads((run / "load" / "model_info.json").read_text())
    assert info["weights"].startswith("quantized checkpoint kept as written")
    assert (run / "load" / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert json.loads((run / "load" / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    ppl = report["baseline"]["perplexity"]["value"]
    assert abs(ppl - _nll(src, run)) < 1e-6 * ppl  # the folder as written, loaded directly: the same figure
    plain = _without(src, tmp_path / "without-kv", lambda q: q.pop("kv_cache_scheme"))
    assert abs(_nll(plain, run) - ppl) > 1e-5 * ppl  # and that figure has the FP8 KV cache in it
    return run, ppl


def test_a_compressed_tensors_folder_from_elsewhere_is_evaluated_as_written(tmp_path):
    from pipeline.quant.api import quantize_variant

    base = tiny_export(tmp_path / "tiny")
    src = tmp_path / "llmc-w8a8-kv"
    v = TypeAdapter(QuantVariant).validate_python({"method": "w8a8", "name": "w8a8", "kv_cache": "fp8"})
    calib = torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(0))
    quantize_variant(base, v, calib, src, logging.getLogger("t"), 0)
    for f in ("manifest.json", "metrics.json", "compressed_tensors.log"):  # ours, not in another tool's folder
        (src / f).unlink(missing_ok=True)
    (src / "recipe.yaml").write_text(RECIPE_YAML)
    for f in base.glob("tokenizer*"):
        shutil.copyfile(f, src / f.name)
    _evaluated_as_written(src, tmp_path)


def test_a_folder_llm_compressor_wrote_is_evaluated_as_written(tmp_path):
    """tests/fixtures/llmcompressor-w8a8-kv: the tiny Llama quantized by llm-compressor 0.14 itself (compressed-tensors
    0.19, W8A8 with an FP8 KV cache; `benchmarks/llmcompressor_anchor.py fixture` made it in llm-compressor's own
    venv). Kept as written and scored with its int8 activations and FP8 cache applied: dropping either changes it."""
    fixture = ROOT / "tests" / "fixtures" / "llmcompressor-w8a8-kv"
    made = json.loads((fixture / "llmcompressor_run.json").read_text())
    assert made["versions"]["llmcompressor"].startswith("0.14") and made["scheme"] == "w8a8-kv"
    src = tmp_path / "llmc"
    shutil.copytree(fixture, src)  # the load stage hard-links the weights: never into the repository's copy
    run, ppl = _evaluated_as_written(src, tmp_path)
    weights_only = _without(src, tmp_path / "no-act", lambda q: [g.update(input_activations=None)
                                                               for g in q["config_groups"].values()])
    assert abs(_nll(weights_only, run) - ppl) > 1e-5 * ppl  # int8 activations are in the figure

"""A compressed-tensors checkpoint from elsewhere as `[model] source`: the layout llm-compressor writes (its
compressor's config and tensor names, an FP8 KV cache's `self_attn.k_scale`/`v_scale`, a `recipe.yaml` beside),
made here with compressed-tensors itself (llm-compressor cannot be installed beside our stack). `compress run` keeps
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
    run = tmp_path / "out" / "ct-source"
    report = json.loads((run / "report.json").read_text())
    assert "already quantized: compressed-tensors" in report["model"]["provenance"]
    info = json.loads((run / "load" / "model_info.json").read_text())
    assert info["weights"].startswith("quantized checkpoint kept as written")
    assert (run / "load" / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert json.loads((run / "load" / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    ppl = report["baseline"]["perplexity"]["value"]
    assert abs(ppl - _nll(src, run)) < 1e-6 * ppl  # the folder as written, loaded directly: the same figure
    plain = tmp_path / "without-kv"
    shutil.copytree(src, plain)
    config = json.loads((plain / "config.json").read_text())
    del config["quantization_config"]["kv_cache_scheme"]
    (plain / "config.json").write_text(json.dumps(config))
    assert abs(_nll(plain, run) - ppl) > 1e-5 * ppl  # and that figure has the FP8 KV cache in it

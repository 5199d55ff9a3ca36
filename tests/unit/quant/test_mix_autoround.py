"""[quantize.mix] on an AutoRound variant: the allocation goes to auto-round as its layer_config, its GPTQ-format
export carries per-module settings (our GPTQModel overrides in place of auto-round's, checked equal, so vLLM also
finds them under its fused names), the checkpoint holds each unit's bits, spends what the file measures, and
reloads through GPTQModel. The tiny random Llama, 4 tuning steps."""
from __future__ import annotations

import json
import logging

import pytest
import torch
from pydantic import TypeAdapter

from pipeline.base.env import tame
from pipeline.eval.bits import linear_bits_per_weight
from pipeline.quant.registry import QuantVariant, check_variant
from pipeline.quant.shapes import linear_shapes_from_config
from tests.problems import keys
from tests.tiny_models import tiny_llama

tame()
VOCAB = 512
CALIB = torch.randint(0, VOCAB, (8, 64), generator=torch.Generator().manual_seed(0))
PROBE = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))


def variant(**mix):
    return TypeAdapter(QuantVariant).validate_python(
        {"name": "ar-mix", "method": "autoround", "bits": 4, "group_size": 32, "iters": 4, "torch_compile": False,
         "mix": {"budget": {"bits_per_weight": 6.0}, "bits": [4, 8], "group_sizes": [32], "probe_rows": 2,
                 "hessian_rows": 4, "granularity": "block", **mix}})


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    from pipeline.quant.api import quantize_variant

    root = tmp_path_factory.mktemp("ar-mix")
    tiny = tiny_llama(root / "tiny", VOCAB)
    out = root / "ar-mix"
    manifest = quantize_variant(tiny, variant(), CALIB, out, logging.getLogger("test"), seed=0)
    return tiny, out, manifest


def test_the_export_carries_each_units_bits(mixed):
    from safetensors import safe_open

    _, out, manifest = mixed
    allocation = manifest["mix"]["allocation"]
    assert {a["bits"] for a in allocation.values()} == {4, 8}, allocation
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "gptq" and qc["dynamic"] == json.loads((out / "mix.json").read_text())["dynamic"]
    assert any("gate_up_proj" in k or "qkv_proj" in k for k in qc["dynamic"])  # vLLM's fused names too
    checked = 0
    with safe_open(out / "model.safetensors", "pt") as f:
        for key in [k for k in f.keys() if k.endswith(".qweight")]:  # noqa: SIM118 - safe_open is not iterable
            name = key.removesuffix(".qweight")
            (a,) = [a for unit, a in allocation.items() if f".{unit}." in f".{name}."]
            in_f = f.get_slice(f"{name}.g_idx").get_shape()[0]
            assert f.get_slice(key).get_shape()[0] == in_f * a["bits"] // 32, name
            checked += 1
    assert checked == 2 * 7


def test_it_spends_what_the_file_measures_and_reloads(mixed):
    from pipeline.quant.checkpoint import load_checkpoint

    tiny, out, manifest = mixed
    assert linear_bits_per_weight(out) == pytest.approx(manifest["mix"]["spent"]["bits_per_weight"], abs=1e-3)
    with torch.no_grad():
        got = load_checkpoint(out)(PROBE).logits.float()
        base = load_checkpoint(tiny)(PROBE).logits.float()
    assert torch.isfinite(got).all() and (got.argmax(-1) == base.argmax(-1)).float().mean() > 0.5


def test_check_refuses_a_gptq_solved_probe_for_autoround():
    arch = linear_shapes_from_config({"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
                                      "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                                      "vocab_size": 49152, "tie_word_embeddings": True})
    problems = check_variant(variant(probe_weights="gptq"), arch, "cpu")
    assert ("mix.probe_weights", "autoround-mix-probe") in keys(problems)

"""A [quantize.mix] variant in compressed-tensors (issue #35's "compressed-tensors config groups"): one config group
per (bits, group size), each naming its linears; the same integers and scales as the GPTQ-format mix, bit for bit;
reloaded through transformers with the exact dequantized weights; and its budget counted in the layout it writes
(no g_idx, no zero points when symmetric), which pipeline/eval/bits.py measures on the folder."""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from pydantic import TypeAdapter

from pipeline.base.env import tame
from pipeline.eval.bits import linear_bits_per_weight
from pipeline.quant.api import implementation, quantize_variant
from pipeline.quant.formats.ct_export import convert_folder, dequantized, gptq_integers
from pipeline.quant.registry import QuantVariant
from tests.tiny_models import tiny_llama

tame()
VOCAB = 512
CALIB = torch.randint(0, VOCAB, (8, 64), generator=torch.Generator().manual_seed(0))
PROBE = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
MIX = {"bits": [4, 8], "group_sizes": [32, 64], "probe_rows": 4, "hessian_rows": 8}


def make(name: str, fmt: str, bpw: float):
    return TypeAdapter(QuantVariant).validate_python(
        {"name": name, "method": "gptq", "bits": 4, "group_size": 64, "mse": 0.0, "format": fmt,
         "mix": {**MIX, "budget": {"bits_per_weight": bpw}}})


def setting_of(allocation: dict, module: str) -> tuple[int, int]:
    """The (bits, group_size) the allocation gave the unit a linear ('model.layers.0.mlp.up_proj') belongs to."""
    (a,) = [a for unit, a in allocation.items() if f".{unit}." in f".{module}."]
    return a["bits"], a["group_size"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The tiny model, a GPTQ-format mix (with its allocation) and that folder converted to compressed-tensors."""
    root = tmp_path_factory.mktemp("mix-ct")
    tiny = tiny_llama(root / "tiny", VOCAB)
    v = make("mixed", "gptq", 6.0)
    impl, gptq = implementation(v), root / "mixed"
    gptq.mkdir()
    with impl.session(gptq):
        details = impl.save(impl.quantize(tiny, v, CALIB, sys.stderr, "cpu"), tiny, gptq, v)
    qc = convert_folder(gptq, root / "mixed-ct")
    return tiny, gptq, root / "mixed-ct", details["mix"]["allocation"], qc


def _state(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def gptq_mix_weights(folder: Path, allocation: dict, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    state, out = _state(folder), {}
    for key in [k for k in state if k.endswith(".qweight")]:
        mod = key.removesuffix(".qweight")
        t = {leaf: state[f"{mod}.{leaf}"] for leaf in ("qweight", "qzeros", "scales", "g_idx")}
        q, z, s = gptq_integers(t, *setting_of(allocation, mod))
        out[mod] = dequantized(q, z, s, dtype or s.dtype)
    return out


def ct_mix_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Each linear decompressed by compressed-tensors with the scheme of the config group that names it."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    qc = QuantizationConfig.model_validate(json.loads((folder / "config.json").read_text())["quantization_config"])
    scheme_of = {t: s for s in qc.config_groups.values() for t in s.targets}
    state, out = _state(folder), {}
    for key in [k for k in state if k.endswith(".weight_packed")]:
        mod = key.removesuffix(".weight_packed")
        local = {k.rpartition(".")[2]: v for k, v in state.items() if k.rpartition(".")[0] == mod}
        out[mod] = PackedQuantizationCompressor.decompress(local, scheme_of[mod])["weight"]
    return out


def test_one_config_group_per_setting_naming_its_linears(runs):
    _, _, ct, allocation, qc = runs
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert qc["ignore"] == ["lm_head"]
    settings = {(a["bits"], a["group_size"]) for a in allocation.values()}
    assert len(settings) > 1, f"a budget between the candidates should mix them: {allocation}"
    groups = list(qc["config_groups"].values())
    assert {(g["weights"]["num_bits"], g["weights"]["group_size"]) for g in groups} == settings
    named = [t for g in groups for t in g["targets"]]
    assert len(named) == len(set(named)) == 2 * 7  # every linear of the two layers once, by its full name
    for g in groups:
        for t in g["targets"]:
            assert setting_of(allocation, t) == (g["weights"]["num_bits"], g["weights"]["group_size"]), t


def test_the_compressed_tensors_mix_holds_the_gptq_mix_bit_for_bit(runs):
    _, gptq, ct, allocation, _ = runs
    a, b = gptq_mix_weights(gptq, allocation), ct_mix_weights(ct)
    assert a.keys() == b.keys() and len(a) == 2 * 7
    for mod in a:
        assert a[mod].dtype == b[mod].dtype and torch.equal(a[mod], b[mod]), mod


def test_it_reloads_through_transformers_with_the_exact_dequantized_weights(runs):
    """transformers' own loader reads a config group per setting (GPTQ-format mixes need GPTQModel's loader)."""
    from transformers import AutoModelForCausalLM

    from pipeline.quant.checkpoint import load_checkpoint

    tiny, gptq, ct, allocation, _ = runs
    with torch.no_grad():
        got = load_checkpoint(ct)(PROBE).logits.float()
        dense = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
        for mod, w in gptq_mix_weights(gptq, allocation, torch.float32).items():
            dense.get_submodule(mod).weight.copy_(w)
        want = dense(PROBE).logits.float()
    assert torch.equal(got, want)


def test_a_compressed_tensors_mix_spends_its_budget_in_the_layout_it_writes(runs, tmp_path):
    tiny = runs[0]
    out = quantize_variant(tiny, make("mixed-ct", "compressed-tensors", 6.0), CALIB, tmp_path / "mixed-ct",
                           logging.getLogger("test"), 0, "cpu")
    mix = out["mix"]
    assert mix["spent"]["bits_per_weight"] <= 6.0
    assert linear_bits_per_weight(tmp_path / "mixed-ct") == pytest.approx(mix["spent"]["bits_per_weight"], abs=1e-3)
    assert not list((tmp_path / "mixed-ct").glob("quantize_config.json"))
    qc = json.loads((tmp_path / "mixed-ct" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and len(qc["config_groups"]) > 1
    # the budget in the compressed-tensors layout buys more 8-bit units than the same budget in GPTQ's
    assert sum(a["bits"] == 8 for a in mix["allocation"].values()) >= sum(
        a["bits"] == 8 for a in runs[3].values())

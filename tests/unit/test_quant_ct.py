"""format = "compressed-tensors" on the GPTQ-family variants: the same integers, scales and group size as the GPTQ
format (unpacked both ways, compared bit for bit), the folder reloads through transformers (decompressed at the first
forward), and `compress check` refuses what pack-quantized cannot hold."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import TypeAdapter

from pipeline.base.env import tame
from pipeline.quant.ct_export import dequantized, gptq_integers
from pipeline.quant.registry import QuantVariant, check_variant, reload_of, runtimes, variant_format
from pipeline.quant.shapes import linear_shapes_from_config
from tests.problems import keys, only
from tests.tiny_models import tiny_llama

tame()
VOCAB = 512
CALIB = torch.randint(0, VOCAB, (8, 64), generator=torch.Generator().manual_seed(0))
PROBE = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
ROOT = Path(__file__).resolve().parents[2]
SMOL = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True}
CASES = {  # name: recipe fields (each quantized twice: format "gptq" and "compressed-tensors")
    "gptq-w4g32": {"method": "gptq", "bits": 4, "group_size": 32},
    "rtn-w4g32-asym": {"method": "rtn", "bits": 4, "group_size": 32, "sym": False},
    "rtn-w8-channel": {"method": "rtn", "bits": 8, "group_size": -1},
}


def variant(**kw):
    return TypeAdapter(QuantVariant).validate_python(kw)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    from pipeline.quant.api import quantize_variant

    root = tmp_path_factory.mktemp("ct")
    tiny = tiny_llama(root / "tiny", VOCAB)
    log = logging.getLogger("test")
    out = {}
    for name, fields in CASES.items():
        pair = []
        for fmt in ("gptq", "compressed-tensors"):
            v = variant(name=name, format=fmt, **fields)
            quantize_variant(tiny, v, CALIB, root / f"{name}-{fmt}", log, seed=0)
            pair.append(root / f"{name}-{fmt}")
        out[name] = tuple(pair)
    return out


def _state(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def gptq_weights(folder: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Dequantized weights of a GPTQ folder from its qweight/qzeros/scales, in `dtype` (None: the scales')."""
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    state, out = _state(folder), {}
    for key in [k for k in state if k.endswith(".qweight")]:
        mod = key.removesuffix(".qweight")
        t = {leaf: state[f"{mod}.{leaf}"] for leaf in ("qweight", "qzeros", "scales", "g_idx")}
        q, z, s = gptq_integers(t, qc["bits"], qc["group_size"], qc.get("checkpoint_format", "gptq") == "gptq")
        out[mod] = dequantized(q, z, s, dtype or s.dtype)
    return out


def ct_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Dequantized weights of a compressed-tensors folder through compressed-tensors' own decompressor."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    qc = QuantizationConfig.model_validate(json.loads((folder / "config.json").read_text())["quantization_config"])
    (scheme,) = qc.config_groups.values()
    state, out = _state(folder), {}
    for key in [k for k in state if k.endswith(".weight_packed")]:
        mod = key.removesuffix(".weight_packed")
        local = {k.rpartition(".")[2]: v for k, v in state.items() if k.rpartition(".")[0] == mod}
        out[mod] = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_compressed_tensors_holds_the_gptq_weights_bit_for_bit(folders, name):
    gptq, ct = folders[name]
    fields = CASES[name]
    qc = json.loads((ct / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    (group,) = qc["config_groups"].values()
    w = group["weights"]
    assert (w["num_bits"], w["symmetric"], w["type"]) == (fields["bits"], fields.get("sym", True), "int")
    assert w["group_size"] == (None if fields["group_size"] == -1 else fields["group_size"])
    assert qc["ignore"] == ["lm_head"]
    assert not (ct / "quantize_config.json").exists() and not list(ct.glob(".ct-*"))
    a, b = gptq_weights(gptq), ct_weights(ct)
    assert a.keys() == b.keys() and len(a) == 2 * 7
    for mod in a:
        assert a[mod].dtype == b[mod].dtype and torch.equal(a[mod], b[mod]), mod
    plain_a = {k: v for k, v in _state(gptq).items() if k.rpartition(".")[0] not in a}
    plain_b = {k: v for k, v in _state(ct).items() if k.rpartition(".")[0] not in b}
    assert plain_a.keys() == plain_b.keys() and all(torch.equal(plain_a[k], plain_b[k]) for k in plain_a)


RELOAD = r"""
import sys, json, torch
from pathlib import Path
from pipeline.base.env import tame; tame()
torch.set_num_threads(1)
from pipeline.quant.checkpoint import load_checkpoint
probe = torch.tensor(json.loads(sys.argv[1]))
m = load_checkpoint(Path(sys.argv[2]))
before = sorted({n.rpartition(".")[2] for n, _ in m.named_parameters() if "layers.0.self_attn.q_proj" in n})
with torch.no_grad():
    logits = m(probe).logits.float()
after = {n: str(p.dtype) for n, p in m.named_parameters() if "layers.0.self_attn.q_proj" in n}
torch.save(logits, sys.argv[3])
print(json.dumps({"before": before, "after": after}))
"""


def test_reloads_through_transformers_decompressed_and_matches_the_gptq_weights(folders, tmp_path):
    """Our stages' loader (pipeline/quant/checkpoint.py) on the folder: transformers' compressed-tensors quantizer
    keeps the packed tensors and decompresses them to dense weights at the first forward; the logits are those of
    the GPTQ folder's weights dequantized exactly."""
    from transformers import AutoModelForCausalLM

    gptq, ct = folders["gptq-w4g32"]
    r = subprocess.run([sys.executable, "-c", RELOAD, json.dumps(PROBE.tolist()), str(ct), str(tmp_path / "l.pt")],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen["before"] == ["weight_packed", "weight_scale", "weight_shape"]
    after = seen["after"]  # decompressed: a dense weight in the model's dtype, the packed values gone
    assert after["model.layers.0.self_attn.q_proj.weight"] == "torch.float32"
    assert "model.layers.0.self_attn.q_proj.weight_packed" not in after
    cfg = json.loads((gptq / "config.json").read_text())
    cfg.pop("quantization_config")
    dense = AutoModelForCausalLM.from_pretrained(ct.parent / "tiny", dtype=torch.float32)
    with torch.no_grad():
        for mod, w in gptq_weights(gptq, torch.float32).items():  # the loader's scales are in the model's dtype
            dense.get_submodule(mod).weight.copy_(w)
        want = dense(PROBE).logits.float()
    assert torch.equal(torch.load(tmp_path / "l.pt"), want)


def test_recipe_default_format_is_unchanged():
    v = variant(name="w4", method="gptq")
    assert v.format == "gptq" and variant_format(v) == "gptq" and reload_of(v).load_module == "gptqmodel"
    ct = variant(name="w4", method="gptq", format="compressed-tensors")
    assert variant_format(ct) == "compressed-tensors" and reload_of(ct).load_module == "compressed_tensors"
    assert variant_format(variant(name="a", method="autoround", format="compressed-tensors")) == "compressed-tensors"


def test_check_refuses_act_order_other_bits_and_a_quantized_head():
    smol = linear_shapes_from_config(SMOL)
    ok = variant(name="ct", method="gptq", format="compressed-tensors")
    assert check_variant(ok, smol, "cpu") == []
    assert keys(check_variant(variant(name="ct", method="gptq", format="compressed-tensors", desc_act=True), smol,
                              "cpu")) == [("desc_act", "ct-desc-act")]
    assert check_variant(variant(name="g", method="gptq", desc_act=True), smol, "cpu") == []  # GPTQ format: fine
    assert keys(check_variant(variant(name="ct", method="rtn", format="compressed-tensors", bits=3), smol,
                              "cpu")) == [("bits", "ct-bits-unsupported")]
    assert keys(check_variant(variant(name="ct", method="gptq", format="compressed-tensors", modules_to_skip=[]),
                              smol, "cpu")) == [("modules_to_skip", "ct-lm-head-not-skipped")]


def test_check_names_the_layer_a_group_size_does_not_divide():
    smol = linear_shapes_from_config(SMOL)
    v = variant(name="ct", method="gptq", format="compressed-tensors", group_size=128)  # the W4A16 preset's 128
    p = only(check_variant(v, smol, "cpu"))
    assert (p.path, p.code) == ("group_size", "group-size-does-not-tile")
    assert "self_attn.q_proj" in p.message and "hidden size 576" in p.message and "64" in p.message


def test_compress_check_cli_refuses_desc_act(tmp_path):
    recipe = ROOT / "recipes" / "methods.toml"
    ct = 'quantize.0={name="ct", method="gptq", format="compressed-tensors", desc_act=true}'
    r = subprocess.run([str(Path(sys.executable).parent / "compress"), "check", str(recipe), "--set", ct,
                        "--set", "validate.gates.models={}"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "quantize.0 (ct): desc_act = true with format = 'compressed-tensors'" in r.stdout + r.stderr


def test_runtime_rows_name_the_compressed_tensors_kernels():
    smol = linear_shapes_from_config(SMOL)
    rows = {r["runtime"]: r for r in runtimes(variant(name="ct", method="gptq", format="compressed-tensors"), smol)}
    assert "decompress" in rows["transformers (CPU)"]["kernel"]
    assert "W4A16" in rows["vLLM (CPU)"]["kernel"] and "W4A16" in rows["vLLM (CUDA)"]["kernel"]
    assert "576" in rows["vLLM (CUDA)"]["note"]  # Marlin wants in-features divisible by 128

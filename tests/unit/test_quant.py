"""Every quantization method on a tiny random Llama: quantize, save, reload in a fresh process, compare.

The in-memory model each method produced is run here; the saved folder is reloaded in another
interpreter (transformers, and GPTQModel.load for the GPTQ format) and its logits must match.
"""
from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import TypeAdapter

from pipeline.base.env import tame
from pipeline.quant.api import implementation, quantize_variant
from pipeline.quant.gptqmodel_driver import inference_model
from pipeline.quant.registry import QuantVariant
from tests.tiny_models import tiny_llama

tame()
VOCAB = 512
CALIB = torch.randint(0, VOCAB, (8, 64), generator=torch.Generator().manual_seed(0))
PROBE = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
SKIP_DOWN = ["lm_head", "mlp.down_proj"]
VARIANTS = {  # name: (recipe fields, max |logit diff| in-memory vs reloaded)
    # TorchAtenLinear (what transformers picks for 4-bit on CPU) computes in reduced precision: small tolerance
    "gptq-w4g32": ({"method": "gptq", "bits": 4, "group_size": 32}, 2e-2),
    "gptq-w8": ({"method": "gptq", "bits": 8, "group_size": -1}, 1e-4),
    "gptq-w3-actorder": ({"method": "gptq", "bits": 3, "group_size": 32, "desc_act": True,
                          "modules_to_skip": SKIP_DOWN}, 1e-4),
    "gptq-w4g32-foem": ({"method": "gptq", "bits": 4, "group_size": 32, "gptaq_alpha": 0.25, "foem_beta": 0.2}, 2e-2),
    "rtn-w4g32": ({"method": "rtn", "bits": 4, "group_size": 32}, 2e-2),
    "bnb-int8": ({"method": "bnb-int8"}, 1e-4),
    "bnb-nf4": ({"method": "bnb-nf4", "modules_to_skip": SKIP_DOWN}, 1e-4),
    "bnb-fp4": ({"method": "bnb-fp4", "double_quant": False, "compute_dtype": "bfloat16"}, 1e-4),
}
GPTQ_FORMAT = [n for n, (f, _) in VARIANTS.items() if f["method"] in ("gptq", "rtn")]


def make_variant(name: str, **fields):
    return TypeAdapter(QuantVariant).validate_python({"name": name, **fields})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("tiny-llama"), VOCAB)


def quantize_in_memory(base: Path, name: str, out: Path) -> torch.Tensor:
    """Quantize + save through the method's module; logits of the in-memory quantized model."""
    fields, _ = VARIANTS[name]
    v = make_variant(name, **fields)
    impl = implementation(v)
    out.mkdir()
    with impl.session(out):
        model = impl.quantize(base, v, CALIB, sys.stderr, "cpu")
        impl.save(model, base, out, v)
        # GPTQ format: GPTQModel's in-memory model with its loader's zero-point conversion.
        # bnb: the model object itself, run after the save (see the note in pipeline/quant/methods/bnb.py)
        runnable = inference_model(model) if fields["method"] in ("gptq", "rtn") else model
        with torch.no_grad():
            return runnable(PROBE).logits.float()


RELOAD = r"""
import sys, json, torch
from pipeline.base.env import tame; tame()
torch.set_num_threads(1)
from transformers import AutoModelForCausalLM
probe = torch.tensor(json.loads(sys.argv[1]))
for d in sys.argv[2:]:
    with torch.no_grad():
        m = AutoModelForCausalLM.from_pretrained(d)
        torch.save(m(probe).logits.float(), f"{d}/reload_transformers.pt")
        kinds = {type(mod).__name__ for mod in m.modules() if "Linear" in type(mod).__name__}
        json.dump(sorted(kinds), open(f"{d}/reload_kinds.json", "w"))
        if "quantization_config" in m.config.to_dict() and m.config.quantization_config.quant_method == "gptq":
            from gptqmodel import GPTQModel
            g = GPTQModel.load(d, device="cpu", dtype=torch.float16)
            torch.save(g.model(probe).logits.float(), f"{d}/reload_gptqmodel.pt")
"""


@pytest.fixture(scope="module")
def checkpoints(tiny, tmp_path_factory) -> dict[str, tuple[Path, torch.Tensor]]:
    root = tmp_path_factory.mktemp("quantized")
    out = {name: (root / name, quantize_in_memory(tiny, name, root / name)) for name in VARIANTS}
    dirs = [str(d) for d, _ in out.values()]
    r = subprocess.run([sys.executable, "-c", RELOAD, json.dumps(PROBE.tolist()), *dirs], capture_output=True,
                       text=True, cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_reloaded_in_a_fresh_process_matches_in_memory(checkpoints, name):
    folder, in_memory = checkpoints[name]
    reloaded = torch.load(folder / "reload_transformers.pt")
    diff = (reloaded - in_memory).abs().max().item()
    assert diff <= VARIANTS[name][1], f"{name}: max |logit diff| {diff:.2e}"
    files = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= files
    assert not any(f.endswith((".bin", ".pt.tmp")) or f.startswith(".gptqmodel") for f in files)


@pytest.mark.parametrize("name", GPTQ_FORMAT)
def test_gptq_format_checkpoint_loads_with_transformers_and_gptqmodel(checkpoints, name):
    from safetensors import safe_open

    folder, _ = checkpoints[name]
    fields, _ = VARIANTS[name]
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["bits"], qc["group_size"], qc["desc_act"], qc["sym"]) == \
        ("gptq", fields["bits"], fields["group_size"], fields.get("desc_act", False), True)
    with safe_open(folder / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    for t in ("qweight", "qzeros", "scales", "g_idx"):
        assert f"model.layers.0.self_attn.q_proj.{t}" in keys
    transformers_logits = torch.load(folder / "reload_transformers.pt")
    gptqmodel_logits = torch.load(folder / "reload_gptqmodel.pt")  # float16 activations: loose tolerance
    assert (transformers_logits - gptqmodel_logits).abs().max().item() < 5e-2


def test_skipped_modules_stay_full_precision(checkpoints):
    from safetensors import safe_open

    for name in ("gptq-w3-actorder", "bnb-nf4"):
        with safe_open(checkpoints[name][0] / "model.safetensors", "pt") as f:
            keys = set(f.keys())
            assert f.get_tensor("model.layers.1.mlp.down_proj.weight").dtype == torch.float32
        assert not any(k.startswith("model.layers.1.mlp.down_proj.") and not k.endswith(".weight") for k in keys)
        assert any(k.startswith("model.layers.1.mlp.up_proj.") and not k.endswith(".weight") for k in keys)


def test_kernels_chosen_on_reload(checkpoints):
    kinds = {n: json.loads((checkpoints[n][0] / "reload_kinds.json").read_text()) for n in VARIANTS}
    assert "TorchAtenLinear" in kinds["gptq-w4g32"]  # what capabilities.runtimes() promises for w4 on CPU
    assert "TorchLinear" in kinds["gptq-w8"]
    assert "Linear8bitLt" in kinds["bnb-int8"] and "Linear4bit" in kinds["bnb-nf4"]


def dequantized(folder: Path, module: str) -> torch.Tensor:
    """[out, in] float weight of one GPTQ-format module, from the saved tensors (v1 zero points)."""
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", "pt") as f:
        qweight, qzeros, scales, g_idx = (f.get_tensor(f"{module}.{t}")
                                          for t in ("qweight", "qzeros", "scales", "g_idx"))
    shifts = torch.arange(0, 32, 4)
    w = ((qweight[:, None, :] >> shifts[None, :, None]) & 15).reshape(-1, qweight.shape[1])  # [in, out]
    z = ((qzeros[:, :, None] >> shifts[None, None, :]) & 15).reshape(qzeros.shape[0], -1) + 1  # v1 stores zero-1
    return ((w - z[g_idx.long()]) * scales[g_idx.long()].float()).T


def test_rtn_is_round_to_nearest_on_the_min_max_grid(checkpoints, tiny):
    from safetensors.torch import load_file

    base = load_file(tiny / "model.safetensors")
    name = "model.layers.0.mlp.gate_proj"
    w = base[f"{name}.weight"].reshape(256, -1, 32)  # [out, groups, 32]
    scale = w.abs().amax(-1, keepdim=True) * 2 / 15  # symmetric: zero point fixed at 8
    expected = ((w / scale).round().clamp(-8, 7) * scale.half().float()).reshape(256, 128)  # scales saved fp16
    got = dequantized(checkpoints["rtn-w4g32"][0], name)
    assert (got - expected).abs().max().item() < 1e-6
    gptq = dequantized(checkpoints["gptq-w4g32"][0], name)
    assert not torch.equal(gptq, got)  # GPTQ's error feedback moves weights off the nearest grid point


def test_gptq_beats_rtn_on_the_calibration_text(checkpoints, tiny):
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(tiny)(PROBE).logits
    err = {n: (torch.load(checkpoints[n][0] / "reload_transformers.pt") - ref).pow(2).mean().item()
           for n in ("gptq-w4g32", "rtn-w4g32")}
    assert err["gptq-w4g32"] < err["rtn-w4g32"], err


def sha256s(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())
            if not p.name.endswith(".log")}


def test_quantize_variant_is_deterministic_and_writes_only_its_folder(tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    v = make_variant("w4", method="gptq", bits=4, group_size=32, desc_act=True)
    log = logging.getLogger("test")
    manifests = [quantize_variant(tiny, v, CALIB, tmp_path / f"run{i}", log, seed=0) for i in (1, 2)]
    first, second = sha256s(tmp_path / "run1"), sha256s(tmp_path / "run2")
    assert first == second and "model.safetensors" in first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run1", "run2"]  # no logs/ in the working directory
    m = manifests[0]
    assert (m["method"], m["engine"], m["params"]["desc_act"]) == ("gptq", "gptqmodel", True)
    assert m["calibration"]["sha256"] == hashlib.sha256(CALIB.numpy().tobytes()).hexdigest()
    assert m["time_s"] > 0 and m["peak_rss_above_baseline_bytes"] >= 0 and m["engine_version"]
    assert "self_attn.q_proj" in (tmp_path / "run1" / "gptqmodel.log").read_text()  # its per-module loss table


@pytest.mark.parametrize("fields", [{"group_size": 32}, {"group_size": 32, "desc_act": True, "sym": False},
                                    {"group_size": 16, "act_group_aware": False},
                                    {"group_size": 32, "gptaq_alpha": 0.25, "foem_beta": 0.2}])
def test_skipping_the_discarded_scale_search_leaves_every_byte_as_the_library_writes_it(tiny, tmp_path, monkeypatch,
                                                                                      fields):
    """pipeline/quant/gptq_search.py: GPTQ with mse > 0, through the pipeline and through the library's own
    find_params."""
    import contextlib

    from pipeline.quant import gptqmodel_driver

    monkeypatch.chdir(tmp_path)
    v = make_variant("w", method="gptq", bits=4, mse=2.4, **fields)
    log = logging.getLogger("test")
    quantize_variant(tiny, v, CALIB, tmp_path / "ours", log, seed=0)
    monkeypatch.setattr(gptqmodel_driver, "group_search_only", contextlib.nullcontext)
    quantize_variant(tiny, v, CALIB, tmp_path / "library", log, seed=0)
    assert sha256s(tmp_path / "ours")["model.safetensors"] == sha256s(tmp_path / "library")["model.safetensors"]


def test_group_search_only_answers_whole_matrices_with_the_plain_range_and_restores_the_library():
    from gptqmodel.quantization.config import QuantizeConfig
    from gptqmodel.quantization.quantizer import Quantizer

    from pipeline.quant.gptq_search import group_search_only

    library = Quantizer.find_params
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(2))

    def params(mse: float, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = Quantizer(qcfg=QuantizeConfig(bits=4, group_size=32, sym=True, mse=mse))
        q.configure(perchannel=True)
        q.find_params(x, weight=True)
        return q.scale.clone(), q.zero.clone()

    plain = params(0.0, w)
    assert not torch.equal(params(2.4, w)[0], plain[0]), "the search moves some scale (else this proves nothing)"
    with group_search_only(), group_search_only():  # re-entrant
        assert torch.equal(params(2.4, w)[0], plain[0])  # 3 groups of 32: the call GPTQ overwrites
        group = w[:, :32]
        mine = params(2.4, group)  # one group: searched as the library searches it
    assert Quantizer.find_params is library
    assert torch.equal(mine[0], params(2.4, group)[0]) and torch.equal(mine[1], params(2.4, group)[1])
    assert not torch.equal(mine[0], params(0.0, group)[0])


@pytest.mark.parametrize("name", ["gptq-w4g32", "gptq-w3-actorder"])
def test_dequantize_to_linear_matches_the_kernel_and_is_shape_invariant(checkpoints, name):
    from gptqmodel.nn_modules.qlinear import BaseQuantLinear
    from transformers import AutoModelForCausalLM

    from pipeline.quant.gptqmodel_driver import dequantize_to_linear

    folder, in_memory = checkpoints[name]
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert dequantize_to_linear(model) > 0
    assert not any(isinstance(m, BaseQuantLinear) for m in model.modules())
    with torch.no_grad():
        full = model(PROBE).logits.float()
        prefix = model(PROBE[:, :-1], use_cache=True)
        last = model(PROBE[:, -1:], past_key_values=prefix.past_key_values).logits[:, -1].float()
    assert (full - in_memory).abs().max() < VARIANTS[name][1]  # same weights as the quantized model
    assert (full[:, -1] - last).abs().max() < 1e-4  # float32: one token at a time = all at once


def test_gptaq_and_foem_reach_the_engine_and_change_the_weights(checkpoints):
    meta = json.loads((checkpoints["gptq-w4g32-foem"][0] / "config.json").read_text())["quantization_config"]["meta"]
    assert meta["foem"]["alpha"] == 0.25 and meta["foem"]["beta"] == 0.2
    from safetensors.torch import load_file

    plain = load_file(checkpoints["gptq-w4g32"][0] / "model.safetensors")
    foem = load_file(checkpoints["gptq-w4g32-foem"][0] / "model.safetensors")
    qweights = [k for k in plain if k.endswith("qweight")]
    assert qweights and any(not torch.equal(plain[k], foem[k]) for k in qweights)


def test_calibration_is_required_for_gptq_only(tiny, tmp_path):
    from pipeline.base.errors import StageError

    log = logging.getLogger("test")
    with pytest.raises(StageError, match="needs calibration ids"):
        quantize_variant(tiny, make_variant("g", method="gptq", group_size=32), None, tmp_path / "g", log, 0)
    m = quantize_variant(tiny, make_variant("r", method="rtn", group_size=32), CALIB, tmp_path / "r", log, 0)
    assert m["calibration"] is None


def test_declared_capabilities_agree_with_gptqmodel_kernels():
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear

    from pipeline.quant.formats.gptq import GPTQ_GROUP_SIZES
    from pipeline.quant.registry import METHODS

    assert set(METHODS.get("gptq").bits) <= set(TorchLinear.SUPPORTS_BITS)
    assert set(GPTQ_GROUP_SIZES) == set(TorchLinear.SUPPORTS_GROUP_SIZE)

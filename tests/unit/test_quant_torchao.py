"""torchao on a tiny random Llama: quantize each CPU scheme, save, reload in a fresh process with the loader
validate uses (pipeline.quant.checkpoint.load_checkpoint), compare; and what `compress check` refuses.

Tolerances. Reloaded vs in-memory: the same int8 data and scales come back from the safetensors and the
same kernel runs them, so the logits should be identical; 1e-5 leaves room for nothing but summation order.
Quantized vs fp32: per-output-channel int8 has a step of max|w_row| / 127, about 3 sigma / 127 for these
random rows, so the rounding error is ~0.7% of the weights' RMS (step / sqrt(12)); int8-dynamic also rounds
each token's activations the same way. Through 2 layers of 6 quantized linears that is ~1% of the logits'
RMS (measured on three probes: 1.0-1.1% weight-only, 1.2-1.4% dynamic). We allow a 3% relative RMS error and
ask the argmax to agree on 90% of the 48 positions (measured 98-100%; random logits are nearly tied).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import TypeAdapter

from pipeline.base.errors import RecipeError, StageError
from pipeline.plan import check
from pipeline.quant.api import implementation
from pipeline.quant.methods.torchao import TORCHAO_SCHEMES
from pipeline.quant.registry import check_variant, runtimes
from pipeline.quant.shapes import linear_shapes_from_config
from pipeline.quant.registry import QuantVariant
from pipeline.recipe import load_recipe
from tests.problems import keys, only

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 512
PROBE = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
CPU_SCHEMES = [s for s, caps in TORCHAO_SCHEMES.items() if "cpu" in caps.kernels]
SKIP = ["lm_head", "mlp.down_proj"]  # a dotted suffix: transformers' own matching would miss it
SMOL = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True}


def variant(**fields):
    return TypeAdapter(QuantVariant).validate_python({"name": "ao", "method": "torchao", **fields})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


RELOAD = r"""
import sys, json, torch
torch.set_num_threads(1)
from pathlib import Path
from pipeline.model.models import folder_bytes
from pipeline.quant.checkpoint import load_checkpoint
probe = torch.tensor(json.loads(sys.argv[1]))
for d in map(Path, sys.argv[2:]):
    m = load_checkpoint(d)
    with torch.no_grad():
        torch.save(m(probe).logits.float(), d / "reload.pt")
    weights = {n: type(mod.weight).__name__ for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear)}
    json.dump({"weights": weights, "footprint": m.get_memory_footprint(), "disk": folder_bytes(d)},
              open(d / "reload.json", "w"))
"""


@pytest.fixture(scope="module")
def quantized(tiny, tmp_path_factory) -> dict:
    """scheme -> (folder, in-memory logits); fp32 logits under 'fp32'. Reloaded once, in one fresh process."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("torchao")
    with torch.no_grad():
        out = {"fp32": (tiny, AutoModelForCausalLM.from_pretrained(tiny)(PROBE).logits.float())}
    for scheme in CPU_SCHEMES:
        v = variant(scheme=scheme, modules_to_skip=SKIP)
        impl, folder = implementation(v), root / scheme
        folder.mkdir()
        with impl.session(folder), torch.no_grad():
            model = impl.quantize(tiny, v, None, sys.stderr, "cpu")
            impl.save(model, tiny, folder, v)
            out[scheme] = (folder, model(PROBE).logits.float())
    r = subprocess.run([sys.executable, "-c", RELOAD, json.dumps(PROBE.tolist()), *(str(root / s) for s in CPU_SCHEMES)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.mark.parametrize("scheme", CPU_SCHEMES)
def test_reloaded_in_a_fresh_process_matches_in_memory(quantized, scheme):
    folder, in_memory = quantized[scheme]
    reloaded = torch.load(folder / "reload.pt")
    assert (reloaded - in_memory).abs().max().item() <= 1e-5
    files = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json"} <= files
    assert not any(f.endswith((".bin", ".pt.tmp", ".pth")) for f in files - {"reload.pt"})
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "torchao"
    assert qc["quant_type"]["default"]["_type"] == TORCHAO_SCHEMES[scheme].config
    if TORCHAO_SCHEMES[scheme].activations:  # the recipe's default grid reached torchao
        assert qc["quant_type"]["default"]["_data"]["act_mapping_type"]["_data"] == "ASYMMETRIC"


@pytest.mark.parametrize("scheme", CPU_SCHEMES)
def test_quantized_logits_stay_close_to_fp32(quantized, scheme):
    fp32 = quantized["fp32"][1]
    q = quantized[scheme][1]
    rel = ((q - fp32).norm() / fp32.norm()).item()
    assert 0 < rel <= 0.03, f"{scheme}: relative RMS logit error {rel:.4f}"
    agree = (q.argmax(-1) == fp32.argmax(-1)).float().mean().item()
    assert agree >= 0.9, f"{scheme}: top-1 agreement {agree:.2f}"


@pytest.mark.parametrize("scheme", CPU_SCHEMES)
def test_skipped_modules_stay_full_precision_after_reload(quantized, scheme):
    weights = json.loads((quantized[scheme][0] / "reload.json").read_text())["weights"]
    assert weights["model.layers.0.mlp.down_proj"] == weights["model.layers.1.mlp.down_proj"] == "Parameter"
    assert weights["lm_head"] == "Parameter"
    assert weights["model.layers.0.self_attn.q_proj"] == weights["model.layers.1.mlp.up_proj"] == "Int8Tensor"


@pytest.mark.parametrize("scheme", CPU_SCHEMES)
def test_footprint_and_size_on_disk_count_int8_bytes(quantized, tiny, scheme):
    """footprint_bytes is what the weights hold (int8 data + per-channel scales), not their nominal fp32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    got = json.loads((quantized[scheme][0] / "reload.json").read_text())
    with torch.device("meta"):
        fp = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny))
    int8 = [m.weight.shape for n, m in fp.named_modules()
            if isinstance(m, torch.nn.Linear) and not n.endswith(("down_proj", "lm_head"))]
    dense = sum(p.numel() * 4 for p in fp.parameters()) + sum(b.numel() * 4 for b in fp.buffers())
    data = dense - sum(o * i * 3 for o, i in int8)  # each quantized weight: 1 byte instead of 4
    per_channel = sum(o for o, _ in int8)
    assert data <= got["footprint"] <= data + 8 * per_channel  # + a scale (and zero point) per output channel
    assert got["footprint"] < 0.6 * dense
    assert got["footprint"] - 8 * per_channel <= got["disk"] <= got["footprint"] + 64 * 1024  # + header metadata


# ---------------------------------------------------------------- what `compress check` refuses


@pytest.fixture(scope="module")
def smol():
    return linear_shapes_from_config(SMOL)


def test_int4_on_cpu_is_refused_with_the_reason(smol):
    p = only(check_variant(variant(scheme="int4-weight-only", group_size=64, dtype="bfloat16"), smol, "cpu"))
    assert (p.path, p.code) == ("scheme", "torchao-scheme-device")
    assert "no CPU kernel" in p.message  # the reason
    assert "gptq" in p.message and "run.device = 'cuda'" in p.message  # what to do instead
    assert check_variant(variant(scheme="int4-weight-only", group_size=64, dtype="bfloat16"), smol, "cuda") == []


def test_settings_torchao_refuses_name_the_key(smol):
    assert keys(check_variant(variant(scheme="int8-weight-only", group_size=64), smol, "cpu")) == [
        ("group_size", "torchao-group-size-unsupported")]
    p = only(check_variant(variant(scheme="int4-weight-only", dtype="bfloat16"), smol, "cuda"))
    assert p.code == "torchao-group-size-unsupported" and "(supported: 32, 64, 128, 256)" in p.message
    p = only(check_variant(variant(scheme="int4-weight-only", group_size=128, dtype="bfloat16"), smol, "cuda"))
    assert p.code == "group-size-does-not-tile" and "576" in p.message  # torchao would silently skip those layers
    p = only(check_variant(variant(scheme="int4-weight-only", group_size=64), smol, "cuda"))
    assert (p.path, p.code) == ("dtype", "torchao-dtype-unsupported") and "set dtype = 'bfloat16'" in p.message
    assert keys(check_variant(variant(scheme="int8-weight-only", act_mapping="symmetric"), smol, "cpu")) == [
        ("act_mapping", "torchao-act-mapping-unused")]
    for scheme in CPU_SCHEMES:
        assert check_variant(variant(scheme=scheme), smol, "cpu") == []
        dumped = variant(**variant(scheme=scheme).model_dump(mode="json"))  # as recipe.lock.toml has it
        assert check_variant(dumped, smol, "cpu") == []
    assert check_variant(variant(scheme="int8-dynamic", act_mapping="symmetric"), smol, "cpu") == []


def test_unknown_scheme_lists_the_known_ones():
    with pytest.raises(Exception) as e:
        variant(scheme="int8-dynamc")
    assert "'int8-dynamic'" in str(e.value) and "int4-weight-only" in str(e.value)


def test_check_exits_2_naming_the_variant(tmp_path):
    recipe = ROOT / "recipes" / "methods.toml"
    int4 = 'quantize.1={name="ao4", method="torchao", scheme="int4-weight-only", group_size=64, dtype="bfloat16"}'
    with pytest.raises(RecipeError) as e:
        check(load_recipe(recipe, [int4, "validate.gates.models={}"]))
    assert keys(e.value.problems) == [("quantize[1].scheme", "torchao-scheme-device")]
    assert str(e.value).startswith("the recipe cannot run:\n  - quantize.1 (ao4): scheme = 'int4-weight-only' ")
    r = subprocess.run([str(Path(sys.executable).parent / "compress"), "check", str(recipe), "--set", int4,
                        "--set", "validate.gates.models={}"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "no CPU kernel for an int4 checkpoint" in r.stdout + r.stderr
    check(load_recipe(recipe))  # the recipe as shipped passes


def test_a_missing_torchao_is_one_line_naming_the_package(smol, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else find_spec(name, *a))
    p = only(check_variant(variant(scheme="int8-dynamic"), smol, "cpu"))
    assert (p.path, p.code) == ("method", "torchao-not-installed")
    assert str(p) == ("method 'torchao' needs the torchao package, which is not installed: "
                      "pip install torchao==0.18.0 (a dependency of compress: pip install -e .)")
    monkeypatch.setitem(sys.modules, "torchao", None)  # `import torchao` raises ImportError
    with pytest.raises(StageError) as e:
        implementation(variant(scheme="int8-dynamic"))
    assert "torchao" in str(e.value) and "\n" not in str(e.value)


def test_runtimes_say_what_serves_each_scheme(smol):
    for scheme, caps in TORCHAO_SCHEMES.items():
        rows = {r["runtime"]: r for r in runtimes(variant(scheme=scheme, group_size=64 if caps.bits == 4 else -1),
                                                  smol)}
        assert rows["vLLM (CUDA)"]["kernel"] == f"torchao ({caps.config})"
        assert rows["llama.cpp"]["kernel"] == rows["GPTQModel"]["kernel"] == "none"
        assert rows["transformers (CUDA)"]["kernel"] == caps.kernels["cuda"]
    cpu4 = runtimes(variant(scheme="int4-weight-only", group_size=64), smol)[0]
    assert cpu4["kernel"] == "none" and "no CPU kernel" in cpu4["note"]


def test_card_tags_and_usage():
    from pipeline.results.card import _usage, _variant_tags
    from pipeline.results.schema import ModelEntry, Report

    entry = ModelEntry(method="torchao", params={"scheme": "int8-dynamic"}, quantize={"engine_version": "0.18.0"})
    assert _variant_tags(entry) == ["torchao", "8-bit", "int8-dynamic"]
    report = Report.model_construct(variants={"ao": entry})
    text = "\n".join(_usage(report, {"kind": "variant", "name": "ao"}, "me/ao"))
    assert "pip install torchao==0.18.0" in text and "no `TorchAoConfig`" in text and "vllm serve me/ao" in text


# ---------------------------------------------------------------- int4 (CUDA only)


@pytest.mark.gpu
def test_int4_on_cuda_reloads_in_a_fresh_process(tiny, tmp_path):
    v = variant(scheme="int4-weight-only", group_size=32, dtype="bfloat16", modules_to_skip=SKIP)
    impl, folder = implementation(v), tmp_path / "int4"
    folder.mkdir()
    probe = PROBE.cuda()
    with torch.no_grad():
        model = impl.quantize(tiny, v, None, sys.stderr, "cuda")
        impl.save(model, tiny, folder, v)
        in_memory = model(probe).logits.float().cpu()
    code = ("import sys, json, torch; from pathlib import Path; from pipeline.quant.checkpoint import load_checkpoint; "
            "m = load_checkpoint(Path(sys.argv[1]), 'cuda'); p = torch.tensor(json.loads(sys.argv[2])).cuda(); "
            "torch.save(m(p).logits.float().cpu(), Path(sys.argv[1]) / 'reload.pt')")
    r = subprocess.run([sys.executable, "-c", code, str(folder), json.dumps(PROBE.tolist())], capture_output=True,
                       text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (torch.load(folder / "reload.pt") - in_memory).abs().max().item() <= 1e-3  # bf16 activations


def test_a_checkpoint_is_the_same_bytes_whatever_order_its_metadata_was_written_in(tmp_path):
    """safetensors writes __metadata__ from a hash map (a new order in every process); torchao writes one entry per
    tensor, so its checkpoints differed run to run in the header alone. canonical_safetensors sorts it."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from pipeline.base.fileio import canonical_safetensors

    tensors = {"a.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b.bias": torch.ones(5)}
    meta = {f"layer.{i}.weight": json.dumps({"_type": "Int8Tensor", "i": i}) for i in range(40)}
    files = []
    for order in (sorted(meta), sorted(meta, reverse=True)):
        path = tmp_path / f"{len(files)}.safetensors"
        save_file(tensors, path, metadata={k: meta[k] for k in order})
        canonical_safetensors(path)
        files.append(path.read_bytes())
    assert files[0] == files[1]
    with safe_open(tmp_path / "0.safetensors", "pt") as f:
        assert f.metadata() == meta  # (a reader returns it in its own hash-map order: the file is sorted)
        assert torch.equal(f.get_tensor("a.weight"), tensors["a.weight"])
        assert torch.equal(f.get_tensor("b.bias"), tensors["b.bias"])
    assert not canonical_safetensors(tmp_path / "0.safetensors"), "a canonical file is left as it is"


@pytest.mark.parametrize("scheme", CPU_SCHEMES)
def test_the_saved_metadata_is_in_sorted_order(quantized, scheme):
    import struct

    path = quantized[scheme][0] / "model.safetensors"
    b = path.read_bytes()
    meta = json.loads(b[8:8 + struct.unpack("<Q", b[:8])[0]])["__metadata__"]
    assert len(meta) > 1 and list(meta) == sorted(meta)

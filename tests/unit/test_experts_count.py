"""pipeline/quant/experts.py: routed experts counted in the written checkpoint, from the safetensors headers."""
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from pipeline.model.architecture import architecture_of
from pipeline.quant.experts import count_experts, experts_problem

ARCH = Path(__file__).resolve().parents[1] / "fixtures" / "arch"


def qwen3_moe():
    return architecture_of(json.loads((ARCH / "qwen3_moe.json").read_text()))


def write(folder, names_dtypes):
    folder.mkdir(exist_ok=True)
    save_file({n: torch.zeros(2, 2, dtype=d) for n, d in names_dtypes.items()}, folder / "model.safetensors")
    return folder


def per_expert(arch, skip=None, fused_gate_up=False):
    out = {}
    for i in range(2):
        for e in range(arch.experts.count):
            leaves = ("gate_up_proj", "down_proj") if fused_gate_up else ("gate_proj", "up_proj", "down_proj")
            for leaf in leaves:
                dtype = torch.bfloat16 if (i, e, leaf) == skip else torch.int32
                out[f"model.layers.{i}.mlp.experts.{e}.{leaf}.{'weight' if dtype == torch.bfloat16 else 'qweight'}"] \
                    = dtype
                out[f"model.layers.{i}.mlp.experts.{e}.{leaf}.scales"] = torch.float16
    return out


def test_every_expert_quantized_counts_all(tmp_path):
    arch = qwen3_moe()
    counted = count_experts(write(tmp_path / "q", per_expert(arch)), arch)
    assert counted == {"declared": 24, "quantized": 24, "unquantized": []} and experts_problem(counted) is None
    fused = count_experts(write(tmp_path / "f", per_expert(arch, fused_gate_up=True)), arch)
    assert fused["quantized"] == 24, "a fused gate_up_proj per expert holds two linears"


def test_one_expert_left_16_bit_is_named(tmp_path):
    arch = qwen3_moe()
    counted = count_experts(write(tmp_path / "q", per_expert(arch, skip=(1, 3, "up_proj"))), arch)
    assert counted["quantized"] == 23 and counted["unquantized"] == ["layer 1 expert 3 up_proj"]
    assert "1 of 24 routed expert linears are not stored quantized in the checkpoint (first: layer 1 expert 3 up_proj)" in \
        experts_problem(counted)


def test_fused_float_experts_count_as_unquantized(tmp_path):
    arch = qwen3_moe()
    names = {f"model.layers.{i}.mlp.experts.{p}": torch.bfloat16 for i in range(2) for p in ("gate_up_proj", "down_proj")}
    counted = count_experts(write(tmp_path / "q", names), arch)
    assert counted["quantized"] == 0 and counted["declared"] == 24


def test_a_dense_model_has_nothing_to_count(tmp_path):
    arch = architecture_of(json.loads((ARCH / "qwen3.json").read_text()))
    assert count_experts(write(tmp_path / "q", {"model.layers.0.mlp.gate_proj.weight": torch.float32}), arch) is None


def test_mixtral_checkpoint_names_w1_w3_w2_count_as_its_experts(tmp_path):
    """Mixtral's own checkpoints (and the compressed-tensors export transformers reads back) name the expert linears
    w1/w3/w2: the aliases come from GPTQModel's tree ("gate_proj|w1")."""
    arch = architecture_of(json.loads((ARCH / "mixtral.json").read_text()))
    names = {f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight_packed": torch.int32
             for i in range(2) for e in range(4) for w in ("w1", "w2", "w3")}
    assert count_experts(write(tmp_path / "m", names), arch)["quantized"] == 24

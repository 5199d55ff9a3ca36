"""pipeline/model/architecture.py against transformers' own modules: for each of the 16 architectures of the matrix
(tests/fixtures/arch, built from transformers' config classes), the layers path, every linear kind of every layer,
its (in, out) from the config, the norms and the expert count must match the model transformers builds (on the
meta device: no weights)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.model.architecture import EXPERT, architecture_of, gptqmodel_definitions

ARCH = Path(__file__).resolve().parents[1] / "fixtures" / "arch"
TYPES = sorted(p.stem for p in ARCH.glob("*.json"))
MOE = {"qwen3_moe", "mixtral", "olmoe", "granitemoe", "gpt_oss", "deepseek_v3"}


def meta_model(config: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    c = AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(c)


def expert_count(experts) -> int:
    if isinstance(experts, torch.nn.ModuleList):
        return len(experts)
    return next(iter(experts.parameters())).shape[0]


def expert_shape(experts, leaf: str) -> tuple[int, int]:
    """(in, out) of one expert's linear, in either layout transformers builds: its own fused 3D parameters
    (gate_up_proj holds gate and up), or one module per expert once GPTQModel is imported in the process (its
    defuser replaces the MoE classes: an earlier test in the same xdist worker does that)."""
    if isinstance(experts, torch.nn.ModuleList):
        lin = experts[0].get_submodule(leaf)
        return lin.in_features, lin.out_features
    params = dict(experts.named_parameters())
    w = params.get(leaf)
    if w is None and leaf in ("gate_proj", "up_proj"):
        w = params["gate_up_proj"]
        a, b = w.shape[1:]
        return (min(a, b), max(a, b) // 2) if a != b else (a, b // 2)
    a, b = w.shape[1:]
    return a, b


def test_the_sixteen_architectures_are_covered():
    assert len(TYPES) == 16 and MOE <= set(TYPES)


@pytest.mark.parametrize("model_type", TYPES)
def test_architecture_matches_the_model_transformers_builds(model_type):
    config = json.loads((ARCH / f"{model_type}.json").read_text())
    arch = architecture_of(config)
    assert arch.known, arch
    assert arch.is_moe == (model_type in MOE)
    m = meta_model(config)
    layers = m.get_submodule(arch.layers)
    assert len(layers) == config["num_hidden_layers"]
    for i, layer in enumerate(layers):
        kinds = arch.layer_linears(i)
        assert kinds, f"layer {i} has no linears"
        for kind in kinds:
            want = arch.shape(kind)
            assert want is not None, f"{kind}: no shape rule"
            if EXPERT in kind.split("."):
                block, leaf = kind.split(f".{EXPERT}.")
                experts = layer.get_submodule(block)
                got = expert_shape(experts, leaf)
                assert sorted(got) == sorted(want), (i, kind, got, want)
                assert expert_count(experts) == arch.experts.count
                continue
            mod = layer.get_submodule(kind)
            assert (mod.in_features, mod.out_features) == want, (i, kind)
        for norm in arch.norms:
            layer.get_submodule(norm)  # exists
    if arch.experts is not None:
        e = arch.experts
        assert e.top_k == 2 and e.count == 4 and e.fused
        if e.router:
            for i in set(range(len(layers))) - set(e.dense_layers):
                layers[i].get_submodule(e.router)
        assert arch.expert_weights() == (len(layers) - len(e.dense_layers)) * 4 * len(e.linears)


def test_definitions_are_gptqmodels_own_read_without_importing_it():
    model_map, classes = gptqmodel_definitions()
    assert len(model_map) > 100 and model_map["qwen3_moe"] == "Qwen3MoeQModel"
    assert architecture_of({"model_type": "qwen3_moe", "num_experts": 8}).definition == \
        "gptqmodel: definitions/qwen3_moe.py Qwen3MoeQModel"
    code = ("import sys; from pipeline.model.architecture import architecture_of; "
            "architecture_of({'model_type': 'mixtral'}); sys.exit(1 if 'torch' in sys.modules or "
            "'gptqmodel' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_an_unknown_model_type_has_no_definition():
    arch = architecture_of({"model_type": "nosuchmodel", "hidden_size": 64})
    assert not arch.known and arch.layer_linears(0) == ()

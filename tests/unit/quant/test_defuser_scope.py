"""GPTQModel's loader replaces transformers' fused MoE classes for the whole process (defuser.replace_fused_blocks);
pipeline/quant/defuser_scope.py puts them back. Without it, a compressed-tensors mixtral loaded after a GPTQ one in
the same process was built with one module per expert and left its expert tensors unmatched."""
import json
from pathlib import Path

import defuser
import pytest
import torch

from pipeline.quant.defuser_scope import transformers_restored

ARCH = Path(__file__).resolve().parents[2] / "fixtures" / "arch"


def experts_class(config: dict) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    c = AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(c)
    return type(m.model.layers[-1].mlp.experts).__name__


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_the_classes_defuser_replaces_are_back_after_the_scope(model_type):
    from transformers import conversion_mapping

    config = json.loads((ARCH / f"{model_type}.json").read_text())
    fused = experts_class(config)
    mapping = conversion_mapping.get_checkpoint_conversion_mapping
    with transformers_restored(config):
        assert defuser.replace_fused_blocks(model_type)  # what GPTQModel's loader calls before it builds a model
        assert experts_class(config) == "ModuleList"  # one module per expert inside
        assert conversion_mapping.get_checkpoint_conversion_mapping is not mapping
    assert experts_class(config) == fused != "ModuleList"
    assert conversion_mapping.get_checkpoint_conversion_mapping is mapping


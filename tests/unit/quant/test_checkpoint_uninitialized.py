"""load_checkpoint refuses a quantized checkpoint that transformers loads only partly (#41, found serving the
architecture matrix: GPTQ-format MoE checkpoints of qwen3_moe, mixtral and olmoe hold per-expert quantized linears;
transformers 5.24 builds fused 3D expert parameters, leaves them uninitialized and reports the quantized tensors
unexpected, so the model it returned was not the checkpoint and its greedy output changed from one process to the
next)."""
import pytest

from pipeline.base.errors import StageError
from pipeline.quant import checkpoint


def test_parameters_left_uninitialized_are_an_error_naming_them(tmp_path):
    missing = [f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")] + [
        "model.layers.2.mlp.experts.down_proj"]
    info = {"missing_keys": missing, "unexpected_keys": ["model.layers.0.mlp.experts.0.up_proj.qweight"] * 24}
    with pytest.raises(StageError) as e:
        checkpoint.uninitialized(tmp_path, info, "gptq")
    msg = str(e.value)
    assert "transformers cannot load this gptq checkpoint into its model class: it left 5 parameter(s) " \
           "uninitialized (model.layers.0.mlp.experts.down_proj, model.layers.0.mlp.experts.gate_up_proj, " \
           "model.layers.1.mlp.experts.down_proj, model.layers.1.mlp.experts.gate_up_proj and 1 more), while 24 " \
           "tensor(s) of the checkpoint matched no parameter" in msg


def test_a_complete_load_passes(tmp_path):
    checkpoint.uninitialized(tmp_path, {"missing_keys": [], "unexpected_keys": []}, "gptq")
    checkpoint.uninitialized(tmp_path, {}, "compressed-tensors")


def test_load_checkpoint_asks_transformers_what_it_left_out(tmp_path, monkeypatch):
    """The guard runs on what from_pretrained reports (output_loading_info), before the method's after_load hook."""
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config":
                                                      {"quant_method": "gptq", "bits": 4}}))
    calls = {}

    def fake(folder, **kw):
        calls.update(kw)
        return object(), {"missing_keys": ["model.layers.0.mlp.experts.down_proj"], "unexpected_keys": []}

    monkeypatch.setattr(checkpoint.AutoModelForCausalLM, "from_pretrained", fake)
    with pytest.raises(StageError, match="left 1 parameter"):
        checkpoint.load_checkpoint(tmp_path)
    assert calls["output_loading_info"] is True

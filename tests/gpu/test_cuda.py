"""GPU-only tests (`pytest -m gpu`): skipped on machines without CUDA (tests/conftest.py), never faked.
benchmarks/gpu/check.py runs them on a lent GPU machine and records the outcome."""
import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
GPU_RECIPE = Path("tests/gpu/inline.toml")  # where validate() says an inline recipe came from


def tiny_llama(seed: int = 0, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


def test_greedy_speculative_output_equals_plain_greedy_on_cuda():
    """Exactness of our decoder on the GPU: an fp32 verifier, a different draft, greedy: token-identical."""
    from pipeline.speculative.decode import autoregressive_generate, speculative_generate

    target, draft = tiny_llama(0, 4).to("cuda"), tiny_llama(1, 1).to("cuda")
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(3)).to("cuda")
    plain, _ = autoregressive_generate(target, ids, 24, 0.0, torch.Generator(device="cuda").manual_seed(0))
    spec, stats = speculative_generate(target, draft, ids, 24, 4, 0.0, torch.Generator(device="cuda").manual_seed(0))
    assert torch.equal(plain, spec) and stats.new_tokens == 24


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_sliced_vocab_draft_on_cuda_with_its_vocab_read_on_the_cpu(temperature):
    """A draft with its own head vocabulary, the vocabulary tensor on the CPU as load_draft_vocab returns it
    (the validate/draft/speculative unit's case): drafting stays on the GPU and greedy output stays exact."""
    from pipeline.speculative.decode import autoregressive_generate, speculative_generate

    target, draft = tiny_llama(0, 4).to("cuda"), tiny_llama(1, 1).to("cuda")
    vocab = torch.arange(0, 256, 2)  # on the CPU
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(3)).to("cuda")
    gen = lambda: torch.Generator(device="cuda").manual_seed(0)  # noqa: E731
    plain, _ = autoregressive_generate(target, ids, 24, temperature, gen())
    spec, stats = speculative_generate(target, draft, ids, 24, 4, temperature, gen(), vocab)
    assert stats.new_tokens == 24 and stats.draft_forwards > 0
    if temperature == 0:
        assert torch.equal(plain, spec)


def test_identical_draft_accepts_everything_on_cuda():
    from pipeline.speculative.decode import speculative_generate

    target = tiny_llama(0, 2).to("cuda")
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(1)).to("cuda")
    _, stats = speculative_generate(target, target, ids, 16, 4, 0.7, torch.Generator(device="cuda").manual_seed(0))
    assert stats.alpha == pytest.approx(1.0)


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes is not installed")
@pytest.mark.parametrize("method", ["bnb-int8", "bnb-nf4"])
def test_bnb_quantize_save_and_reload_on_cuda(tmp_path, method):
    from pipeline.quant.checkpoint import load_checkpoint
    from pipeline.quant.api import quantize_variant
    from pipeline.recipe import validate

    tiny_llama().save_pretrained(tmp_path / "base")
    recipe = validate({"run": {"name": "gpu"}, "model": {"source": "config:tiny-llama"}, "quantize": [{"name": "q", "method": method}]}, GPU_RECIPE)
    quantize_variant(tmp_path / "base", recipe.quantize[0], None, tmp_path / "q", _log(), 0, device="cuda")
    model = load_checkpoint(tmp_path / "q", "cuda")
    ids = torch.arange(10, device="cuda")[None]
    with torch.inference_mode():
        a, b = model(ids).logits.float(), tiny_llama().to("cuda")(ids).logits
    assert torch.isfinite(a).all() and (a - b).abs().max() < 0.5


@pytest.mark.skipif(importlib.util.find_spec("gptqmodel") is None, reason="gptqmodel is not installed")
def test_gptq_quantize_and_reload_on_cuda(tmp_path):
    from pipeline.quant.checkpoint import load_checkpoint
    from pipeline.quant.api import quantize_variant
    from pipeline.recipe import validate

    tiny_llama().save_pretrained(tmp_path / "base")
    recipe = validate({"run": {"name": "gpu"}, "model": {"source": "config:tiny-llama"},
                       "quantize": [{"name": "q", "method": "gptq", "bits": 4, "group_size": 32}]}, GPU_RECIPE)
    calib = torch.randint(0, 256, (8, 64))
    quantize_variant(tmp_path / "base", recipe.quantize[0], calib, tmp_path / "q", _log(), 0, device="cuda")
    model = load_checkpoint(tmp_path / "q", "cuda")
    with torch.inference_mode():
        logits = model(torch.arange(10, device="cuda")[None]).logits
    assert torch.isfinite(logits).all()


def test_peak_memory_is_cuda_max_allocated_above_the_entry():
    from pipeline.base.memory import PeakMemory

    keep = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")  # allocated before: not counted
    with PeakMemory("cuda") as mem:
        tmp = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
        del tmp
    assert 256 * 2**20 <= mem.peak_above_base() < 300 * 2**20
    del keep


def _log():
    import logging

    return logging.getLogger("test.gpu")


def test_draft_is_built_fitted_and_distilled_beside_a_cuda_verifier(tmp_path):
    """The H200 check of 4 Dec 2026 found the draft built on the CPU while its verifier ran on CUDA (the tuned-lens
    fit failed: `index is on cpu`). The draft now lives, is fitted and trains on the verifier's device."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from pipeline.speculative.config import DraftConfig
    from pipeline.speculative.stage_api import build_draft

    torch.manual_seed(0)
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(61)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3, bos_token_id=1,
                      eos_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "verifier")
    tok.save_pretrained(tmp_path / "verifier")
    g = torch.Generator().manual_seed(0)
    texts = [" ".join(f"w{i}" for i in row.tolist()) for row in (torch.rand(30, 60, generator=g) ** 3 * 61).long()]
    draft_cfg = DraftConfig.model_validate({
        "num_layers": 2, "vocab_size": 32, "init_head": "lens",
        "distill": {"steps": 4, "time_budget_s": None, "batch_size": 2, "seq_len": 16, "warmup": 1, "top_k": 8,
                    "on_policy_fraction": 0.5, "prompt_len": 4, "checkpoint_every": 2}})
    metrics = build_draft(tmp_path / "verifier", draft_cfg, texts, tmp_path / "draft", tmp_path / "work", seed=0,
                          log=lambda *_: None, progress=False, device="cuda")
    assert metrics["steps"] == 4 and metrics["lens"] is not None and (tmp_path / "draft" / "config.json").exists()


def test_each_sdpa_backend_matches_math_on_cuda_before_it_is_timed():
    """benchmarks/gpu/sdpa_backends.py on CUDA (bf16, SmolLM2-1.7B's attention shape, 512 tokens): flash and
    memory-efficient against math within the bf16 tolerance, timed; an Ampere-or-later GPU runs both."""
    from benchmarks.gpu.sdpa_backends import BACKENDS, kernel_rows

    out = kernel_rows("cuda", torch.bfloat16, seq=512, repeats=3)
    for shape in out.values():
        rows = shape["rows"]
        assert set(rows) == set(BACKENDS) and not [r for r in rows.values() if "error" in r], rows
        assert rows["math"]["ms"] > 0
        if torch.cuda.get_device_capability(0) >= (8, 0):
            assert rows["flash"]["ms"] > 0 and rows["efficient"]["ms"] > 0, rows

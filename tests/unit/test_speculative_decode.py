"""Speculative decoding on tiny random models: greedy exactness, sampling exactness (with a
deliberately wrong rule shown to be detected), identical draft = full acceptance, stats."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.speculative import decode
from pipeline.speculative.decode import (SpecStats, accept_greedy, accept_reject, autoregressive_generate,
                                         speculative_generate)

torch.set_num_threads(1)


def tiny_llama(seed: int, vocab: int = 64, layers: int = 2, sharpness: float = 1.0,
               init_range: float = 0.5) -> LlamaForCausalLM:
    """Random Llama; `sharpness` scales the head so distributions are peaked, not near uniform."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, initializer_range=init_range)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
    return model


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells with tiny expectation are pooled into one."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)]).double()
    exp = torch.cat([expected[big], expected[~big].sum().view(1)]).double()
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = torch.tensor(float(keep.sum() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))  # P(chi2_df > stat)


def wrong_rule_resample_from_p(p, q, draft_tokens, generator=None):
    """A classic bug: on rejection draw the replacement from p instead of max(0, p - q)."""
    n, _ = accept_reject(p, q, draft_tokens, generator)
    return n, int(torch.multinomial(p[n], 1, generator=generator))


# ---------------------------------------------------------------- the pure rule
def test_identical_distributions_accept_every_token():
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(5, 10), -1)
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        tokens = torch.multinomial(p[:4], 1, generator=g)[:, 0]
        assert accept_reject(p, p[:4], tokens, g)[0] == 4


def test_greedy_rule_is_the_sampling_rule_with_one_hot_distributions():
    torch.manual_seed(1)
    for _ in range(50):
        logits = torch.randn(4, 7)
        drafts = torch.where(torch.rand(3) < 0.6, logits[:3].argmax(-1), torch.randint(0, 7, (3,)))
        p = torch.nn.functional.one_hot(logits.argmax(-1), 7).float()
        q = torch.nn.functional.one_hot(drafts, 7).float()
        assert accept_greedy(logits, drafts) == accept_reject(p, q, drafts)


def _first_token_counts(rule, p, q, samples: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p.shape[-1])
    for _ in range(samples):
        tokens = torch.multinomial(q, 1, generator=g)[:, 0]
        n, nxt = rule(p, q, tokens, g)
        counts[int(tokens[0]) if n > 0 else nxt] += 1
    return counts


def test_first_emitted_token_follows_p_and_a_wrong_rule_is_detected():
    # the draft over-proposes token 2; the wrong rule gives [0.52, 0.31, 0.17], not p
    p = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.3, 0.3, 0.4]])
    q = torch.tensor([[0.1, 0.1, 0.8], [0.5, 0.25, 0.25]])
    right = _first_token_counts(accept_reject, p, q, 6000, seed=0)
    wrong = _first_token_counts(wrong_rule_resample_from_p, p, q, 6000, seed=0)
    assert chi2_pvalue(right, p[0]) > 1e-3
    assert chi2_pvalue(wrong, p[0]) < 1e-6


# ---------------------------------------------------------------- the loop, greedy
@pytest.mark.parametrize("gamma", range(1, 9))
def test_greedy_speculative_equals_plain_greedy(gamma):
    target, draft = tiny_llama(0, sharpness=3.0), tiny_llama(1, layers=1, sharpness=3.0)
    for seed in range(3):
        prompt = torch.randint(0, 64, (1, 5 + 3 * seed), generator=torch.Generator().manual_seed(seed))
        spec, stats = speculative_generate(target, draft, prompt, 20, gamma=gamma)
        plain, _ = autoregressive_generate(target, prompt, 20)
        hf = target.generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False)
        assert spec.tolist() == plain.tolist() == hf.tolist()
        assert stats.new_tokens == 20 and stats.accepted <= stats.drafted


def test_reduced_vocabulary_draft_stays_exact_in_greedy_mode():
    target, draft = tiny_llama(0, sharpness=3.0), tiny_llama(1, layers=1, sharpness=3.0)
    vocab = torch.arange(0, 64, 2)  # the draft can only propose even ids
    prompt = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(0))
    spec, stats = speculative_generate(target, draft, prompt, 24, gamma=3, draft_vocab=vocab)
    plain, _ = autoregressive_generate(target, prompt, 24)
    assert spec.tolist() == plain.tolist()
    assert stats.drafted > 0


def test_draft_equal_to_target_accepts_every_drafted_token():
    target = tiny_llama(0, sharpness=3.0)
    prompt = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(0))
    _, greedy = speculative_generate(target, target, prompt, 30, gamma=4)
    assert greedy.alpha == 1.0 and greedy.accepted == greedy.drafted > 0
    _, sampled = speculative_generate(target, target, prompt, 30, gamma=4, temperature=0.7,
                                      generator=torch.Generator().manual_seed(0))
    # p and q differ only by float rounding (1 vs gamma+1 positions per forward)
    assert sampled.alpha > 0.99
    assert greedy.tokens_per_target_forward == 30 / greedy.target_forwards


def test_stats_are_consistent():
    target, draft = tiny_llama(0, sharpness=3.0), tiny_llama(1, layers=1, sharpness=3.0)
    prompt = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(3))
    _, s = speculative_generate(target, draft, prompt, 25, gamma=4, temperature=1.0,
                                generator=torch.Generator().manual_seed(0))
    assert s.new_tokens == 25
    assert s.drafted == sum(s.drafted_by_position) and s.accepted == sum(s.accepted_by_position)
    assert s.new_tokens == s.accepted + s.target_forwards  # each forward emits accepted + 1
    assert s.draft_forwards == s.drafted and s.draft_time_s > 0 and s.target_time_s > 0
    merged = SpecStats()
    merged.merge(s)
    merged.merge(s)
    assert merged.drafted == 2 * s.drafted and merged.alpha == pytest.approx(s.alpha)


def test_eos_stops_generation_and_bad_inputs_fail_clearly():
    target = tiny_llama(0, sharpness=3.0)
    prompt = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(0))
    plain, _ = autoregressive_generate(target, prompt, 10)
    eos = int(plain[0, 9])  # the 4th generated token
    out, _ = speculative_generate(target, target, prompt, 10, gamma=3, eos_token_id=eos)
    assert out[0, -1] == eos and out.shape[1] <= 10
    with pytest.raises(ValueError, match="one sequence"):
        speculative_generate(target, target, prompt.repeat(2, 1), 4)
    with pytest.raises(ValueError, match="draft model is needed"):
        speculative_generate(target, None, prompt, 4, gamma=2)


# ---------------------------------------------------------------- the loop, sampling
def _exact_two_token_distribution(target, prompt, temperature) -> torch.Tensor:
    with torch.no_grad():
        first = torch.softmax(target(prompt).logits[0, -1] / temperature, -1)
        vocab = first.numel()
        seqs = torch.cat([prompt.repeat(vocab, 1), torch.arange(vocab)[:, None]], 1)
        second = torch.softmax(target(seqs).logits[:, -1] / temperature, -1)
    return (first[:, None] * second).flatten()


def _sampled_two_token_counts(target, draft, prompt, temperature, samples, vocab=None):
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(target.config.vocab_size ** 2)
    for _ in range(samples):
        out, _ = speculative_generate(target, draft, prompt, 2, gamma=2, temperature=temperature,
                                      generator=g, draft_vocab=vocab)
        counts[int(out[0, -2]) * target.config.vocab_size + int(out[0, -1])] += 1
    return counts


@pytest.mark.parametrize("vocab", [None, torch.tensor([0, 2, 3, 5])], ids=["full", "subset"])
def test_speculative_sampling_matches_the_verifier_distribution(vocab, monkeypatch):
    # moderate entropy, alpha ~ 0.3: the wrong rule is ~0.2 off in TV on the first token
    target = tiny_llama(0, vocab=6, init_range=0.2)
    draft = tiny_llama(5, vocab=6, layers=1, init_range=0.2)
    prompt = torch.tensor([[1, 4, 2]])
    exact = _exact_two_token_distribution(target, prompt, 0.7)
    counts = _sampled_two_token_counts(target, draft, prompt, 0.7, 600, vocab)
    assert chi2_pvalue(counts, exact) > 1e-3
    monkeypatch.setattr(decode, "accept_reject", wrong_rule_resample_from_p)
    wrong = _sampled_two_token_counts(target, draft, prompt, 0.7, 600, vocab)
    assert chi2_pvalue(wrong, exact) < 1e-6, "the statistical test must catch a wrong acceptance rule"


# ---------------------------------------------------------------- the cost model
def test_cost_model_and_break_even():
    from pipeline.speculative.measure import break_even_alpha, expected_tokens, repetition_rate
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    a = break_even_alpha(1.8, 4)
    assert expected_tokens(a, 4) == pytest.approx(1.8, abs=1e-6)
    assert break_even_alpha(6.0, 4) is None  # costs more than gamma + 1 tokens: never pays
    assert repetition_rate([1, 2, 3, 4] * 4, n=4) == pytest.approx(1 - 4 / 13)
    assert repetition_rate(list(range(20))) == 0.0


MOE_TYPES = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3")


def tiny_moe(model_type: str, seed: int):
    """A tiny random MoE verifier from the architecture matrix's config (tests/fixtures/arch), vocabulary 64."""
    import json
    from pathlib import Path

    from transformers import AutoConfig, AutoModelForCausalLM

    d = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "arch" / f"{model_type}.json").read_text())
    d.update(vocab_size=64, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(d.pop("model_type"), **d)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)  # peaked distributions, as tiny_llama's sharpness
    return model


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_greedy_speculative_equals_plain_greedy_with_an_moe_verifier(model_type):
    """The exact decoder with a Mixture-of-Experts verifier: routing is per token, so verifying gamma drafted tokens
    in one forward must give the tokens plain greedy decoding gives, for every MoE layout of the matrix."""
    target, draft = tiny_moe(model_type, 0), tiny_llama(1, layers=1, sharpness=3.0)
    for seed in range(2):
        prompt = torch.randint(3, 64, (1, 5 + 3 * seed), generator=torch.Generator().manual_seed(seed))
        spec, stats = speculative_generate(target, draft, prompt, 16, gamma=4)
        plain, _ = autoregressive_generate(target, prompt, 16)
        assert spec.tolist() == plain.tolist()
        assert stats.new_tokens == 16 and stats.target_forwards < 16 + 1
    _, same = speculative_generate(target, target, prompt, 16, gamma=4)
    assert same.alpha == 1.0, "the MoE verifier as its own draft accepts every token"

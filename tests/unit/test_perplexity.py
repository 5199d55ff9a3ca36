import math

import pytest
import torch
import torch.nn.functional as F

from pipeline.eval.perplexity import (Window, gptq_windows, kl_top1, make_windows, perplexity, sliding_windows,
                                      topk_reference, windowed_nll)


class TableLM(torch.nn.Module):
    """logits[t] depend only on token t: a bigram table, so NLL is computable by hand."""

    def __init__(self, vocab=7, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab, generator=g))

    def forward(self, input_ids, use_cache=False):
        return type("Out", (), {"logits": self.table[input_ids]})()


def hand_nll(table, ids, pairs):
    total = 0.0
    for a, b in pairs:
        row = table[ids[a]]
        total += -(row[ids[b]] - torch.logsumexp(row, 0)).item()
    return total


def test_gptq_windows_are_non_overlapping_and_drop_the_tail():
    w = gptq_windows(10, 4)
    assert w == [Window(0, 4, 1), Window(4, 8, 5)]
    assert gptq_windows(10, 4, max_windows=1) == [Window(0, 4, 1)]


def test_sliding_windows_score_every_token_once():
    ws = sliding_windows(10, 4, 2)
    scored = [t for w in ws for t in range(w.score_from, w.end)]
    assert scored == list(range(1, 10))
    assert all(w.end - w.begin <= 4 for w in ws)
    with pytest.raises(ValueError):
        sliding_windows(10, 4, 5)


def test_make_windows_picks_protocol():
    assert make_windows(10, 4, None, None) == gptq_windows(10, 4)
    assert make_windows(10, 4, 2, None) == sliding_windows(10, 4, 2)


def test_windowed_nll_matches_hand_computation():
    torch.manual_seed(0)
    model = TableLM()
    ids = torch.randint(0, 7, (13,))
    ws = gptq_windows(len(ids), 4)
    nll, n = windowed_nll(model, ids, ws)
    pairs = [(t - 1, t) for w in ws for t in range(w.score_from, w.end)]
    assert n == len(pairs) == 3 * 3
    assert nll == pytest.approx(hand_nll(model.table.detach(), ids, pairs), rel=1e-5)
    assert perplexity(nll, n) == pytest.approx(math.exp(nll / n))


def test_sliding_nll_matches_hand_computation():
    model = TableLM(seed=1)
    ids = torch.randint(0, 7, (11,), generator=torch.Generator().manual_seed(3))
    nll, n = windowed_nll(model, ids, sliding_windows(len(ids), 4, 3))
    assert n == 10
    assert nll == pytest.approx(hand_nll(model.table.detach(), ids, [(t - 1, t) for t in range(1, 11)]), rel=1e-5)


def test_kl_is_zero_for_identical_and_exact_with_full_topk():
    g = torch.Generator().manual_seed(0)
    logp = F.log_softmax(torch.randn(5, 9, generator=g), -1)
    logq = F.log_softmax(torch.randn(5, 9, generator=g), -1)
    v, i = topk_reference(logp, 9)
    kl, agree = kl_top1(v, i, logp)
    assert torch.allclose(kl, torch.zeros(5), atol=1e-6) and agree.eq(1).all()
    kl, _ = kl_top1(v, i, logq)
    exact = (logp.exp() * (logp - logq)).sum(-1)
    assert torch.allclose(kl, exact, atol=1e-5)


def test_truncated_kl_is_a_lower_bound():
    g = torch.Generator().manual_seed(1)
    logp = F.log_softmax(torch.randn(20, 50, generator=g), -1)
    logq = F.log_softmax(torch.randn(20, 50, generator=g), -1)
    exact = (logp.exp() * (logp - logq)).sum(-1)
    v, i = topk_reference(logp, 5)
    kl, agree = kl_top1(v, i, logq)
    assert (kl <= exact + 1e-5).all() and (kl >= 0).all()
    assert torch.equal(agree.bool(), logq.argmax(-1) == logp.argmax(-1))


@pytest.mark.parametrize("text, why", [
    ("", "only 0 word"),
    ("the the the the the the the", "distinct words"),
    ("L'Étoile, la Marseillaise, la femme, la femme, la femme, la femme, la femme,", "ends in a loop: 'la femme,' 5 times"),
    ("Paris is nice. I like it. I like it. I like it. I like it.", "ends in a loop"),
])
def test_smoke_check_flags_empty_output_and_loops(text, why):
    from pipeline.eval.quality import is_degenerate

    assert why in (is_degenerate(text) or "")


@pytest.mark.parametrize("text", [
    "The capital of France is Paris.",
    "The sea is a vast, mysterious, and awe-inspiring realm that exists beyond the boundaries of human comprehension.",
    "Yes, yes, I know: the first rule is to measure, measure again, then cut.",
])
def test_smoke_check_accepts_normal_text(text):
    from pipeline.eval.quality import is_degenerate

    assert is_degenerate(text) is None

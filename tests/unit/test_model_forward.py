"""The KV-cache keyword across transformers versions (pipeline/model/forward.py): a forward that names it
`past_key_values` (transformers 5.17, the lent GPU machine's) must get its cache under that name, or it runs
cacheless without a word (seen there: an identical draft accepted 61% of its tokens)."""
import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from pipeline.model.forward import cache_kwargs
from pipeline.speculative.decode import speculative_generate


def tiny():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()


class OldStyle(torch.nn.Module):
    """A forward as transformers 5.17 declares it: `past_key_values`, and **kwargs that swallow `cache`."""

    def __init__(self, model):
        super().__init__()
        self.inner = model
        self.config, self.device = model.config, model.device

    def forward(self, input_ids=None, past_key_values=None, use_cache=None, logits_to_keep=0, **kwargs):
        assert "cache" not in kwargs, "an old-style forward must never be handed `cache`"
        return self.inner(input_ids=input_ids, cache=past_key_values, use_cache=use_cache,
                          logits_to_keep=logits_to_keep)


def test_the_pinned_transformers_takes_cache():
    assert list(cache_kwargs(tiny(), "C")) == ["cache"]


def test_an_old_style_forward_gets_past_key_values_and_uses_it():
    model = OldStyle(tiny())
    cache = DynamicCache()
    assert cache_kwargs(model, cache) == {"past_key_values": cache}
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True)
    assert cache.get_seq_length() == 8


def test_identical_draft_accepts_everything_through_an_old_style_forward():
    model = OldStyle(tiny())
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(1))
    _, stats = speculative_generate(model, model, ids, 16, 4, 0.7, torch.Generator().manual_seed(0))
    assert stats.alpha == pytest.approx(1.0)


def test_a_forward_without_a_cache_argument_is_refused():
    class NoCache(torch.nn.Module):
        def forward(self, input_ids=None):
            return input_ids

    with pytest.raises(TypeError, match="neither `cache` nor `past_key_values`"):
        cache_kwargs(NoCache(), None)

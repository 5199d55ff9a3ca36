"""Exact speculative decoding (Leviathan et al. 2023, Chen et al. 2023), gpt-fast style.

One iteration, with the draft distribution q and the verifier (target) distribution p:
  1. the draft proposes gamma tokens x_1..x_gamma, one forward each, x_i ~ q_i (argmax when greedy);
  2. the target scores all gamma+1 positions in ONE forward: p_1..p_gamma for the drafted
     tokens and p_{gamma+1} for the position after the last one;
  3. x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)):
       q >= p: accept with prob p/q;   q < p: always accept;
  4. at the first rejection the replacement is drawn from normalize(max(0, p_i - q_i)):
     the mass p has where q under-proposed, which is exactly what step 3 left out, so every
     emitted token is distributed as p (the proof: P(x) = min(p, q)(x) + (1 - sum min(p, q)) *
     max(0, p - q)(x) / sum max(0, p - q) = p(x), because 1 - sum min(p,q) = sum max(0, p-q));
  5. if all gamma are accepted, a bonus token is drawn from p_{gamma+1}.
  Each iteration therefore emits n_accepted + 1 tokens for one target forward.
Greedy (temperature 0) is the same rule with one-hot p and q: accept while the argmaxes match,
then emit the target's argmax, so the output equals plain greedy decoding token for token.

A draft with a reduced head (EAGLE-3 style `draft_vocab`, a list of full-vocabulary ids) puts
probability 0 outside its subset; q is scattered back to the full vocabulary and the rule above
stays exact. Both KV caches are cropped to the accepted length after each iteration.
Batch size 1.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from pipeline.model.forward import cache_kwargs


@dataclass
class SpecStats:
    """Counters of one or more generate calls; `merge` adds another call's counters."""

    drafted: int = 0
    accepted: int = 0
    rejections: int = 0  # iterations that ended on a rejected draft token
    target_forwards: int = 0
    draft_forwards: int = 0
    new_tokens: int = 0
    draft_time_s: float = 0.0
    target_time_s: float = 0.0
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)

    @property
    def alpha(self) -> float:
        """Fraction of drafted tokens the verifier accepted."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def alpha_per_token(self) -> float:
        """accepted / (accepted + rejections): the maximum-likelihood estimate of the per-token
        acceptance probability of Leviathan et al. (tokens after a rejection were never tried)."""
        trials = self.accepted + self.rejections
        return self.accepted / trials if trials else 0.0

    @property
    def tokens_per_target_forward(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    def record(self, gamma: int, n_accepted: int) -> None:
        grow = gamma - len(self.drafted_by_position)
        if grow > 0:
            self.drafted_by_position += [0] * grow
            self.accepted_by_position += [0] * grow
        for i in range(gamma):
            self.drafted_by_position[i] += 1
            self.accepted_by_position[i] += int(i < n_accepted)
        self.drafted += gamma
        self.accepted += n_accepted
        self.rejections += int(n_accepted < gamma)

    def merge(self, other: SpecStats) -> None:
        pad = len(other.drafted_by_position) - len(self.drafted_by_position)
        self.drafted_by_position += [0] * max(pad, 0)
        self.accepted_by_position += [0] * max(pad, 0)
        for i, (d, a) in enumerate(zip(other.drafted_by_position, other.accepted_by_position, strict=True)):
            self.drafted_by_position[i] += d
            self.accepted_by_position[i] += a
        for name in ("drafted", "accepted", "rejections", "target_forwards", "draft_forwards", "new_tokens",
                     "draft_time_s", "target_time_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_dict(self) -> dict:
        acc = [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position, strict=True)]
        return {**asdict(self), "alpha": self.alpha, "alpha_per_token": self.alpha_per_token,
                "acceptance_by_position": acc,
                "tokens_per_target_forward": self.tokens_per_target_forward}


def accept_reject(p: torch.Tensor, q: torch.Tensor, draft_tokens: torch.Tensor,
                  generator: torch.Generator | None = None) -> tuple[int, int]:
    """Speculative sampling rule. p: [gamma+1, V] target probs, q: [gamma, V] draft probs,
    draft_tokens: [gamma] with draft_tokens[i] ~ q[i]. Returns (n_accepted, next_token)."""
    gamma = draft_tokens.shape[0]
    rows = torch.arange(gamma, device=p.device)
    p_x, q_x = p[rows, draft_tokens], q[rows, draft_tokens]
    # accept x_i iff u_i < p(x_i)/q(x_i); written u*q < p so q(x_i) never divides (it is > 0
    # anyway, since x_i was sampled from q)
    u = torch.rand(gamma, generator=generator, device=p.device)
    rejected = (u * q_x >= p_x).nonzero()
    if rejected.numel() == 0:
        return gamma, _sample(p[gamma], generator)  # all accepted: bonus token from p
    n = int(rejected[0])
    residual = (p[n] - q[n]).clamp_min(0)  # normalize(max(0, p - q))
    if residual.sum() <= 0:  # p == q up to rounding: rejection had probability ~0; p is the limit
        residual = p[n]
    return n, _sample(residual / residual.sum(), generator)


def accept_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[int, int]:
    """Greedy rule: accept the longest prefix where the draft token is the target's argmax,
    then emit the target's argmax at the first mismatch (or the bonus position)."""
    best = target_logits.argmax(-1)  # [gamma+1]
    mismatch = (best[:-1] != draft_tokens).nonzero()
    n = int(mismatch[0]) if mismatch.numel() else draft_tokens.shape[0]
    return n, int(best[n])


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def _crop(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` positions of a KV cache (transformers' crop takes -n_to_remove)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


class Timed:
    """Wall-clock accumulator around model calls (synchronizes CUDA before reading clocks)."""

    def __init__(self, device: torch.device):
        self.device, self.seconds, self.calls = device, 0.0, 0

    def __enter__(self) -> Timed:
        _sync(self.device)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        _sync(self.device)
        self.seconds += time.perf_counter() - self.t0
        self.calls += 1


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_logits_fn(model, vocab: torch.Tensor | None = None):
    """`fn(ids, cache, keep) -> [keep, V']` logits of the last `keep` positions. With `vocab`,
    only those rows of the output head are computed (the reduced draft head)."""
    if vocab is None:
        def full(ids, cache, keep):
            out = model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=keep)
            return out.logits[0, -keep:].float()
        return full
    head = model.get_output_embeddings().weight.detach()[vocab.to(model.device)].contiguous()
    backbone = model.get_decoder()

    def sliced(ids, cache, keep):
        hidden = backbone(input_ids=ids, **cache_kwargs(backbone, cache), use_cache=True).last_hidden_state
        return F.linear(hidden[0, -keep:], head).float()
    return sliced


@torch.inference_mode()
def speculative_generate(target, draft, input_ids: torch.Tensor, max_new_tokens: int, gamma: int = 4,
                         temperature: float = 0.0, generator: torch.Generator | None = None,
                         draft_vocab: torch.Tensor | None = None,
                         eos_token_id: int | None = None) -> tuple[torch.Tensor, SpecStats]:
    """Generate up to `max_new_tokens` after `input_ids` ([1, T]); returns ([1, T + new], stats).
    temperature 0 is greedy. Caches hold a prefix of `seq`; every forward feeds what is missing."""
    _check_args(draft, input_ids, max_new_tokens, gamma, temperature)
    if draft_vocab is not None:  # drafted ids are looked up in it: a CPU vocab would move them off the GPU
        draft_vocab = draft_vocab.to(input_ids.device)
    target_fn = make_logits_fn(target)
    draft_fn = make_logits_fn(draft, draft_vocab) if gamma > 0 else None
    t_cache, d_cache = DynamicCache(), DynamicCache()
    t_clock, d_clock = Timed(input_ids.device), Timed(input_ids.device)
    stats, seq, prompt_len = SpecStats(), input_ids[0], input_ids.shape[1]
    while seq.numel() - prompt_len < max_new_tokens:
        # never overshoot: an iteration emits at most g + 1 tokens
        g = min(gamma, max_new_tokens - (seq.numel() - prompt_len) - 1)
        drafts, q = _propose(draft_fn, d_cache, seq, g, temperature, generator, draft_vocab, d_clock)
        with t_clock:  # one target forward scores the g drafted positions and the bonus one
            logits = target_fn(torch.cat([seq[t_cache.get_seq_length():], drafts])[None], t_cache, g + 1)
        if temperature == 0:
            n, nxt = accept_greedy(logits, drafts)
        else:
            p = torch.softmax(logits / temperature, dim=-1)
            n, nxt = accept_reject(p, _widen(q, draft_vocab, p), drafts, generator)
        stats.record(g, n)
        seq = torch.cat([seq, drafts[:n], seq.new_tensor([nxt])])
        _crop(t_cache, seq.numel() - 1)  # the new token is not in any cache yet
        _crop(d_cache, seq.numel() - 1)
        if eos_token_id is not None and (seq[prompt_len:] == eos_token_id).any():
            seq = seq[: prompt_len + int((seq[prompt_len:] == eos_token_id).nonzero()[0]) + 1]
            break
    stats.new_tokens = seq.numel() - prompt_len
    stats.target_forwards, stats.target_time_s = t_clock.calls, t_clock.seconds
    stats.draft_forwards, stats.draft_time_s = d_clock.calls, d_clock.seconds
    return seq[None], stats


def autoregressive_generate(target, input_ids: torch.Tensor, max_new_tokens: int,
                            temperature: float = 0.0, generator: torch.Generator | None = None,
                            eos_token_id: int | None = None) -> tuple[torch.Tensor, SpecStats]:
    """Plain KV-cache decoding through the very same loop (gamma = 0, no draft): the fair
    speed baseline. Returns ([1, T + new], stats)."""
    return speculative_generate(target, None, input_ids, max_new_tokens, gamma=0,
                                temperature=temperature, generator=generator, eos_token_id=eos_token_id)


def _propose(draft_fn, cache, seq, gamma, temperature, generator, vocab, clock):
    """The draft's gamma tokens (full-vocabulary ids) and the distributions q they came from
    (over the draft's own vocabulary; empty when greedy)."""
    tokens, probs = [], []
    ids = seq[cache.get_seq_length():]  # everything the draft cache has not seen yet
    for _ in range(gamma):
        with clock:
            logits = draft_fn(ids[None], cache, 1)[0]
        if temperature == 0:
            tok = logits.argmax()
        else:
            q = torch.softmax(logits / temperature, dim=-1)
            tok = torch.multinomial(q, 1, generator=generator)[0]
            probs.append(q)
        tok = vocab[tok] if vocab is not None else tok
        tokens.append(tok)
        ids = tok.view(1)
    drafts = torch.stack(tokens) if tokens else seq.new_empty(0)
    return drafts, (torch.stack(probs) if probs else None)


def _widen(q: torch.Tensor | None, vocab: torch.Tensor | None, p: torch.Tensor) -> torch.Tensor:
    """q over the draft's vocabulary -> q over the target's (0 where the draft cannot propose)."""
    full = p.new_zeros(0 if q is None else q.shape[0], p.shape[-1])
    if q is None:
        return full
    if vocab is None:  # a full-vocabulary draft; tolerate a padded head of a different width
        width = min(q.shape[1], full.shape[1])
        full[:, :width] = q[:, :width]
    else:
        full[:, vocab] = q
    return full


def _check_args(draft, input_ids, max_new_tokens, gamma, temperature) -> None:
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"speculative decoding takes one sequence, input_ids of shape [1, T]; got "
                         f"{tuple(input_ids.shape)}")
    if gamma < 0 or (gamma > 0 and draft is None):
        raise ValueError(f"gamma must be >= 0 and a draft model is needed when gamma > 0 (gamma={gamma})")
    if max_new_tokens < 1 or temperature < 0:
        raise ValueError(f"need max_new_tokens >= 1 and temperature >= 0; got {max_new_tokens}, {temperature}")

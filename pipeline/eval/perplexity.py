"""Perplexity, KL divergence and top-1 agreement over windows of one token stream.

Two protocols, both labelled in every report:
- "gptq": the GPTQ paper's — the evaluation text tokenized once, cut into non-overlapping
  windows of `seq_len` tokens (the tail shorter than a window is dropped); every window
  predicts its last seq_len-1 tokens from the ones before it, with no context across windows.
- "sliding": Hugging Face's strided protocol — windows of `seq_len` start every `stride`
  tokens; only the tokens not scored by the previous window are scored, each with up to
  seq_len-1 tokens of context.
perplexity = exp(total NLL / tokens scored).

KL(baseline || model) per token uses the baseline's top-k log-probs plus one bucket holding
the rest of the mass; by the log-sum inequality this is a lower bound of the exact KL and
equals it when the top-k hold all the mass.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Window:
    begin: int  # first input token
    end: int  # one past the last input token
    score_from: int  # first position (absolute) whose token is scored; >= begin + 1


def gptq_windows(n_tokens: int, seq_len: int, max_windows: int | None = None) -> list[Window]:
    n = n_tokens // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    return [Window(i * seq_len, (i + 1) * seq_len, i * seq_len + 1) for i in range(n)]


def sliding_windows(n_tokens: int, seq_len: int, stride: int, max_windows: int | None = None) -> list[Window]:
    if not 0 < stride <= seq_len:
        raise ValueError(f"stride must be in 1..seq_len ({seq_len}), got {stride}")
    out, scored_to = [], 1  # token 0 has no context: never scored
    for begin in range(0, n_tokens - 1, stride):
        end = min(begin + seq_len, n_tokens)
        out.append(Window(begin, end, max(scored_to, begin + 1)))
        scored_to = end
        if end == n_tokens or (max_windows is not None and len(out) == max_windows):
            break
    return out


def make_windows(n_tokens: int, seq_len: int, stride: int | None, max_windows: int | None) -> list[Window]:
    if stride is None or stride >= seq_len:
        return gptq_windows(n_tokens, seq_len, max_windows)
    return sliding_windows(n_tokens, seq_len, stride, max_windows)


def window_logprobs(model: torch.nn.Module, ids: torch.Tensor, w: Window) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs [n_scored, vocab] fp32, targets [n_scored]) for the scored tokens of one window."""
    device = next(model.parameters()).device
    x = ids[w.begin: w.end].unsqueeze(0).to(device)
    logits = model(input_ids=x, use_cache=False).logits[0]
    first = w.score_from - w.begin - 1  # logits at position t predict token t+1
    logits = logits[first: w.end - w.begin - 1].float()
    return F.log_softmax(logits, dim=-1), ids[w.score_from: w.end].to(device)


@torch.inference_mode()
def windowed_nll(model: torch.nn.Module, ids: torch.Tensor, windows: list[Window],
                 on_window: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
                 progress: Callable[[int], None] | None = None) -> tuple[float, int]:
    """Total NLL (nats) and number of scored tokens. `on_window(i, logprobs, targets)` sees each window."""
    total, count = 0.0, 0
    for i, w in enumerate(windows):
        logp, targets = window_logprobs(model, ids, w)
        total += -logp.gather(1, targets[:, None]).sum().item()
        count += targets.numel()
        if on_window is not None:
            on_window(i, logp, targets)
        if progress is not None:
            progress(1)
    return total, count


def perplexity(nll: float, tokens: int) -> float:
    return math.exp(nll / tokens)


def topk_reference(logp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The baseline's top-k log-probs (fp32) and token ids (int32) per position, most likely first."""
    vals, idx = logp.topk(min(k, logp.shape[-1]), dim=-1)
    return vals.float(), idx.to(torch.int32)


def kl_top1(ref_logp: torch.Tensor, ref_idx: torch.Tensor, logq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position KL(ref || q) over the reference's top-k plus a tail bucket, and top-1 agreement.

    ref_logp, ref_idx: [n, k] (from topk_reference); logq: [n, vocab] log-probs of the model under test.
    """
    idx = ref_idx.to(logq.device).long()  # the reference is read from disk onto the CPU
    ref_logp = ref_logp.to(logq.device)
    p = ref_logp.exp()
    logq_k = logq.gather(1, idx)
    kl = (p * (ref_logp - logq_k)).sum(-1)
    p_tail = (1 - p.sum(-1)).clamp_min(0)
    q_tail = (1 - logq_k.exp().sum(-1)).clamp_min(1e-12)
    tail = torch.where(p_tail > 1e-9, p_tail * (p_tail.clamp_min(1e-12).log() - q_tail.log()), torch.zeros_like(p_tail))
    agree = (logq.argmax(-1) == idx[:, 0]).float()
    return (kl + tail).clamp_min(0), agree


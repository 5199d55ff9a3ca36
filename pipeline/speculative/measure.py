"""Measuring a draft: acceptance, tokens per verifier forward, repetition, speed-up over plain
decoding through the same loop (interleaved per prompt, same process), measured costs and the
break-even they imply, and transformers' assisted generation as a reference.

Cost model (Leviathan et al. 2023, section 3.4), with a = per-token acceptance probability:
  tokens per iteration    E = 1 + a + a^2 + ... + a^gamma = (1 - a^(gamma+1)) / (1 - a)
  time per iteration      gamma * c_d + c_v(gamma+1)      in units of one verifier token
  speed-up                E / (gamma * c_d + c_v(gamma+1))
where c_d = draft cost per token and c_v(k) = verifier cost to score k tokens at once, both
divided by the verifier's single-token cost. Break-even a solves E(a) = gamma c_d + c_v(gamma+1).
Two acceptance figures are reported: `alpha` = accepted / drafted (tokens drafted after a
rejection count as drafted), and `alpha_per_token` = accepted / (accepted + rejections), the
maximum-likelihood estimate of a, which is what the break-even formula compares against.
"""
from __future__ import annotations

import copy
import statistics
import time

import torch
from tqdm import tqdm
from transformers import DynamicCache

from pipeline.speculative.decode import SpecStats, Timed, autoregressive_generate, make_logits_fn, speculative_generate


def repetition_rate(tokens: list[int], n: int = 4) -> float:
    """1 - distinct n-grams / n-grams: 0 for varied text, near 1 for a degenerate loop."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def expected_tokens(a: float, gamma: int) -> float:
    return float(gamma + 1) if a >= 1 else (1 - a ** (gamma + 1)) / (1 - a)


def break_even_alpha(cost: float, gamma: int) -> float | None:
    """Per-token acceptance a at which E(a) equals `cost` (bisection); None if out of reach."""
    if cost >= gamma + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, gamma) < cost else (lo, mid)
    return (lo + hi) / 2


@torch.inference_mode()
def measure_costs(target, draft, ids: torch.Tensor, gamma: int, vocab=None, reps: int = 9) -> dict:
    """Median ms of: verifier scoring k = 1..gamma+1 tokens after a cached prompt, draft one token.
    Interleaved so that machine noise hits all of them alike."""
    ids = ids.to(target.device)
    t_fn, d_fn = make_logits_fn(target), make_logits_fn(draft, vocab)
    t_cache, d_cache = DynamicCache(), DynamicCache()
    t_fn(ids, t_cache, 1)
    d_fn(ids, d_cache, 1)
    base = ids.shape[1]
    times: dict[int, list[float]] = {k: [] for k in range(1, gamma + 2)}
    draft_times = []
    extra = ids[:, : gamma + 1]
    for _ in range(reps):
        for k in times:
            with Timed(ids.device) as clock:
                t_fn(extra[:, :k], t_cache, k)
            times[k].append(clock.seconds)
            t_cache.crop(-k)
        with Timed(ids.device) as clock:
            d_fn(extra[:, :1], d_cache, 1)
        draft_times.append(clock.seconds)
        d_cache.crop(-1)
    assert t_cache.get_seq_length() == base
    one = statistics.median(times[1])
    c_v = {k: statistics.median(v) / one for k, v in times.items()}
    c_d = statistics.median(draft_times) / one
    cost = gamma * c_d + c_v[gamma + 1]
    return {"verifier_ms": one * 1e3, "draft_ms": statistics.median(draft_times) * 1e3, "c_d": c_d,
            "c_v": {str(k): v for k, v in c_v.items()}, "cost_per_iteration": cost,
            "break_even_alpha_per_token": break_even_alpha(cost, gamma),
            "best_possible_speedup": (gamma + 1) / cost}


def predicted_speedup(a: float, costs: dict, gamma: int) -> float:
    return expected_tokens(a, gamma) / (gamma * costs["c_d"] + costs["c_v"][str(gamma + 1)])


def compare_loops(target, draft, prompts: list[torch.Tensor], new_tokens: int, gamma: int, temperature: float,
                  seed: int, vocab=None, warmup: int = 1, repeats: int = 1, label: str | None = None) -> dict:
    """Plain and speculative decoding of the same verifier through the same loop, interleaved per
    prompt (so machine noise hits both alike), `repeats` timed passes. Speed-up = total plain time
    / total speculative time, median over passes; the median per-prompt ratio is reported too."""
    dev = target.device
    gen = lambda s: torch.Generator(device=dev).manual_seed(s)  # noqa: E731  (sampling happens on the target's device)
    prompts = [ids.to(dev) for ids in prompts]
    for ids in prompts[:warmup]:
        autoregressive_generate(target, ids, 8, temperature, gen(0))
        speculative_generate(target, draft, ids, 8, gamma, temperature, gen(0), vocab)
    stats, speedups, ratios, reps, mismatches = SpecStats(), [], [], [], []
    plain_s = spec_s = 0.0
    bar = tqdm(total=repeats * len(prompts), desc=label or f"speculative T={temperature:g}", unit="prompt",
               leave=False, disable=label is None)
    for r in range(repeats):
        plain_s = spec_s = 0.0
        for i, ids in enumerate(prompts):
            t0 = time.perf_counter()
            plain, _ = autoregressive_generate(target, ids, new_tokens, temperature, gen(seed + i))
            t1 = time.perf_counter()
            spec, s = speculative_generate(target, draft, ids, new_tokens, gamma, temperature, gen(seed + i), vocab)
            t2 = time.perf_counter()
            plain_s, spec_s = plain_s + t1 - t0, spec_s + t2 - t1
            ratios.append((t1 - t0) / (t2 - t1))
            if r == 0:  # same seeds: every pass generates the same tokens
                stats.merge(s)
                reps.append(repetition_rate(spec[0, ids.shape[1]:].tolist()))
                if temperature == 0 and not torch.equal(plain, spec):
                    mismatches.append((i, _first_difference(plain, spec)))
            bar.update(1)
            bar.set_postfix(speedup=f"{plain_s / spec_s:.2f}x")
        speedups.append(plain_s / spec_s)
    bar.close()
    out = stats.as_dict()
    n = stats.new_tokens
    out.update(speedup=statistics.median(speedups), speedup_per_pass=speedups,
               speedup_median_per_prompt=statistics.median(ratios), plain_tokens_per_s=n / plain_s,
               spec_tokens_per_s=n / spec_s, repetition_rate=statistics.mean(reps))
    if temperature == 0:
        out["greedy_mismatches"] = mismatches
    return out


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(a.shape[1], b.shape[1])
    diff = (a[0, :n] != b[0, :n]).nonzero()
    return int(diff[0]) if diff.numel() else n


@torch.inference_mode()
def hf_assisted(target, draft, prompts: list[torch.Tensor], new_tokens: int, gamma: int, temperature: float,
                seed: int) -> dict:
    """transformers' generate() with and without assistant_model (constant gamma draft tokens)."""
    gen_cfg = copy.deepcopy(draft.generation_config)
    draft.generation_config.num_assistant_tokens = gamma
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=temperature > 0,
              pad_token_id=target.config.eos_token_id)
    if temperature > 0:
        kw.update(temperature=temperature, top_k=0, top_p=1.0)
    plain_s, assisted_s, same = [], [], 0
    try:
        for i, ids in enumerate(prompts):
            ids = ids.to(target.device)
            torch.manual_seed(seed + i)
            t0 = time.perf_counter()
            plain = target.generate(ids, **kw)
            t1 = time.perf_counter()
            torch.manual_seed(seed + i)
            assisted = target.generate(ids, assistant_model=draft, **kw)
            t2 = time.perf_counter()
            plain_s.append(t1 - t0)
            assisted_s.append(t2 - t1)
            same += int(torch.equal(plain, assisted))
    finally:
        draft.generation_config = gen_cfg
    n = len(prompts) * new_tokens
    return {"hf_plain_tokens_per_s": n / sum(plain_s), "hf_assisted_tokens_per_s": n / sum(assisted_s),
            "hf_speedup": sum(plain_s) / sum(assisted_s), "identical_outputs": same, "prompts": len(prompts)}

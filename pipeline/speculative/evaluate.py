"""Measuring a built draft against its verifier (the validate/draft/speculative unit runs this in a worker):
acceptance, speed-up and costs on held-out prompts. Nothing here is part of the draft stage's identity."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from pipeline.speculative.config import DraftConfig
from pipeline.speculative.draft_model import load_causal_lm, load_draft_vocab
from pipeline.speculative.measure import compare_loops, hf_assisted, measure_costs, predicted_speedup


def measure_speculative(verifier_dir: Path, draft_dir: Path, prompts: list[str], cfg: DraftConfig, seed: int,
                        log=print, undistilled_dir: Path | None = None, fp_distilled_dir: Path | None = None,
                        device: str = "cpu") -> dict:
    """Acceptance, speed-up and costs of the draft on held-out prompts, greedy and at each configured
    temperature; also of the undistilled draft (a quarter of the prompts) and of the draft distilled
    against the full-precision model (all prompts, same verifier), when given and enabled in
    cfg.measure. See pipeline/speculative/measure.py."""
    m = cfg.measure
    tok = AutoTokenizer.from_pretrained(str(verifier_dir))
    verifier = load_causal_lm(verifier_dir, device)
    ids = encode_prompts(tok, prompts[: m.num_prompts], m.prompt_len)
    result: dict[str, Any] = {"gamma": cfg.gamma, "prompts": len(ids), "prompt_len": m.prompt_len,
                              "new_tokens": m.new_tokens}
    drafts = {"distilled": Path(draft_dir)}
    if m.compare_undistilled and undistilled_dir is not None:
        drafts["undistilled"] = Path(undistilled_dir)
    if m.compare_fp_distilled and fp_distilled_dir is not None:
        drafts["fp-distilled"] = Path(fp_distilled_dir)
    for name, path in drafts.items():
        draft, vocab = load_causal_lm(path, device), load_draft_vocab(path)
        costs = measure_costs(verifier, draft, ids[0], cfg.gamma, vocab)
        entry: dict[str, Any] = {"costs": costs, "draft_vocab_size": None if vocab is None else int(vocab.numel())}
        subset = ids if name != "undistilled" else ids[: max(1, len(ids) // 4)]
        for t in m.temperatures:
            run = compare_loops(verifier, draft, subset, m.new_tokens, cfg.gamma, t, seed, vocab, m.warmup, m.repeats,
                                label=f"speculative {name} T={t:g}")
            run["predicted_speedup"] = predicted_speedup(run["alpha_per_token"], costs, cfg.gamma)
            entry[f"t={t}"] = run
            log(f"speculative [{name}] T={t}: alpha {run['alpha']:.3f} (per token {run['alpha_per_token']:.3f}), "
                f"{run['tokens_per_target_forward']:.2f} tok/forward, speed-up {run['speedup']:.2f}x, "
                f"break-even per-token alpha {costs['break_even_alpha_per_token']}")
            if m.compare_hf_assisted and name == "distilled":
                run["hf_reference"] = hf_assisted(verifier, draft, ids[: max(1, len(ids) // 4)], m.new_tokens,
                                                  cfg.gamma, t, seed)
        result[name] = entry
    return json.loads(json.dumps(result))


def encode_prompts(tok, prompts: list[str], prompt_len: int) -> list[torch.Tensor]:
    """Each prompt's first `prompt_len` tokens as a [1, T] tensor (shorter prompts kept whole)."""
    out = [torch.tensor([tok(p, add_special_tokens=False)["input_ids"][:prompt_len]]) for p in prompts]
    empty = [i for i, t in enumerate(out) if t.shape[1] == 0]
    if empty:
        raise ValueError(f"prompts {empty} are empty after tokenization")
    return out


def wikitext_prompts(raw_text: str, n: int, min_chars: int = 300) -> list[str]:
    """`n` held-out prompts: WikiText-2 paragraphs (not headings) of at least `min_chars`,
    spread evenly through the file."""
    paras = [p.strip() for p in raw_text.split("\n") if len(p.strip()) >= min_chars and not p.strip().startswith("=")]
    if len(paras) < n:
        raise ValueError(f"only {len(paras)} WikiText paragraphs of >= {min_chars} characters; asked for {n}")
    step = len(paras) / n
    return [paras[int(i * step)] for i in range(n)]


def check_no_overlap(train_texts: list[str], prompts: list[str], probe_chars: int = 80) -> None:
    """Fail if any held-out prompt's opening appears in the training texts."""
    for p in prompts:
        probe = p[:probe_chars]
        if any(probe in t for t in train_texts):
            raise ValueError(f"held-out prompt appears in the training data: {probe!r}")


def worker_task(args: dict) -> dict:
    """The worker's "speculative" task (pipeline/base/worker.py TASKS)."""
    und = Path(args["undistilled"]) if args.get("undistilled") else None
    fp = Path(args["fp_distilled"]) if args.get("fp_distilled") else None
    return measure_speculative(Path(args["verifier"]), Path(args["draft"]), args["prompts"],
                               DraftConfig(**args["draft_cfg"]), args["seed"], logging.getLogger("compress").info,
                               undistilled_dir=und, fp_distilled_dir=fp, device=args.get("device", "cpu"))

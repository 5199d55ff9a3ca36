"""What moves acceptance and cost of a distilled draft for SmolLM2-135M on this CPU.

Every configuration is distilled for the same number of steps on the same C4 batches (the
teacher's top-k targets are computed once and shared, so the comparison is per step of student
training) and measured on the same held-out WikiText-2 prompts: acceptance greedy and at T=0.7,
the draft's and verifier's measured costs, and the speed-up those imply at the best gamma.
--validate-default builds the default DraftConfig from scratch and runs measure_speculative
(timed against plain decoding through the same loop, transformers' assisted generation beside).
Results and the exact commands: research/draft.md.

  nice -n 5 python -m research.draft_exploration --steps 60 --prompts 8 --new-tokens 48 \\
      --configs base,pool,onpolicy,jsd,copyhead,headfrozen,layers2 --undistilled --work /tmp/dx
  nice -n 5 python -m research.draft_exploration --validate-default --work /tmp/dx
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import pandas as pd
import torch
from transformers import AutoTokenizer

from pipeline.speculative.config import DraftConfig
from pipeline.speculative.decode import SpecStats, speculative_generate
from pipeline.speculative.draft_model import load_causal_lm, load_draft_vocab
from pipeline.speculative.evaluate import check_no_overlap, encode_prompts, measure_speculative, wikitext_prompts
from pipeline.speculative.measure import expected_tokens, measure_costs, repetition_rate
from pipeline.speculative.stage_api import build_draft

ROOT = Path(__file__).resolve().parents[1]
BASE = {"layers": [0], "vocab_size": 4096, "init_head": "lens",
        "distill": {"loss": "forward_kl", "train": ["layers", "norm", "head"], "on_policy_fraction": 0.0}}
# each preset changes one thing relative to BASE
PRESETS = {
    "base": {},
    "copyhead": {"init_head": "copy"},
    "layers2": {"layers": [0, 1]},
    "layers4": {"layers": [0, 1, 2, 3]},
    "even2": {"layers": [0, 29]},
    "first6": {"layers": list(range(6))},
    "first8": {"layers": list(range(8))},
    "first12": {"layers": list(range(12))},
    "first16": {"layers": list(range(16))},
    "first8last": {"layers": list(range(7)) + [29]},
    "vocab2k": {"vocab_size": 2048},
    "vocab8k": {"vocab_size": 8192},
    "fullvocab": {"vocab_size": None},
    "tvd": {"distill": {"loss": "tvd"}},
    "jsd": {"distill": {"loss": "jsd"}},
    "reverse_kl": {"distill": {"loss": "reverse_kl"}},
    "onpolicy": {"distill": {"on_policy_fraction": 0.5, "on_policy_temperature": 0.0}},
    "headfrozen": {"distill": {"train": ["layers", "norm"]}},
    "embed": {"distill": {"train": ["layers", "norm", "head", "embed"]}},
    "lr3e-4": {"distill": {"lr": 3e-4}},
    "lr3e-3": {"distill": {"lr": 3e-3}},
    "pool": {"distill": {"pool_size": 320, "steps": 160}},  # 40 distinct batches of 8, 4 epochs
}


def merged(preset: dict, steps: int, seed_cfg: dict) -> DraftConfig:
    cfg = json.loads(json.dumps(BASE))
    cfg["distill"].update(steps=steps, time_budget_s=None, **seed_cfg)
    for key, value in preset.items():
        if key == "distill":
            cfg["distill"].update(value)
        else:
            cfg[key] = value
    return DraftConfig.model_validate(cfg)


def acceptance(verifier, draft, vocab, prompts: list[torch.Tensor], new_tokens: int, gamma: int,
               temperature: float) -> dict:
    """Acceptance of `draft` over the prompts (prompt i sampled with seed i), untimed."""
    stats, reps = SpecStats(), []
    for i, ids in enumerate(prompts):
        seq, s = speculative_generate(verifier, draft, ids, new_tokens, gamma, temperature,
                                      torch.Generator().manual_seed(i), vocab)
        stats.merge(s)
        reps.append(repetition_rate(seq[0, ids.shape[1]:].tolist()))
    return {"alpha": stats.alpha, "alpha_per_token": stats.alpha_per_token,
            "tokens_per_forward": stats.tokens_per_target_forward,
            "acceptance_by_position": stats.as_dict()["acceptance_by_position"],
            "repetition": statistics.mean(reps)}


def eval_acceptance(verifier, draft_dir: Path, prompts: list[torch.Tensor], new_tokens: int, gamma: int,
                    temperatures: list[float]) -> dict:
    draft, vocab = load_causal_lm(draft_dir), load_draft_vocab(draft_dir)
    out = {"costs": measure_costs(verifier, draft, prompts[0], gamma, vocab, reps=7)}
    for t in temperatures:
        out[f"t={t}"] = acceptance(verifier, draft, vocab, prompts, new_tokens, gamma, t)
    return out


def best_gamma(a: float, costs: dict) -> tuple[int, float]:
    """The gamma (within the measured c_v range) with the highest predicted speed-up."""
    options = []
    for k, c_v in costs["c_v"].items():
        g = int(k) - 1
        if g >= 1:
            options.append((expected_tokens(a, g) / (g * costs["c_d"] + c_v), g))
    speed, g = max(options)
    return g, speed


def row(name: str, cfg: DraftConfig, m: dict, ev: dict) -> dict:
    greedy, sampled = ev["t=0.0"], ev.get("t=0.7", {})
    g, speed = best_gamma(greedy["alpha_per_token"], ev["costs"])
    return {"config": name, "layers": str(m["layers"]), "vocab": cfg.vocab_size or "full", "loss": cfg.distill.loss,
            "on_policy": cfg.distill.on_policy_fraction, "train": "+".join(cfg.distill.train), "lr": cfg.distill.lr,
            "steps": m["steps"], "train_s": round(m["train_time_s"]), "teacher_s": round(m["teacher_time_s"]),
            "top1_train": round(float("nan") if m["top1_agreement"] is None else m["top1_agreement"], 3),
            "alpha_greedy": round(greedy["alpha"], 3),
            "a_tok_greedy": round(greedy["alpha_per_token"], 3), "tok_per_fwd": round(greedy["tokens_per_forward"], 2),
            "alpha_t0.7": round(sampled.get("alpha", float("nan")), 3),
            "a_tok_t0.7": round(sampled.get("alpha_per_token", float("nan")), 3),
            "rep_greedy": round(greedy["repetition"], 2), "draft_ms": round(ev["costs"]["draft_ms"], 1),
            "c_d": round(ev["costs"]["c_d"], 3), "c_v(5)": round(ev["costs"]["c_v"]["5"], 2),
            "best_gamma": g, "pred_speedup": round(speed, 2)}


def markdown_table(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def explore(args, verifier, texts, prompts) -> None:
    work, rows, detail = Path(args.work), [], {}
    for name in args.configs.split(","):
        cfg = merged(PRESETS[name], args.steps, {"batch_size": args.batch_size, "seq_len": args.seq_len})
        t0 = time.perf_counter()
        manifest = work / name / "draft" / "draft_manifest.json"
        if args.reuse and manifest.exists():
            saved = json.loads(manifest.read_text())
            m = {**saved["distill"], "layers": saved["layers"],
                 "undistilled_dir": str(work / name / "work" / "undistilled")}
        else:
            m = build_draft(Path(args.verifier), cfg, texts, work / name / "draft", work / name / "work", args.seed,
                            targets_root=work / "targets", progress=False, save_initial=True)
        if args.undistilled and name == "base":
            zero = {**m, "steps": 0, "train_time_s": 0, "teacher_time_s": 0, "top1_agreement": float("nan")}
            for label, folder in (("undistilled", Path(m["undistilled_dir"])),
                                  ("tuned lens, no KD", work / name / "work" / "initial")):
                if folder.exists():
                    ev = eval_acceptance(verifier, folder, prompts, args.new_tokens, args.gamma, [0.0, 0.7])
                    rows.append(row(f"base ({label})", cfg, zero, ev))
                    print(json.dumps(rows[-1]), flush=True)
        ev = eval_acceptance(verifier, work / name / "draft", prompts, args.new_tokens, args.gamma, [0.0, 0.7])
        rows.append(row(name, cfg, m, ev))
        detail[name] = {"metrics": m, "eval": ev, "config": cfg.model_dump()}
        print(json.dumps(rows[-1]), f"({time.perf_counter() - t0:.0f}s)", flush=True)
        (work / "exploration.json").write_text(json.dumps(detail, indent=1, default=str))
    table = markdown_table(rows)
    print(table)
    if args.out:
        with open(args.out, "a") as f:
            f.write(f"\n### steps={args.steps}, batch {args.batch_size}x{args.seq_len}, {args.prompts} prompts x "
                    f"{args.new_tokens} tokens, gamma={args.gamma}\n\n{table}\n")


def validate_default(args, texts, prompt_texts) -> None:
    """The default recipe end to end, from scratch (no shared teacher cache): build the draft
    within its time budget, then measure_speculative on the held-out prompts."""
    work = Path(args.work) / "default"
    cfg = DraftConfig()
    t0 = time.perf_counter()
    m = build_draft(Path(args.verifier), cfg, texts, work / "draft", work / "work", args.seed, progress=False)
    print(json.dumps(m, default=str), f"(build {time.perf_counter() - t0:.0f}s)", flush=True)
    rep = measure_speculative(Path(args.verifier), work / "draft", prompt_texts, cfg, args.seed,
                              undistilled_dir=Path(m["undistilled_dir"]))
    rep["build"] = m
    (work / "report.json").write_text(json.dumps(rep, indent=1, default=str))
    print(json.dumps(rep, indent=1, default=str))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--verifier", default=str(ROOT / "artifacts/default/load"),
                    help="HF folder of the fp32 verifier (the load stage of any SmolLM2 run)")
    ap.add_argument("--work", default="/tmp/draft_exploration")
    ap.add_argument("--configs", default="base", help=f"comma-separated presets: {','.join(PRESETS)}")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is faster on a loaded machine)")
    ap.add_argument("--undistilled", action="store_true", help="also measure the base draft before distillation")
    ap.add_argument("--reuse", action="store_true", help="re-measure drafts already built in --work")
    ap.add_argument("--validate-default", action="store_true",
                    help="instead: build the default DraftConfig from scratch and run measure_speculative")
    ap.add_argument("--out", default=None, help="append the markdown table to this file")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    texts = pd.read_parquet(ROOT / "calibration/c4/c4_validation_2k.parquet")["text"].tolist()
    raw = (ROOT / "calibration/wikitext-2-raw/wiki.test.raw").read_text()
    all_prompts = wikitext_prompts(raw, 32)
    check_no_overlap(texts, all_prompts)
    if args.validate_default:
        validate_default(args, texts, all_prompts)
        return
    verifier = load_causal_lm(args.verifier)
    tok = AutoTokenizer.from_pretrained(args.verifier)
    explore(args, verifier, texts, encode_prompts(tok, all_prompts[: args.prompts], 64))


if __name__ == "__main__":
    main()

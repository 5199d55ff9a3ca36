"""Mixed precision to a budget (issue #35): the figures of a finished `recipes/mixed.toml` run, and whether the
per-block sensitivities add up.

    compress run recipes/mixed.toml
    python research/mix_report.py artifacts/mixed [--additivity 12] [--scaled-check 40]

Prints, from report.json: per variant the bits per weight budgeted / spent / measured on the checkpoint, the
perplexity ratio and KL against the baseline on the same windows; the issue's two floors (at uniform w4g64's bits
per weight, mixed's perplexity rise <= 0.8x uniform's; at 3.5 bits per weight, mixed beats uniform w3); predicted
(summed sensitivities) vs measured KL and their Pearson correlation.

--additivity N: the sensitivities' additivity at the probe itself: N random allocations, plus each mixed variant's
and every uniform one, applied with the probe's weights (RTN or GPTQ-solved) to the base model; the measured KL on
the probe's calibration rows vs the summed table entries. One forward pass per allocation.

--scaled-check N (estimator "kl-scaled"): N random (unit, candidate) pairs at a group size the probe did not run,
probed now: the scaled estimate in the table vs the KL the probe measures.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

import torch

from pipeline.quant.mix.sensitivity import Solver, Weights, input_hessians, mean_kl
from pipeline.results.mix_render import mix_of, pearson, predicted_kl
from pipeline.results.schema import load


def rows(report) -> list[dict]:
    out = []
    for name, e in report.variants.items():
        mix = mix_of(e)
        out.append({"name": name, "budget": mix["budget"]["bits_per_weight"] if mix else None,
                    "spent": mix["spent"]["bits_per_weight"] if mix else None, "bpw": e.bits_per_weight,
                    "ppl_ratio": e.ppl_ratio, "kl": e.kl, "predicted_kl": mix["predicted"]["kl"] if mix else None})
    return out


def floors(table: list[dict]) -> list[str]:
    by = {r["name"]: r for r in table}
    lines = []
    w4, w3 = by.get("gptq-w4g64"), by.get("gptq-w3g64")
    m35 = by.get("mixed-3.5")
    for name, m4 in by.items():  # mixed-4.36 and its variants (mixed-4.36-r3: another probe)
        if not name.startswith("mixed-4.36") or not (w4 and w4["ppl_ratio"] and m4["ppl_ratio"]):
            continue
        rise = (m4["ppl_ratio"] - 1) / (w4["ppl_ratio"] - 1)
        lines.append(f"floor 1: {name} perplexity rise / uniform w4g64's = {rise:.3f} (<= 0.8 wanted): "
                     f"{'met' if rise <= 0.8 else 'MISSED'}")
    if w3 and m35 and w3["ppl_ratio"] and m35["ppl_ratio"]:
        lines.append(f"floor 2: mixed-3.5 ppl ratio {m35['ppl_ratio']:.4f} vs uniform w3g64 {w3['ppl_ratio']:.4f}: "
                     f"{'met' if m35['ppl_ratio'] < w3['ppl_ratio'] else 'MISSED'}")
    return lines


def probe_weights(run_dir: Path, record: dict, model, names: list[str], keep: set):
    """The record's probe weights (RTN, or GPTQ solves on the calibration Hessians of `names`), as a Weights."""
    from safetensors.torch import load_file

    sens = record["sensitivity"]
    solver = Solver(**sens["probe"].get("solver", {}))  # records before probe_weights: RTN, symmetric
    hess: dict = {}
    if solver.weights == "gptq":
        ids = load_file(run_dir / "calibrate" / "calibration.safetensors")["input_ids"]
        hess, _ = input_hessians(model, ids[: sens["probe"]["hessian_rows"]], names)
    return Weights(solver, hess, keep)


def additivity(run_dir: Path, record: dict, n: int, seed: int = 0) -> list[tuple[str, float, float]]:
    """(allocation, predicted KL, measured KL) for n random allocations, the record's and each uniform one."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    sens = record["sensitivity"]
    units, cands, table = sens["units"], [tuple(c) for c in record["candidates"]], sens["kl"]
    ids = load_file(run_dir / "calibrate" / "calibration.safetensors")["input_ids"][: sens["probe"]["kl_rows"]]
    model = AutoModelForCausalLM.from_pretrained(run_dir / "load", dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(torch.cat([model(r[None]).logits[0].float() for r in ids]), -1)
    layers = model.get_submodule("model.layers")
    originals = {name: mod.weight.data.clone() for name, mod in layers.named_modules() if hasattr(mod, "weight")
                 and mod.weight.dim() == 2}
    weights = probe_weights(run_dir, record, model, [f"model.layers.{name}" for name in originals], set(cands))
    rng = random.Random(seed)
    allocs = {f"random-{i}": [rng.randrange(len(cands)) for _ in units] for i in range(n)}
    allocs["record"] = [cands.index((a["bits"], a["group_size"])) for a in record["allocation"].values()]
    allocs |= {f"uniform-w{b}g{g}": [j] * len(units) for j, (b, g) in enumerate(cands)}
    out = []
    for label, choice in allocs.items():
        for u, j in zip(units, choice, strict=True):
            stem = u.split(".", 1)[1]  # "3.mlp" (a block) or "3.mlp.down_proj" (a linear)
            for name, w in originals.items():
                if name == stem or name.startswith(stem + "."):
                    layers.get_submodule(name).weight.data.copy_(weights(f"model.layers.{name}", w, *cands[j]))
        with torch.no_grad():
            logits = torch.cat([model(r[None]).logits[0].float() for r in ids])
        out.append((label, sum(table[u][j] for u, j in enumerate(choice)), mean_kl(ref, logits)))
        print(f"  {label}: predicted {out[-1][1]:.4f}, measured {out[-1][2]:.4f}", flush=True)
    return out


def scaled_check(run_dir: Path, record: dict, n: int, seed: int = 0) -> list[tuple[str, float, float]]:
    """kl-scaled's estimate against the KL probe itself: for n random (unit, candidate) pairs off the probed group
    size, (label, scaled estimate from the record, KL measured by the same probe). One forward pass a pair."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from pipeline.quant.mix.config import mix_units
    from pipeline.quant.mix.sensitivity import kl_table
    from pipeline.quant.shapes import linear_shapes_from_config

    sens = record["sensitivity"]
    cands = [tuple(c) for c in record["candidates"]]
    probed = sens["probe"].get("kl_probed", "every candidate")
    if probed == "every candidate":
        raise SystemExit("--scaled-check: this record probed every candidate (estimator 'kl')")
    g_probe = int(probed.split()[1])
    arch = linear_shapes_from_config(json.loads((run_dir / "load" / "config.json").read_text()))
    units = {u.name: u for u in mix_units(arch, ["lm_head"], record["granularity"])}
    ids = load_file(run_dir / "calibrate" / "calibration.safetensors")["input_ids"][: sens["probe"]["kl_rows"]]
    model = AutoModelForCausalLM.from_pretrained(run_dir / "load", dtype=torch.float32).eval()
    weights = probe_weights(run_dir, record, model, [n for u in units.values() for n, _, _ in u.modules], set())
    rng = random.Random(seed)
    off = [j for j, (_, g) in enumerate(cands) if g != g_probe]
    out = []
    for _ in range(n):
        u, j = rng.randrange(len(sens["units"])), rng.choice(off)
        name = sens["units"][u]
        (kl,) = kl_table(model, ids, [units[name]], [cands[j]], weights, arch.layers)[0]
        out.append((f"{name} w{cands[j][0]}g{cands[j][1]}", sens["kl"][u][j], kl))
        print(f"  {out[-1][0]}: scaled {out[-1][1]:.3e}, probed {kl:.3e}", flush=True)
    return out


def first_mix_record(report, run_dir: Path) -> dict:
    """The first mixed variant's mix.json (its sensitivity tables: every mixed variant of a run shares them)."""
    mixed = [n for n, e in report.variants.items() if mix_of(e)]
    if not mixed:
        raise SystemExit(f"{run_dir}: no variant has a [quantize.mix] record")
    return json.loads((run_dir / "quantize" / mixed[0] / "mix.json").read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--additivity", type=int, default=0, help="random allocations to measure (0: skip)")
    ap.add_argument("--scaled-check", type=int, default=0,
                    help="kl-scaled: random (unit, candidate) pairs off the probed group size to probe (0: skip)")
    args = ap.parse_args(argv)
    report = load(args.run_dir)
    base = report.baseline.perplexity.value if report.baseline and report.baseline.perplexity else None
    print(f"baseline perplexity {base}")
    print("| variant | budget bpw | spent bpw | checkpoint bpw | ppl ratio | KL | predicted KL |")
    print("|---|---|---|---|---|---|---|")
    table = rows(report)
    for r in table:
        cells = [r["name"]] + [("–" if r[k] is None else f"{r[k]:.4f}")
                               for k in ("budget", "spent", "bpw", "ppl_ratio", "kl", "predicted_kl")]
        print("| " + " | ".join(cells) + " |")
    for line in floors(table):
        print(line)
    pairs = predicted_kl(report)
    r = pearson([p for _, p, _ in pairs], [k for _, _, k in pairs])
    print(f"predicted (calibration probe, summed) vs measured (GPTQ, evaluation text) KL over {len(pairs)} "
          f"models: Pearson {r if r is None else round(r, 3)}")
    if args.additivity:
        got = additivity(args.run_dir, first_mix_record(report, args.run_dir), args.additivity)
        r = pearson([p for _, p, _ in got], [m for _, _, m in got])
        print(f"additivity at the probe (its weights, its calibration rows), {len(got)} allocations: "
              f"Pearson {r if r is None else round(r, 3)}")
    if args.scaled_check:
        got = scaled_check(args.run_dir, first_mix_record(report, args.run_dir), args.scaled_check)
        r = pearson([math.log(p) for _, p, _ in got], [math.log(m) for _, _, m in got])
        ratios = sorted(p / m for _, p, m in got)
        print(f"kl-scaled vs probed KL, {len(got)} pairs: Pearson of the logs {r if r is None else round(r, 3)}, "
              f"scaled/probed median {ratios[len(ratios) // 2]:.3f} (range {ratios[0]:.3f} to {ratios[-1]:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Why the static-scale W8A8 row loses so much on SmolLM2: each linear's one calibrated input scale (max |x| over the
calibration tokens / 127.5) against the per-token maxima the dynamic scheme uses, on WikiText-2 tokens through the
baseline. The ratio says how many times coarser the static grid is for a typical token.

    PYTHONPATH=$PWD python -m research.w8a8_static_range artifacts/w8a8 \\
        --out benchmarks/results/w8a8/static_range.json
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from pipeline.base.env import tame
from research.ct_export import ids_for


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    tame()
    state = load_file(a.run / "quantize" / "w8a8-int8-static" / "model.safetensors")
    scales = {k.removesuffix(".input_scale"): float(v) * 127.5 for k, v in state.items() if k.endswith(".input_scale")}
    model = AutoModelForCausalLM.from_pretrained(a.run / "load", dtype=torch.float32).eval()
    ids = ids_for(a.run / "load", 2048)[: a.tokens].unsqueeze(0)
    ratios: dict[str, list[float]] = {}
    hooks = []
    for name in scales:
        def hook(_m, args, _o, n=name):
            per_token = args[0].reshape(-1, args[0].shape[-1]).abs().amax(-1)
            ratios.setdefault(n.rpartition(".")[2], []).append(scales[n] / float(per_token.median()))
        hooks.append(model.get_submodule(name).register_forward_hook(hook))
    with torch.no_grad():
        model(ids)
    out = {kind: {"median": round(statistics.median(r), 1), "max": round(max(r), 1)} for kind, r in ratios.items()}
    print(json.dumps(out, indent=2))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"tokens": a.tokens, "static_over_median_token_max": out}, indent=2) + "\n")


if __name__ == "__main__":
    main()

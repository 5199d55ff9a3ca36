"""Why the GPTQ export and its compressed-tensors rewrite give different bfloat16 perplexities (28.3279 vs 28.3556 in
benchmarks/README_quant.md section 10) although their float32 NLLs are equal to the bit.

Both reloads round the float16 GPTQ scales to bfloat16 (GPTQModel's TorchAtenLinear.transform_cpu; transformers'
compressed-tensors loader creates weight_scale in the model's dtype). They differ in one rounding:
  GPTQ reload: aten._weight_int4pack_mm_for_cpu multiplies (q - z) by the bfloat16 scale inside the matmul and
               accumulates in float32: the weight it uses is (q - z) * bf16(s), unrounded;
  CT reload:   the decompressor computes (q - z) * bf16(s) in bfloat16 and stores a dense bfloat16 weight:
               bf16((q - z) * bf16(s)), a product of up to 4 + 8 significant bits rounded to 8.
This probes layer 0's q_proj on real WikiText-2 activations: each reload's output against both formulas, and how
many weights the second rounding changes.

    PYTHONPATH=$PWD python -m research.ct_bf16_rounding --gptq /tmp/fresh/artifacts/default/export/gptq-w4g64 \\
        --ct /tmp/ct-real --out benchmarks/results/ct_export/bf16_rounding.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from pipeline.base.env import tame
from pipeline.quant.checkpoint import load_checkpoint
from pipeline.quant.formats.ct_export import gptq_integers
from research.ct_export import ids_for

LAYER = "model.layers.0.self_attn.q_proj"


def io_of(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    seen = {}
    lin = model.get_submodule(LAYER)
    h = lin.register_forward_hook(lambda _m, a, o: seen.update(x=a[0].detach(), y=o.detach()))
    with torch.no_grad():
        model(ids)
    h.remove()
    return seen["x"].reshape(-1, seen["x"].shape[-1]), seen["y"].reshape(-1, seen["y"].shape[-1])


def share(a: torch.Tensor, b: torch.Tensor) -> float:
    return round(float((a == b).float().mean()), 6)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gptq", type=Path, required=True)
    ap.add_argument("--ct", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    tame()
    ids = ids_for(a.gptq, 2048)[: a.tokens].unsqueeze(0)
    xg, yg = io_of(load_checkpoint(a.gptq), ids)
    xc, yc = io_of(load_checkpoint(a.ct), ids)
    qc = json.loads((a.gptq / "config.json").read_text())["quantization_config"]
    state = {k: v for f in sorted(a.gptq.glob("*.safetensors")) for k, v in load_file(f).items()}
    t = {leaf: state[f"{LAYER}.{leaf}"] for leaf in ("qweight", "qzeros", "scales", "g_idx")}
    q, z, s = gptq_integers(t, qc["bits"], qc["group_size"], qc.get("checkpoint_format", "gptq") == "gptq")
    g = q.shape[1] // s.shape[1]
    s_bf = s.to(torch.bfloat16).float().repeat_interleave(g, 1)
    w_unrounded = (q - z.repeat_interleave(g, 1)).float() * s_bf  # exact in float32
    w_rounded = w_unrounded.to(torch.bfloat16).float()
    x = xg.float()
    out = {
        "layer": LAYER, "tokens": int(ids.shape[1]), "inputs_equal": bool(torch.equal(xg, xc)),
        "dtype": str(yg.dtype).removeprefix("torch."),
        "weights_changed_by_bf16_rounding_of_product": round(float((w_unrounded != w_rounded).float().mean()), 6),
        "gptq_reload_equals": {"unrounded_product": share(yg, (x @ w_unrounded.t()).to(yg.dtype)),
                               "bf16_rounded_product": share(yg, (x @ w_rounded.t()).to(yg.dtype))},
        "ct_reload_equals": {"unrounded_product": share(yc, (x @ w_unrounded.t()).to(yc.dtype)),
                             "bf16_rounded_product": share(yc, (x @ w_rounded.t()).to(yc.dtype))},
        "gptq_vs_ct_outputs_equal": share(yg, yc),
        "max_abs_output_diff_gptq_vs_ct": float((yg.float() - yc.float()).abs().max()),
    }
    print(json.dumps(out, indent=2))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()

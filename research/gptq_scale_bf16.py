"""Does vLLM's load of a GPTQ export's float16 scales into bfloat16 parameters cost precision?

vLLM 0.32 (GPTQ on CPU) registers each layer's `scales` with the model's dtype (bfloat16 on a CPU: a float32 or
float16 config is cast to it) and fills it with `param.data.copy_(loaded_weight)` (vllm/model_executor/parameter.py):
the checkpoint's float16 scales are rounded to bfloat16's 8 significant bits. This script makes that rounding alone,
in process: the export's scales rounded float16 -> bfloat16 -> float16 (exact in float16 for these magnitudes,
checked), everything else as the run computes it (float32), and the perplexity of both on the run's quality windows.

    .venv/bin/python -m research.gptq_scale_bf16 --run artifacts/ci-real --model gptq-w4g64

Answer (7 Dec 2026, ci-real's SmolLM2-135M GPTQ w4g64, 2 windows of 2048): 1,453,686 of 1,658,880 scales change
(at most 0.39 %, bfloat16's half step), and the perplexity is bit-identical (24.390481061126653 both ways): the
in-process figure already uses bfloat16 scales, because GPTQModel's CPU kernel (TorchAtenLinear.transform_cpu) casts
them to bfloat16 for aten's int4 matmul, as vLLM does on load. The cast costs nothing against what the run scores.
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True, type=Path)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)

    import torch
    from safetensors.torch import load_file, save_file

    from pipeline.eval.perplexity import make_windows, perplexity, windowed_nll
    from pipeline.eval.quality import EVAL_IDS
    from pipeline.quant.checkpoint import load_checkpoint

    folder = a.run / "quantize" / a.model
    quality = json.loads((a.run / "validate" / a.model / "quality" / "metrics.json").read_text())["perplexity"]
    ids = load_file(a.run / "validate" / "baseline" / "quality" / EVAL_IDS)["input_ids"]
    windows = make_windows(len(ids), quality["window"], quality["stride"], quality["windows"])
    out: dict = {"model": a.model, "windows": len(windows), "in_process_recorded": quality["value"]}
    with tempfile.TemporaryDirectory() as tmp:
        rounded = Path(tmp) / a.model
        shutil.copytree(folder, rounded)
        worst, changed, total = 0.0, 0, 0
        for f in sorted(rounded.glob("*.safetensors")):
            tensors = load_file(f)
            for k, t in tensors.items():
                if k.endswith(".scales") and t.dtype == torch.float16:
                    r = t.to(torch.bfloat16).to(torch.float16)
                    assert torch.equal(r.float(), t.to(torch.bfloat16).float()), "bfloat16 value not exact in float16"
                    rel = ((r.float() - t.float()).abs() / t.float().abs().clamp_min(1e-12)).max().item()
                    worst, changed, total = max(worst, rel), changed + int((r != t).sum()), total + t.numel()
                    tensors[k] = r
            save_file(tensors, f, metadata={"format": "pt"})
        out |= {"scales": total, "scales_changed": changed, "max_relative_change": worst}
        for label, path in (("float16_scales", folder), ("bfloat16_scales", rounded)):
            model = load_checkpoint(path, "cpu")
            nll, n = windowed_nll(model, ids, windows)
            out[label] = perplexity(nll, n)
            del model
    out["ratio"] = out["bfloat16_scales"] / out["float16_scales"]
    print(json.dumps(out, indent=2))
    if a.out:
        a.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()

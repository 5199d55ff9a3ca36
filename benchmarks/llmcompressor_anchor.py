"""llm-compressor, the anchor for compressed-tensors and W8A8 (issue #34), beside compress on the same model,
calibration tokens and perplexity windows: its folders are written by llm-compressor in its own environment
(benchmarks/llmcompressor_worker.py) and evaluated here the way compress evaluates any checkpoint (load_checkpoint:
activations quantized in the forward pass, an FP8 KV cache applied), against the run's own baseline reference.

llm-compressor cannot be installed beside compress (it pins transformers 5.17, huggingface_hub 1.x, auto-round 0.15):
    python3 -m venv /work/venv-llmc && /work/venv-llmc/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1

Compare (RUN: a finished `compress run`, e.g. recipes/w8a8.toml; its load/, calibrate/ and baseline reference):
    PYTHONPATH=$PWD python -m benchmarks.llmcompressor_anchor compare artifacts/w8a8 --venv /work/venv-llmc \
        --out benchmarks/results/llmcompressor [--schemes w8a8,sq-w8a8,...] [--ours summary.json]

The test fixture (a tiny random Llama written by llm-compressor: tests/fixtures/llmcompressor-w8a8-kv):
    PYTHONPATH=$PWD python -m benchmarks.llmcompressor_anchor fixture tests/fixtures/llmcompressor-w8a8-kv \
        --venv /work/venv-llmc
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# OUT/llmcompressor.json, written by `compare`
OUTPUT_KEYS = ("run", "baseline_perplexity", "windows", "window", "ours", "rows")

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "benchmarks" / "llmcompressor_worker.py"
# scheme -> (calibration rows handed to llm-compressor, the compress row it stands beside in recipes/w8a8.toml)
SCHEMES = {
    "w8a8": (16, "w8a8-int8"),
    "sq-w8a8": (16, "w8a8-int8-sq"),
    "sq-gptq-w8a8": (16, "w8a8-int8-gptq"),
    "fp8-dynamic": (16, "w8a8-fp8"),
    "w8a8-kv": (16, None),
    "gptq-w4a16-g64": (64, "gptq-w4g64-ct"),
    "gptq-w4a16-g64-mse": (64, "gptq-w4g64-ct"),
}


def llmcompressor(venv: Path, model: Path, calib: Path, scheme: str, out: Path, rows: int) -> dict:
    """Run llm-compressor's oneshot in its own environment; the folder it wrote and its run record."""
    if out.exists():
        shutil.rmtree(out)
    log = out.parent / f"{out.name}.log"
    with open(log, "w") as fh:
        p = subprocess.run([str(venv / "bin" / "python"), str(WORKER), str(model), str(calib), scheme, str(out),
                            "--rows", str(rows)], stdout=fh, stderr=subprocess.STDOUT)
    if p.returncode != 0:
        raise SystemExit(f"llm-compressor {scheme} exited {p.returncode}: {log.read_text()[-3000:]}")
    return json.loads((out / "llmcompressor_run.json").read_text())


def compare(args) -> None:
    from pipeline.eval.config import PerplexityConfig, SmokeConfig
    from pipeline.eval.quality import evaluate

    run = args.run
    base = json.loads((run / "validate" / "baseline" / "quality" / "metrics.json").read_text())
    ppl = base["perplexity"]
    cfg = PerplexityConfig(dataset=ppl["dataset"], seq_len=ppl["window"], max_windows=ppl["windows"],
                           stride=None if ppl["stride"] == ppl["window"] else ppl["stride"])
    ours = json.loads(args.ours.read_text()) if args.ours else {}
    args.out.mkdir(parents=True, exist_ok=True)
    folders = args.folders or Path(tempfile.mkdtemp(prefix="llmc-"))
    result = args.out / "llmcompressor.json"
    schemes = args.schemes.split(",")
    rows = [r for r in json.loads(result.read_text())["rows"] if r["scheme"] not in schemes] if result.exists() else []
    for scheme in schemes:
        n, ours_row = SCHEMES[scheme]
        folder = folders / scheme
        t0 = time.perf_counter()
        rec = llmcompressor(args.venv, run / "load", run / "calibrate" / "calibration.safetensors", scheme, folder, n)
        wall = time.perf_counter() - t0
        scratch = Path(tempfile.mkdtemp(prefix="llmc-eval-"))
        q = evaluate(folder, scratch, cfg, SmokeConfig(enabled=False), "cpu",
                     run / "validate" / "baseline" / "quality", f"llm-compressor {scheme}")
        shutil.rmtree(scratch, ignore_errors=True)
        p = q["perplexity"]
        row = {"scheme": scheme, "llmcompressor": rec, "wall_s": round(wall, 1), "perplexity": p["value"],
               "ppl_ratio": p["value"] / ppl["value"], "kl": p["kl"], "top1": p["top1"],
               "size_on_disk_bytes": q["size_on_disk_bytes"],
               "quantization_config": json.loads((folder / "config.json").read_text())["quantization_config"]}
        if ours_row and ours_row in ours:
            o = ours[ours_row]
            row["compress"] = {"row": ours_row, "perplexity": o["perplexity"], "ppl_ratio": o["ppl_ratio"],
                               "kl": o["kl"], "quantize_time_s": o.get("quantize_time_s")}
        rows.append(row)
        print(f"{scheme:16s} ratio {row['ppl_ratio']:.4f} KL {row['kl']:.4f} top1 {row['top1']:.3f} "
              f"oneshot {rec['oneshot_s']:.0f} s" + (f" | compress {ours_row} ratio {row['compress']['ppl_ratio']:.4f}"
                                                     f" KL {row['compress']['kl']:.4f}" if "compress" in row else ""),
              flush=True)
        result.write_text(json.dumps(
            {"run": str(run), "baseline_perplexity": ppl["value"], "windows": ppl["windows"], "window": ppl["window"],
             "ours": str(args.ours) if args.ours else None, "rows": rows}, indent=2) + "\n")


def fixture(args) -> None:
    """A tiny random Llama (tests/serve_helpers.tiny_export) quantized by llm-compressor to W8A8 with an FP8 KV cache
    on 8 random rows of 64 tokens: what tests/e2e/test_quantized_source.py loads as a folder from another tool."""
    import torch
    from safetensors.torch import save_file

    from tests.serve_helpers import tiny_export

    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_export(Path(tmp) / "tiny")
        calib = Path(tmp) / "calibration.safetensors"
        save_file({"input_ids": torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(0))}, calib)
        llmcompressor(args.venv, model, calib, args.scheme, args.out, 8)
    (args.out.parent / f"{args.out.name}.log").unlink(missing_ok=True)
    print(f"wrote {args.out}: {sorted(p.name for p in args.out.iterdir())}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compare")
    c.add_argument("run", type=Path)
    c.add_argument("--venv", type=Path, required=True, help="llm-compressor's environment")
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--schemes", default="w8a8,sq-w8a8,sq-gptq-w8a8,fp8-dynamic,gptq-w4a16-g64,gptq-w4a16-g64-mse")
    c.add_argument("--ours", type=Path, help="compress's figures on the same run's windows (w8a8_summary.py output)")
    c.add_argument("--folders", type=Path, help="keep llm-compressor's folders here (default: a temporary folder)")
    f = sub.add_parser("fixture")
    f.add_argument("out", type=Path)
    f.add_argument("--venv", type=Path, required=True)
    f.add_argument("--scheme", default="w8a8-kv")
    args = ap.parse_args()
    {"compare": compare, "fixture": fixture}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())

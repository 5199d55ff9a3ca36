"""AWQ with GPTQModel's own clipping search against ours (pipeline/quant/awq_clip.py: the same search computed
as batched matrix products).

Same model, same calibration rows, same AWQ settings (w4g64, zero point, bfloat16 as the recipe runs it on CPU);
each mode quantizes in a fresh interpreter, alternating, --reps times; wall time covers load + quantize (not the
interpreter's start or imports). Then each checkpoint's perplexity on held-out C4 (the calibration corpus's last
200 documents, never calibrated on): the two searches differ only where two clipping ratios' errors are within
bfloat16 rounding of each other, so the checkpoints differ in a few groups and their quality should not.

  # SmolLM2-135M as recipes/methods.toml loads it, with its calibration rows (run that recipe first):
  python -m research.awq_clip_search --rows 8
  # the first 3 decoder layers only (minutes):
  python -m research.awq_clip_search --rows 8 --layers 3
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
METHODS = ROOT / "artifacts" / "methods"
MODES = ("library", "matmul")


def one(mode: str, model_dir: Path, calibration: Path, rows: int, out: Path) -> dict:
    """Quantize in this interpreter with `mode`'s clipping search; returns seconds and the checkpoint's sha256."""
    from pipeline.base.env import tame

    tame()
    from safetensors.torch import load_file

    from pipeline.quant import awq
    from pipeline.quant.methods.awq import AWQVariant

    if mode == "library":
        awq.matmul_clip_search = contextlib.nullcontext
    ids = next(iter(load_file(str(calibration)).values()))[:rows]
    variant = AWQVariant(name="bench", method="awq", group_size=64)
    with awq.session(out):
        start = time.perf_counter()
        model = awq.quantize(model_dir.resolve(), variant, ids, sys.stderr, "cpu")
        seconds = time.perf_counter() - start
        awq.save(model, model_dir.resolve(), out, variant)
    digest = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    return {"mode": mode, "seconds": seconds, "sha256": digest}


def truncated(model_dir: Path, layers: int, folder: Path) -> Path:
    """model_dir with only its first `layers` decoder layers (same weights)."""
    from safetensors.torch import load_file, save_file

    folder.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "manifest.json":
            shutil.copy(f, folder / f.name)
    config = json.loads((model_dir / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update({k: v for k, v in load_file(f).items()
                        if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers})
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def child(args: list[str]) -> dict:
    p = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if p.returncode != 0 or line is None:
        sys.exit(f"{' '.join(args[:3])} failed:\n{p.stderr[-4000:]}")
    return json.loads(line[7:])


def ppl(model_dir: Path, ids_file: Path, seq_len: int, windows: int) -> dict:
    """Perplexity of a checkpoint loaded as validate loads it (pipeline/quant/checkpoint.py), in this interpreter."""
    from pipeline.base.env import tame

    tame()
    from safetensors.torch import load_file

    from pipeline.eval.perplexity import gptq_windows, perplexity, windowed_nll
    from pipeline.quant.checkpoint import load_checkpoint

    ids = load_file(str(ids_file))["input_ids"]
    model = load_checkpoint(model_dir)
    nll, n = windowed_nll(model, ids, gptq_windows(len(ids), seq_len, windows))  # (in inference mode itself)
    return {"ppl": perplexity(nll, n), "tokens": n}


def heldout_ppl(model_dir: Path, windows: int, seq_len: int, work: Path) -> float:
    """Perplexity on held-out C4 in a fresh interpreter (benchmarks/quantize_vs_gptqmodel.py's held-out text)."""
    from transformers import AutoTokenizer

    from benchmarks.quantize_vs_gptqmodel import heldout_c4_ids, save_ids

    ids = work / "heldout_c4.safetensors"
    if not ids.exists():
        save_ids(heldout_c4_ids(AutoTokenizer.from_pretrained(model_dir)), ids)
    return child(["research.awq_clip_search", "--ppl", str(ids), "--model", str(model_dir), "--ppl-windows",
                  str(windows), "--ppl-seq-len", str(seq_len)])["ppl"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=METHODS / "load", help="HF checkpoint folder")
    ap.add_argument("--layers", type=int, help="keep only the first N decoder layers")
    ap.add_argument("--calibration", type=Path, default=METHODS / "calibrate" / "calibration.safetensors")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--ppl-windows", type=int, default=8, help="held-out C4 windows (0: no perplexity)")
    ap.add_argument("--ppl-seq-len", type=int, default=512)
    ap.add_argument("--json", type=Path, help="write the results here too")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--ppl", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print("RESULT " + json.dumps(one(a.one, a.model, a.calibration, a.rows, a.out)), flush=True)
        return
    if a.ppl:
        print("RESULT " + json.dumps(ppl(a.model, a.ppl, a.ppl_seq_len, a.ppl_windows)), flush=True)
        return
    for path, what in ((a.calibration, "calibration rows"), (a.model / "config.json", "checkpoint")):
        if not path.is_file():
            sys.exit(f"{path} not found ({what}): run `compress run recipes/methods.toml` first, or pass --model and "
                     "--calibration")
    with tempfile.TemporaryDirectory(prefix="awq-clip-") as tmp:
        model = truncated(a.model, a.layers, Path(tmp) / "model") if a.layers else a.model
        runs: dict[str, list[dict]] = {m: [] for m in MODES}
        for rep in range(a.reps):
            for mode in MODES:
                out = Path(tempfile.mkdtemp(dir=tmp, prefix=f"{mode}-"))
                runs[mode].append({**child(["research.awq_clip_search", "--one", mode, "--out", str(out), "--model",
                                            str(model), "--calibration", str(a.calibration), "--rows",
                                            str(a.rows)]), "out": str(out)})
                print(f"rep {rep + 1} {mode:<8} {runs[mode][-1]['seconds']:8.1f} s", flush=True)
        ppls: dict[str, float] = {}
        if a.ppl_windows:
            ppls["baseline"] = heldout_ppl(model, a.ppl_windows, a.ppl_seq_len, Path(tmp))
            for mode in MODES:
                ppls[mode] = heldout_ppl(Path(runs[mode][0]["out"]), a.ppl_windows, a.ppl_seq_len, Path(tmp))
    ref = statistics.median(r["seconds"] for r in runs["library"])
    print(f"\nmodel {a.model}{f' (first {a.layers} layers)' if a.layers else ''}; {a.rows} calibration rows; AWQ "
          f"w4g64, bfloat16; median of {a.reps}" + (f"; held-out C4 {a.ppl_windows} x {a.ppl_seq_len}, baseline "
                                                    f"{ppls['baseline']:.3f}" if ppls else ""))
    print(f"{'mode':<10}{'seconds':>10}{'library / mode':>16}{'held-out ppl':>14}")
    rows = []
    for mode, rs in runs.items():
        med = statistics.median(r["seconds"] for r in rs)
        rows.append({"mode": mode, "median_s": med, "speedup": ref / med, "heldout_ppl": ppls.get(mode), "runs": rs})
        print(f"{mode:<10}{med:>10.1f}{ref / med:>16.2f}{ppls.get(mode, float('nan')):>14.3f}")
    same = runs["library"][0]["sha256"] == runs["matmul"][0]["sha256"]
    print(f"same bytes: {same}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"command": "python -m research.awq_clip_search " + " ".join(sys.argv[1:]),
                                      "baseline_heldout_ppl": ppls.get("baseline"), "same_bytes": same,
                                      "results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()

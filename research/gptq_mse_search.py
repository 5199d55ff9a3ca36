"""GPTQ with GPTQModel's own `mse` scale search against ours (pipeline/quant/gptq_search.py: the same search
minus the whole-matrix round whose answer GPTQModel discards).

Same model, same calibration rows, same GPTQ settings; each mode quantizes in a fresh interpreter, alternating,
--reps times; wall time covers load + quantize (not interpreter start or imports). Prints each mode's median time,
its ratio to the library's, and whether its checkpoint bytes equal the library's.

  # SmolLM2-135M as recipes/ci-real.toml loads it, its calibration rows (run that recipe first):
  python -m research.gptq_mse_search --rows 4
  # SmolLM2-1.7B's shape, 2 decoder layers, random weights:
  python -m research.gptq_mse_search --config smollm2-1.7b --layers 2 --rows 4
(--modes library,search,threads,both also times torch's intra-op threads divided among GPTQModel's CPU workers:
faster on the 135M model, slower on the 1.7B shape, so not adopted; results in benchmarks/README_quant.md §7.)
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CI_REAL = ROOT / "artifacts" / "ci-real"
MODES = ("library", "search")
ALL_MODES = ("library", "search", "threads", "both")


def one(mode: str, model_dir: Path, calibration: Path, rows: int, mse: float, out: Path) -> dict:
    """Quantize in this interpreter with `mode`'s changes on; returns seconds and the checkpoint's sha256."""
    from pipeline.base.env import tame

    tame()
    import torch
    from safetensors.torch import load_file

    from pipeline.quant import gptq
    from pipeline.quant.gptq_search import group_search_only
    from pipeline.quant.methods.gptq import GPTQVariant

    workers = int(os.environ["GPTQMODEL_CPU_WORKERS"])

    @contextlib.contextmanager
    def loop():
        with contextlib.ExitStack() as stack:
            if mode in ("threads", "both"):  # torch's threads divided among GPTQModel's worker threads
                before = torch.get_num_threads()
                torch.set_num_threads(max(1, before // workers))
                stack.callback(torch.set_num_threads, before)
            if mode in ("search", "both"):
                stack.enter_context(group_search_only())
            yield

    gptq.group_search_only = loop
    ids = next(iter(load_file(str(calibration)).values()))[:rows]
    variant = GPTQVariant(name="bench", method="gptq", bits=4, group_size=64, mse=mse)
    with gptq.session(out):
        start = time.perf_counter()
        model = gptq.quantize(model_dir.resolve(), variant, ids, sys.stderr, "cpu")
        seconds = time.perf_counter() - start
        gptq.save(model, model_dir.resolve(), out, variant)
    digest = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    return {"mode": mode, "seconds": seconds, "sha256": digest}


def random_model(config_name: str, layers: int, folder: Path) -> Path:
    from transformers import AutoConfig

    from pipeline.model.materialize import random_to_safetensors
    from pipeline.model.models import DEFAULT_TOKENIZER, load_tokenizer
    from pipeline.model.sources import parse

    spec = json.loads((ROOT / "pipeline" / "model_configs" / f"{config_name}.json").read_text())
    spec["num_hidden_layers"] = layers
    folder.mkdir(parents=True)
    random_to_safetensors(AutoConfig.for_model(**spec), folder, "float32", seed=0)
    load_tokenizer(parse(DEFAULT_TOKENIZER)).save_pretrained(folder)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=CI_REAL / "load", help="HF checkpoint folder")
    ap.add_argument("--config", help="instead of --model: a pipeline/model_configs name, random weights")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers kept with --config")
    ap.add_argument("--calibration", type=Path, default=CI_REAL / "calibrate" / "calibration.safetensors")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--mse", type=float, default=2.4, help="the recipe default 2.4; 0 = plain min/max")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--json", type=Path, help="write the results here too")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print("RESULT " + json.dumps(one(a.one, a.model, a.calibration, a.rows, a.mse, a.out)), flush=True)
        return
    unknown = set(a.modes.split(",")) - set(ALL_MODES)
    if unknown:
        ap.error(f"unknown mode(s) {', '.join(sorted(unknown))}: choose from {', '.join(ALL_MODES)}")
    if not a.calibration.is_file():
        sys.exit(f"{a.calibration} not found: run `compress run recipes/ci-real.toml` first, or pass --calibration")
    if not a.config and not (a.model / "config.json").is_file():
        sys.exit(f"{a.model} is not a checkpoint folder: run `compress run recipes/ci-real.toml` first, or pass "
                 "--model or --config")
    with tempfile.TemporaryDirectory(prefix="gptq-cpu-") as tmp:
        model = random_model(a.config, a.layers, Path(tmp) / "model") if a.config else a.model
        runs: dict[str, list[dict]] = {m: [] for m in a.modes.split(",")}
        for rep in range(a.reps):
            for mode in runs:
                out = Path(tempfile.mkdtemp(dir=tmp))
                p = subprocess.run([sys.executable, "-m", "research.gptq_mse_search", "--one", mode, "--out",
                                    str(out), "--model", str(model), "--calibration", str(a.calibration),
                                    "--rows", str(a.rows), "--mse", str(a.mse)], cwd=ROOT, capture_output=True,
                                   text=True)
                line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
                if line is None:
                    sys.exit(f"{mode} failed:\n{p.stderr[-4000:]}")
                runs[mode].append(json.loads(line[7:]))
                print(f"rep {rep + 1} {mode:<8} {runs[mode][-1]['seconds']:8.1f} s", flush=True)
    ref = statistics.median(r["seconds"] for r in runs["library"]) if "library" in runs else None
    ref_sha = runs["library"][0]["sha256"] if "library" in runs else None
    rows = []
    print(f"\nmodel {a.config + f' ({a.layers} layers, random)' if a.config else a.model}; {a.rows} calibration rows;"
          f" GPTQ w4g64 mse {a.mse}; median of {a.reps}")
    print(f"{'mode':<10}{'seconds':>10}{'library / mode':>16}  same bytes as library")
    for mode, rs in runs.items():
        med = statistics.median(r["seconds"] for r in rs)
        same = all(r["sha256"] == ref_sha for r in rs) if ref_sha else None
        rows.append({"mode": mode, "median_s": med, "speedup": ref / med if ref else None, "same_bytes": same,
                     "runs": rs})
        print(f"{mode:<10}{med:>10.1f}{(ref / med if ref else float('nan')):>16.2f}  {same}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "results": rows}, indent=2))


if __name__ == "__main__":
    main()

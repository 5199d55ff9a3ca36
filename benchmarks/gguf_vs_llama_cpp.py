"""Our Q4_K_M GGUF beside the one llama.cpp's own tools make, and llama.cpp's decode speed beside ours.

    .venv/bin/python -m benchmarks.gguf_vs_llama_cpp --run artifacts/methods [--windows 3] [--threads 2]
        [--speed-variants gptq-w4g64,torchao-int8wo] [--autoround-iters 200]

Needs the gguf-kquants extra (llama-cpp-python: llama.cpp's quantizer and runtime) and a finished run of
recipes/methods.toml (its load/ baseline and quantize/ variants). Every GGUF is made from the run's baseline:
- "llama.cpp quantize": llama.cpp's own flow, an F16 GGUF of the baseline (what convert_hf_to_gguf.py --outtype f16
  writes; here our converter, the same tensor map) quantized by llama_model_quantize (the llama-quantize tool), no
  importance matrix (llama-cpp-python builds no llama-imatrix, and its quantize parameters take the matrix only as a
  C++ object);
- "compress gguf": the pipeline's `method = "gguf"`, type Q4_K_M, allow_fallback (a float GGUF in the baseline's
  dtype, then the same quantizer);
- "compress autoround -> gguf" (--autoround-iters > 0): auto-round's tuned rounding exported by auto-round itself as
  gguf:q4_k_m, if this auto-round can write it for the model.
Perplexity: `compress eval` (transformers, dequantized) on the first --windows WikiText-2 windows of 2048 tokens,
the windows of the run's report. Decode: llama.cpp (llama-cpp-python, --threads threads) greedy over a 64-token
WikiText prompt, 32 new tokens, batch 1, the 31 tokens after the first timed (as our speed stage does), median of 7
runs after a warm-up; our
transformers figure is `compress bench` with the same prompt length, token count and threads. Writes
benchmarks/results/gguf_vs_llama_cpp.json and prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

# benchmarks/results/gguf_vs_llama_cpp.json
OUTPUT_KEYS = ("baseline_ppl", "windows", "threads", "gguf", "transformers")

ROOT = Path(__file__).resolve().parents[1]


def compress(*args: str) -> None:
    r = subprocess.run([sys.executable, "-m", "pipeline.app.cli", *args], cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"compress {' '.join(args)} failed ({r.returncode}):\n{r.stderr[-3000:]}")


def perplexity(folder: Path, windows: int, threads: int) -> dict:
    out = folder / "eval"
    if (out / "quality.json").is_file():  # measured by an earlier call on the same file
        return {"ppl": json.loads((out / "quality.json").read_text())["perplexity"]["value"]}
    compress("eval", str(folder), "--max-windows", str(windows), "--threads", str(threads), "--out", str(out))
    return {"ppl": json.loads((out / "quality.json").read_text())["perplexity"]["value"]}


def gguf_variant(base: Path, out: Path, gguf_type: str) -> Path:
    """The pipeline's own GGUF variant (pipeline.quant.api.quantize_variant): the folder it writes."""
    from pydantic import TypeAdapter

    from pipeline.quant.api import quantize_variant
    from pipeline.quant.registry import QuantVariant

    v = TypeAdapter(QuantVariant).validate_python({"name": out.name, "method": "gguf", "type": gguf_type,
                                                   "allow_fallback": True})
    if not any(out.glob("*.gguf")):
        shutil.rmtree(out, ignore_errors=True)
        quantize_variant(base, v, None, out, logging.getLogger("bench"), seed=0, device="cpu")
    return out


def llama_cpp_quantize(f16_folder: Path, out: Path, gguf_type: str) -> Path:
    from pipeline.quant.formats.gguf_export import llama_quantize

    src = next(f16_folder.glob("*.gguf"))
    out.mkdir(parents=True, exist_ok=True)
    dst = out / src.name.replace("-F16.gguf", f"-{gguf_type}.gguf")
    if not dst.exists():
        llama_quantize(src, dst, gguf_type)
    for f in f16_folder.iterdir():
        if f.is_file() and not f.name.endswith(".gguf"):
            shutil.copyfile(f, out / f.name)
    return out


def autoround_gguf(base: Path, calib: Path, out: Path, iters: int) -> Path | None:
    """auto-round's tuned Q4_K_M, exported by auto-round (None, with the reason printed, if it cannot)."""
    if any(out.glob("*.gguf")):
        return out
    import torch
    from auto_round import AutoRound
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = load_file(calib)["input_ids"]  # the run's calibration rows, as every other method used them
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(base)
    data = [row.unsqueeze(0) for row in ids]
    try:
        ar = AutoRound(model, tokenizer=tok, scheme="gguf:q4_k_m", iters=iters, nsamples=len(ids),
                       seqlen=ids.shape[1], dataset=data, device_map="cpu", enable_torch_compile=False)
        scratch = out.parent / f".{out.name}-export"
        ar.quantize_and_save(str(scratch), format="gguf:q4_k_m")
    except Exception as e:  # noqa: BLE001 - reported, the row is left out
        print(f"auto-round gguf:q4_k_m failed: {type(e).__name__}: {e}")
        return None
    out.mkdir(parents=True, exist_ok=True)
    for f in scratch.rglob("*.gguf"):
        shutil.move(str(f), out / f.name)
    for f in base.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copyfile(f, out / f.name)
    shutil.rmtree(scratch, ignore_errors=True)
    return out


def llama_cpp_decode(folder: Path, prompt: list[int], new_tokens: int, threads: int, repeats: int = 7) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=str(next(folder.glob("*.gguf"))), n_ctx=512, n_threads=threads, n_threads_batch=threads,
                n_batch=512, logits_all=False, verbose=False)
    rates = []
    for _ in range(repeats + 1):  # the first is the warm-up
        llm.reset()
        llm.eval(prompt)
        tok = int(max(range(llm.n_vocab()), key=lambda i: llm.scores[llm.n_tokens - 1][i]))
        llm.eval([tok])
        t0 = time.perf_counter()
        for _ in range(new_tokens - 1):
            tok = int(llm.scores[llm.n_tokens - 1].argmax())
            llm.eval([tok])
        rates.append((new_tokens - 1) / (time.perf_counter() - t0))
    return {"decode_tokens_per_s": statistics.median(rates[1:]), "runs": rates[1:]}


def transformers_decode(folder: Path, prompt_len: int, new_tokens: int, threads: int) -> dict:
    out = folder.parent / f".{folder.name}-bench.json"
    compress("bench", str(folder), "--threads", str(threads), "--set", f"prompt_len={prompt_len}",
             "--set", f"new_tokens={new_tokens}", "--set", "batch_sizes=[1]", "--set", 'techniques=["kv_cache"]',
             "--set", "roofline=false", "--out", str(out))
    r = json.loads(out.read_text())
    return {"decode_tokens_per_s": r["decode_tokens_per_s_b1"]}


def wikitext_prompt(base: Path, n: int) -> list[int]:
    from transformers import AutoTokenizer

    text = (ROOT / "calibration" / "wikitext-2-raw" / "wiki.test.raw").read_text()
    return AutoTokenizer.from_pretrained(base)(text[:20000])["input_ids"][100:100 + n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", type=Path, default=ROOT / "artifacts" / "methods")
    ap.add_argument("--work", type=Path, default=Path("/tmp/gguf_vs_llama_cpp"))
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--speed-variants", default="gptq-w4g64,torchao-int8wo",
                    help="the run's variants timed in transformers (comma-separated; 'baseline' = load/)")
    ap.add_argument("--autoround-iters", type=int, default=0, help="0: no auto-round GGUF row")
    a = ap.parse_args()
    from pipeline.base.env import tame

    tame()
    base = a.run / "load"
    a.work.mkdir(parents=True, exist_ok=True)
    rows = {}
    f16 = gguf_variant(base, a.work / "f16", "F16")
    made = {"llama.cpp quantize (F16 -> Q4_K_M)": llama_cpp_quantize(f16, a.work / "llama-cpp-q4_k_m", "Q4_K_M"),
            "compress gguf Q4_K_M": gguf_variant(base, a.work / "compress-q4_k_m", "Q4_K_M")}
    if a.autoround_iters:
        folder = autoround_gguf(base, a.run / "calibrate" / "calibration.safetensors", a.work / "autoround-q4_k_m",
                                a.autoround_iters)
        if folder is not None:
            made[f"compress autoround (iters {a.autoround_iters}) -> gguf:q4_k_m"] = folder
    baseline_ppl = perplexity(base, a.windows, a.threads)["ppl"]
    prompt = wikitext_prompt(base, 64)
    for label, folder in made.items():
        f = next(folder.glob("*.gguf"))
        rows[label] = {"file": f.name, "mib": round(f.stat().st_size / 2**20, 1),
                       **perplexity(folder, a.windows, a.threads),
                       **llama_cpp_decode(folder, prompt, 32, a.threads)}
        rows[label]["ppl_ratio"] = round(rows[label]["ppl"] / baseline_ppl, 4)
        print(label, rows[label], flush=True)
    speed = {v: transformers_decode(base if v == "baseline" else a.run / "quantize" / v, 64, 32, a.threads)
             for v in a.speed_variants.split(",")}
    result = {"baseline_ppl": baseline_ppl, "windows": a.windows, "threads": a.threads, "gguf": rows,
              "transformers": speed}
    out = ROOT / "benchmarks" / "results" / "gguf_vs_llama_cpp.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nbaseline perplexity {baseline_ppl:.4f} ({a.windows} x 2048 WikiText-2 windows), {a.threads} threads\n")
    print("| GGUF | file MiB | perplexity | ratio | llama.cpp decode tok/s |\n|---|---|---|---|---|")
    for label, r in rows.items():
        print(f"| {label} | {r['mib']} | {r['ppl']:.4f} | {r['ppl_ratio']:.4f} | {r['decode_tokens_per_s']:.1f} |")
    for v, r in speed.items():
        print(f"transformers (compress bench) {v}: {r['decode_tokens_per_s']:.1f} tok/s decode")


if __name__ == "__main__":
    main()

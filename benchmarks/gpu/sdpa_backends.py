"""One attention row per SDPA backend (flash, memory-efficient, math: torch.nn.attention.sdpa_kernel), each checked
against the math backend before it is timed; a backend this device or these inputs cannot run is a skip with
torch's own reason, never a fake figure.

    python -m benchmarks.gpu.sdpa_backends --device cuda --model-dir .gpu/tiny-llama --out OUT/sdpa
    python -m benchmarks.gpu.sdpa_backends --device cpu --model-dir .gpu/tiny-llama --out /tmp/sdpa   # rehearsal

Two kinds of row, both in OUT/sdpa.json:
- kernel: F.scaled_dot_product_attention alone at SmolLM2-1.7B's attention shape (32 heads of 64), a causal
  prefill over `seq` tokens and one decode query over them, in the device's dtype (bf16 on CUDA, float32 on CPU);
  the reference is the math backend on the same inputs upcast to float32; max |difference| <= KERNEL_ATOL[dtype],
  then the median of `repeats` timed calls (synchronized);
- model: a checkpoint loaded with attn_implementation="sdpa", its last-position logits under each backend against
  the math backend's (max |Δlogit| <= --model-atol), then batch-1 greedy decode tok/s under that backend
  (pipeline/eval/measure.py time_generate, as the speed stage times it).
A row outside its tolerance records the difference and an error instead of a speed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AutoModelForCausalLM

from pipeline.eval.measure import summarize, time_generate, timed_runs

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "math": SDPBackend.MATH}
# attention outputs are convex mixes of V (|v| ~ 1 here): bf16 keeps ~3 significant digits
KERNEL_ATOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}
HEADS, HEAD_DIM = 32, 64  # SmolLM2-1.7B's attention


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], object], device: str, warmup: int, repeats: int) -> float:
    """Median wall time of fn in ms, the device synchronized before each clock read."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def run_under(backend: str, fn: Callable[[], torch.Tensor]) -> torch.Tensor | str:
    """fn() with only `backend` allowed, or torch's reason why it cannot run it here (one line: on CUDA torch warns
    why each kernel was not used, e.g. "Flash attention kernel not used because: ...", before it raises)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel([BACKENDS[backend]]):
                return fn()
        except RuntimeError as e:
            why = [str(w.message).strip() for w in seen if "not used because" in str(w.message)]
            lines = why + [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            return f"{backend} cannot run here: {' '.join((lines or ['RuntimeError'])[0].split())[:240]}"


def kernel_rows(device: str, dtype: torch.dtype, seq: int, repeats: int = 10, heads: int = HEADS,
                head_dim: int = HEAD_DIM, atol: float | None = None) -> dict[str, dict]:
    """{"prefill"|"decode": {backend: row}}: each backend against math in float32 on the same inputs."""
    atol = KERNEL_ATOL[dtype] if atol is None else atol
    gen = torch.Generator(device="cpu").manual_seed(0)
    k, v = (torch.randn(1, heads, seq, head_dim, generator=gen).to(device, dtype) for _ in range(2))
    q_all = torch.randn(1, heads, seq, head_dim, generator=gen).to(device, dtype)
    out: dict[str, dict] = {}
    for shape, q, causal in (("prefill", q_all, True), ("decode", q_all[:, :, -1:], False)):
        def call(q: torch.Tensor = q, causal: bool = causal) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        def in_float32(q: torch.Tensor = q, causal: bool = causal) -> torch.Tensor:
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)

        ref = run_under("math", in_float32)
        assert isinstance(ref, torch.Tensor), ref  # the math backend runs everywhere
        rows = {}
        for name in BACKENDS:
            got = run_under(name, call)
            if isinstance(got, str):
                rows[name] = {"skipped": got}
                continue
            diff = float((got.float() - ref).abs().max())
            row: dict = {"max_abs_diff": diff, "atol": atol, "reference": "math (float32)"}
            if diff > atol:
                row["error"] = f"{name} differs from math: max |diff| {diff:.3g} over {atol:g}; not timed"
            else:
                with sdpa_kernel([BACKENDS[name]]):
                    row["ms"] = median_ms(call, device, 2, repeats)
            rows[name] = row
        out[shape] = {"q_len": q.shape[2], "kv_len": seq, "causal": causal, "rows": rows}
    return out


def model_rows(model_dir: Path, device: str, dtype: torch.dtype, atol: float, prompt_len: int = 32,
               new_tokens: int = 16, repeats: int = 3) -> dict[str, dict]:
    """{backend: row} for a checkpoint run with attn_implementation="sdpa" under each backend."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(device)
    model.eval()
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(3, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones_like(ids)

    def logits() -> torch.Tensor:
        with torch.inference_mode():
            return model(input_ids=ids, attention_mask=mask).logits[0, -1].float()

    ref = run_under("math", logits)
    assert isinstance(ref, torch.Tensor), ref
    rows: dict[str, dict] = {}
    for name in BACKENDS:
        got = run_under(name, logits)
        if isinstance(got, str):
            rows[name] = {"skipped": got}
            continue
        diff = float((got - ref).abs().max())
        row: dict = {"max_abs_logit_diff": diff, "atol": atol, "reference": "math"}
        if diff > atol:
            row["error"] = f"{name} differs from math: max |Δlogit| {diff:.3g} over {atol:g}; not timed"
        else:
            def one() -> dict:
                return time_generate(model, ids, mask, new_tokens, device, 0)
            with sdpa_kernel([BACKENDS[name]]):
                runs = timed_runs(one, 1, repeats)
            row["decode_tokens_per_s"] = summarize([(new_tokens - 1) / r["decode_s"] for r in runs])
        rows[name] = row
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model-dir", type=Path, default=None, help="a checkpoint for the model rows (else kernel only)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--model-atol", type=float, default=0.05)
    ap.add_argument("--out", type=Path, default=Path("/tmp/sdpa"))
    a = ap.parse_args()
    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    result: dict = {"device": a.device, "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__}
    if a.device.startswith("cuda"):
        result["gpu"] = torch.cuda.get_device_name(0)
    result["kernel"] = kernel_rows(a.device, dtype, a.seq if a.device.startswith("cuda") else min(a.seq, 512))
    if a.model_dir is not None:
        result["model"] = {"model_dir": str(a.model_dir), "rows": model_rows(a.model_dir, a.device, dtype,
                                                                              a.model_atol)}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "sdpa.json").write_text(json.dumps(result, indent=1))
    for part, shapes in [("kernel " + s, v["rows"]) for s, v in result["kernel"].items()] + (
            [("model", result["model"]["rows"])] if "model" in result else []):
        for name, row in shapes.items():
            what = row.get("skipped") or row.get("error") or (
                f"{row['ms']:.3f} ms" if "ms" in row else f"{row['decode_tokens_per_s']['median']:.1f} tok/s")
            diff = row.get("max_abs_diff", row.get("max_abs_logit_diff"))
            print(f"{part:15s} {name:10s} " + (f"max|diff| {diff:.2g}  " if diff is not None else "") + what)


if __name__ == "__main__":
    main()

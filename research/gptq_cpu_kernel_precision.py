"""How much of a GPTQ-format checkpoint's perplexity increase comes from the CPU kernel rather than the weights?

GPTQModel's CPU int4 kernel (TorchAtenLinear, aten._weight_int4pack_mm_for_cpu) rounds the group scales and the
activations to bfloat16. This evaluates each checkpoint twice on the same WikiText-2 windows (GPTQ protocol):
with that kernel, and with the checkpoint's weights dequantized exactly to float32 (GPTQModel's `dequantize_weight`,
into plain `nn.Linear` modules: `pipeline.quant.gptqmodel_driver.dequantize_to_linear`), which is what the checkpoint
itself encodes.

Usage (after `compress run recipes/full.toml`):
    .venv/bin/python -m research.gptq_cpu_kernel_precision --windows 4 \
        artifacts/full/quantize/gptq-w4g64 artifacts/full/quantize/rtn-w4g64
"""
import argparse
import json
import time
from pathlib import Path

from pipeline.base.env import tame

tame()
import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from pipeline import data  # noqa: E402
from pipeline.eval.perplexity import gptq_windows, perplexity, windowed_nll  # noqa: E402
from pipeline.quant.checkpoint import load_checkpoint  # noqa: E402
from pipeline.quant.gptqmodel_driver import dequantize_to_linear  # noqa: E402


def ppl(model, ids, windows) -> float:
    with torch.inference_mode(), torch._dynamo.config.patch(disable=True):
        nll, n = windowed_nll(model, ids, windows)
    return perplexity(nll, n)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoints", nargs="+")
    p.add_argument("--baseline", default="artifacts/full/load")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    tok = AutoTokenizer.from_pretrained(a.baseline)
    ids = torch.tensor(tok(data.eval_text(data.resolve("wikitext2")), add_special_tokens=False)["input_ids"])
    windows = gptq_windows(len(ids), a.seq_len, a.windows)
    base = ppl(load_checkpoint(Path(a.baseline), "cpu"), ids, windows)
    rows = {"baseline": {"ppl": base}}
    print(f"baseline {base:.3f}", flush=True)
    for ck in a.checkpoints:
        row = {}
        for mode in ("cpu-int4-kernel", "exact-fp32"):
            t0 = time.perf_counter()
            model = load_checkpoint(Path(ck), "cpu")
            if mode == "exact-fp32":
                n = dequantize_to_linear(model)
                assert n > 0, f"{ck}: no GPTQ kernel modules found"
            row[mode] = ppl(model, ids, windows)
            row[mode + "_increase_pct"] = 100 * (row[mode] / base - 1)
            print(f"{ck} {mode}: {row[mode]:.3f} (+{row[mode + '_increase_pct']:.2f}%) "
                  f"[{time.perf_counter() - t0:.0f} s]", flush=True)
        rows[ck] = row
    print(json.dumps({"windows": a.windows, "seq_len": a.seq_len, "rows": rows}))


if __name__ == "__main__":
    main()

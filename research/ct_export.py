"""A finished GPTQ or AWQ export rewritten as compressed-tensors (pipeline/quant/formats/ct_export.py), and the
perplexity of both on the same WikiText-2 windows (GPTQ protocol), two ways each:

  reload: as `compress eval` and validate load them (pipeline/quant/checkpoint.py): the GPTQ folder through
          GPTQModel's CPU kernel, the compressed-tensors one through transformers, decompressed to dense weights in
          the model's dtype at the first forward;
  exact:  both as float32 models holding the dequantized weights (q - z) * s computed in float32 (the GPTQ or AWQ
          folder's qweight/qzeros/scales unpacked; compressed-tensors' decompressor through transformers with float32
          scales), which must agree to the bit.

    PYTHONPATH=$PWD python -m research.ct_export --gptq /tmp/fresh/artifacts/default/export/gptq-w4g64 \\
        --ct /tmp/ct-real --max-windows 3 --out benchmarks/results/ct_export/perplexity.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def ids_for(folder: Path, seq_len: int) -> torch.Tensor:
    from transformers import AutoTokenizer

    from pipeline import data
    from pipeline.eval.config import PerplexityConfig

    cfg = PerplexityConfig(seq_len=seq_len)
    text = data.eval_text(data.resolve(cfg.dataset, cfg.text_field))
    tok = AutoTokenizer.from_pretrained(folder)
    return torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def ppl(model, ids: torch.Tensor, seq_len: int, max_windows: int) -> dict:
    from pipeline.eval.perplexity import make_windows, perplexity, windowed_nll
    from pipeline.model.compute import float32_matmuls

    t0 = time.perf_counter()
    with float32_matmuls(model.dtype, "cpu"):
        nll, n = windowed_nll(model, ids, make_windows(len(ids), seq_len, None, max_windows))
    return {"perplexity": perplexity(nll, n), "nll": nll, "tokens": n, "dtype": str(model.dtype).removeprefix("torch."),
            "time_s": round(time.perf_counter() - t0, 1)}


def exact_gptq(folder: Path):
    """A float32 model whose quantized linears hold (q - z) * s from the GPTQ or AWQ folder's qweight/qzeros/scales
    in float32 (its float16/bfloat16 scales exactly; GPTQModel's loader would round float16 ones to bfloat16)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipeline.quant.formats.ct_export import dequantized_weights

    cfg = AutoConfig.from_pretrained(folder)
    del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    state = {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}
    weights = dequantized_weights(folder, torch.float32)
    plain = {k: v.float() for k, v in state.items() if k.rpartition(".")[0] not in weights}
    model.load_state_dict(plain, strict=False)
    with torch.no_grad():
        for mod, w in weights.items():
            model.get_submodule(mod).weight.copy_(w)
    model.tie_weights()
    return model.eval()


def exact_ct(folder: Path):
    from transformers import AutoModelForCausalLM

    from pipeline.quant.formats.ct_export import packed_zero_points_on_meta

    with packed_zero_points_on_meta():  # an asymmetric (AWQ) folder's zero points (pipeline/quant/formats/ct.py)
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gptq", type=Path, required=True, help="the GPTQ or AWQ folder")
    ap.add_argument("--ct", type=Path, required=True, help="written from --gptq when it does not exist")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--max-windows", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--only", default=None, help="comma-separated measurements to run (default: all four); the "
                                                  "others are kept from an existing --out")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    from pipeline.base.env import tame
    from pipeline.quant.checkpoint import load_checkpoint
    from pipeline.quant.formats.ct_export import convert_folder

    tame()
    if a.threads:
        torch.set_num_threads(a.threads)
    result: dict = {"gptq": str(a.gptq), "ct": str(a.ct), "seq_len": a.seq_len, "windows": a.max_windows}
    if a.only and a.out.exists():
        result = {**json.loads(a.out.read_text()), **result}
    if not (a.ct / "config.json").exists():
        t0 = time.perf_counter()
        convert_folder(a.gptq, a.ct)
        result["convert_s"] = round(time.perf_counter() - t0, 1)
    ids = ids_for(a.gptq, a.seq_len)
    loads = {"gptq_reload": lambda: load_checkpoint(a.gptq), "ct_reload": lambda: load_checkpoint(a.ct),
             "gptq_exact_fp32": lambda: exact_gptq(a.gptq), "ct_exact_fp32": lambda: exact_ct(a.ct)}
    for name, load in loads.items():
        if a.only and name not in a.only.split(","):
            continue
        model = load()
        result[name] = ppl(model, ids, a.seq_len, a.max_windows)
        print(name, json.dumps(result[name]), flush=True)
        del model
    if "gptq_exact_fp32" in result and "ct_exact_fp32" in result:
        result["exact_equal"] = result["gptq_exact_fp32"]["nll"] == result["ct_exact_fp32"]["nll"]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

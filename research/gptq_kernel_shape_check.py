"""Does GPTQModel's CPU int4 kernel give the same logits whatever the number of tokens per call?
Usage: .venv/bin/python -m research.gptq_kernel_shape_check  (after compress run recipes/full.toml)
"""
from pathlib import Path

import torch

from pipeline.base.env import tame

tame()  # before GPTQModel and its dependencies are imported
torch.set_num_threads(1)
from transformers import AutoTokenizer  # noqa: E402

from pipeline.quant.checkpoint import load_checkpoint  # noqa: E402

tok = AutoTokenizer.from_pretrained("artifacts/full/load")
ids = tok("The history of measurement is the history of agreeing on what to count. Merchants weighed grain against "
          "stones, builders paced out foundations", return_tensors="pt").input_ids
m = load_checkpoint(Path("artifacts/full/quantize/gptq-w4g64"), "cpu")
print(type(m.model.layers[0].self_attn.q_proj).__name__)
with torch.inference_mode():
    full = m(ids).logits[0].float()
    L = ids.shape[1]
    k = 8
    out = m(ids[:, :L-k], use_cache=True)
    pkv = out.past_key_values
    step = []
    for i in range(L-k, L):
        o = m(ids[:, i:i+1], past_key_values=pkv, use_cache=True)
        pkv = o.past_key_values
        step.append(o.logits[0, -1].float())
    step = torch.stack(step)
    out = m(ids[:, :L-k], use_cache=True)
    four = m(ids[:, L-k:L-k+4], past_key_values=out.past_key_values).logits[0].float()
print("max |full - stepwise| over last 8 positions:", (full[L-k:] - step).abs().max().item())
print("max |4-token verify - stepwise|:", (four - step[:4]).abs().max().item())
print("logit scale (std):", full.std().item())

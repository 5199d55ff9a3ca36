"""Why gptq-w8 answers the smoke prompt differently from the baseline: the top-5 first tokens of both.
Usage: .venv/bin/python -m research.smoke_first_token  (after compress run recipes/full.toml)
"""
from pathlib import Path

import torch

from pipeline.base.env import tame

tame()  # before GPTQModel and its dependencies are imported
torch.set_num_threads(1)
from transformers import AutoTokenizer  # noqa: E402

from pipeline.quant.checkpoint import load_checkpoint  # noqa: E402

tok = AutoTokenizer.from_pretrained("artifacts/full/load")
msgs=[{"role":"user","content":"What is the capital of France?"}]
ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt")
if not torch.is_tensor(ids):
    ids = ids["input_ids"]
base = load_checkpoint(Path("artifacts/full/load"), "cpu")
w8 = load_checkpoint(Path("artifacts/full/quantize/gptq-w8"), "cpu")
with torch.inference_mode():
    lb = base(ids).logits[0, -1].float().log_softmax(-1)
    lw = w8(ids).logits[0, -1].float().log_softmax(-1)
    print("dtype", next(w8.parameters()).dtype, type(w8.model.layers[0].self_attn.q_proj).__name__)
    print("top base", tok.convert_ids_to_tokens(lb.topk(5).indices.tolist()), lb.topk(5).values.exp().tolist())
    print("top w8  ", tok.convert_ids_to_tokens(lw.topk(5).indices.tolist()), lw.topk(5).values.exp().tolist())
    # single-token decode path: feed prompt minus last, then last token with cache
    out = w8(ids[:, :-1], use_cache=True)
    l1 = w8(ids[:, -1:], past_key_values=out.past_key_values).logits[0, -1].float().log_softmax(-1)
    print("w8 decode-path top", tok.convert_ids_to_tokens(l1.topk(5).indices.tolist()),
          "maxdiff vs full", (l1 - lw).abs().max().item())
    g = w8.generate(ids, max_new_tokens=12, do_sample=False)
    print(repr(tok.decode(g[0, ids.shape[1]:])))

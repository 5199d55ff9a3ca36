"""Quality of one checkpoint, measured the way a user loads it: perplexity, KL and top-1
agreement against the baseline on the baseline's exact tokens, a chat-template smoke test,
size on disk and in-memory footprint. Runs inside a fresh worker process (pipeline/base/worker.py).
"""
from __future__ import annotations

import logging
import math
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm
from transformers import AutoTokenizer

from pipeline import data
from pipeline.budget.formulas import GiB
from pipeline.budget.runtime import offload_bytes
from pipeline.eval.bits import linear_bits_per_weight
from pipeline.eval.config import PerplexityConfig, SmokeConfig
from pipeline.eval.perplexity import kl_top1, make_windows, perplexity, topk_reference, windowed_nll
from pipeline.model.compute import describe as describe_compute
from pipeline.model.compute import float32_matmuls
from pipeline.model.llamacpp_model import LlamaCppLM, scored_in_llama_cpp
from pipeline.model.llamacpp_model import version as llama_cpp_version
from pipeline.model.models import folder_bytes, single_gguf
from pipeline.quant.checkpoint import load_checkpoint

log = logging.getLogger("compress")
EVAL_IDS = "eval_ids.safetensors"
REFERENCE = "reference_topk.safetensors"
SMOKE_CONTEXT = 256  # tokens a smoke prompt may take in its chat template (llama.cpp's context is sized up front)


def eval_ids(tokenizer, cfg, out: Path, reference: Path | None) -> torch.Tensor:
    """The baseline tokenizes the evaluation text once; every variant reuses exactly those ids."""
    if reference is not None:
        return load_file(reference / EVAL_IDS)["input_ids"]
    text = data.eval_text(data.resolve(cfg.dataset, cfg.text_field))
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    save_file({"input_ids": ids}, out / EVAL_IDS)
    return ids


def measure_perplexity(model, ids: torch.Tensor, cfg, out: Path, reference: Path | None, label: str) -> dict:
    windows = make_windows(len(ids), cfg.seq_len, cfg.stride, cfg.max_windows)
    if not windows:
        raise ValueError(f"the evaluation text has {len(ids)} tokens, fewer than one window of {cfg.seq_len}")
    ref = load_file(reference / REFERENCE) if reference is not None else None
    kept_logp, kept_idx, kls, agrees = [], [], [], []
    offset = 0

    def on_window(i: int, logp: torch.Tensor, targets: torch.Tensor) -> None:
        nonlocal offset
        n = targets.numel()
        if ref is None:
            v, ix = topk_reference(logp, cfg.kl_top_k)
            kept_logp.append(v)
            kept_idx.append(ix)
        else:
            kl, agree = kl_top1(ref["logp"][offset: offset + n], ref["idx"][offset: offset + n], logp)
            kls.append(kl)
            agrees.append(agree)
        offset += n

    bar = tqdm(total=len(windows), desc=f"perplexity {label}", unit="win", leave=False)
    nll, n_tokens = windowed_nll(model, ids, windows, on_window, progress=bar.update)
    bar.close()
    result = {"value": perplexity(nll, n_tokens), "nll": nll, "tokens": n_tokens, "windows": len(windows),
              "window": cfg.seq_len, "stride": cfg.stride or cfg.seq_len, "dataset": cfg.dataset,
              "protocol": "gptq" if not cfg.stride or cfg.stride >= cfg.seq_len else "sliding",
              "tokens_available": len(ids)}
    if ref is None:
        save_file({"logp": torch.cat(kept_logp), "idx": torch.cat(kept_idx)}, out / REFERENCE)
    else:
        result["kl"] = torch.cat(kls).mean().item()
        result["top1"] = torch.cat(agrees).mean().item()
        result["kl_top_k"] = int(ref["idx"].shape[1])
    return result


def is_degenerate(text: str) -> str | None:
    """Why a generated text looks like garbage, or None. Catches empty output and loops."""
    words = text.split()
    if len(words) < 3:
        return f"only {len(words)} word(s)"
    if len(set(words)) / len(words) < 0.3:
        return f"{len(set(words))} distinct words out of {len(words)} (a loop)"
    top, count = Counter(words).most_common(1)[0]
    if count / len(words) > 0.5:
        return f"{top!r} is {count} of {len(words)} words"
    for period in range(1, 9):  # a short tail loop, e.g. "…, la femme, la femme, la femme, la femme,"
        gram, k = words[-period:], 1
        while len(words) >= (k + 1) * period and words[-(k + 1) * period:-k * period] == gram:
            k += 1
        if k >= 3 and k * period >= 0.4 * len(words):
            return f"ends in a loop: {' '.join(gram)!r} {k} times"
    return None


@torch.inference_mode()
def smoke_test(model, tokenizer, cfg) -> dict:
    outputs = []
    for prompt in cfg.prompts:
        msgs = [{"role": "user", "content": prompt}]
        if tokenizer.chat_template:
            ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
            ids = ids["input_ids"]
        else:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
        ids = ids.to(next(model.parameters()).device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=cfg.max_new_tokens,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        problem = is_degenerate(text)
        outputs.append({"prompt": prompt, "text": text, "ok": problem is None, "problem": problem})
    # without a chat template the prompts went to the model as raw text: the report says so
    return {"ok": all(o["ok"] for o in outputs), "outputs": outputs, "chat_template": bool(tokenizer.chat_template)}


def evaluate(model_dir: Path, out: Path, ppl_cfg, smoke_cfg, device: str, reference: Path | None, label: str,
             memory_limit: int | None = None) -> dict:
    """memory_limit: the bytes this process may hold ([run] max_memory_gb); a plain checkpoint that does not fit
    beside a window's activations is offloaded to disk (offload_bytes)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    in_memory = offload_bytes(model_dir, ppl_cfg.seq_len, memory_limit, device)
    offload = None
    if in_memory is not None:
        assert memory_limit is not None  # offload_bytes offloads only under a limit
        scratch = out / "offload"
        scratch.mkdir(exist_ok=True)
        offload = (in_memory, scratch)
        log.info("%s: %.2f GiB of weights do not fit %.2f GiB ([run] max_memory_gb) beside a window's activations: "
                 "%.2f GiB stay in memory, the rest is read from disk at each forward (accelerate offload)", label,
                 folder_bytes(model_dir) / GiB, memory_limit / GiB, in_memory / GiB)
    in_llama_cpp = scored_in_llama_cpp(model_dir)
    if in_llama_cpp is not None:  # a GGUF file transformers' loader cannot rebuild: measured in llama.cpp itself
        log.info("%s: measured in llama.cpp (llama-cpp-python): %s", label, in_llama_cpp)
        gguf_file = single_gguf(model_dir)
        assert gguf_file is not None  # the quantize unit marks GGUF folders only
        n_ctx = max(ppl_cfg.seq_len, SMOKE_CONTEXT + smoke_cfg.max_new_tokens)
        model = LlamaCppLM(model_dir / gguf_file, n_ctx, torch.get_num_threads(), tokenizer.eos_token_id)
    else:
        model = load_checkpoint(model_dir, device, offload=offload)
    dtype = model.dtype
    ids = eval_ids(tokenizer, ppl_cfg, out, reference)
    result: dict[str, Any]
    with float32_matmuls(dtype, device):  # a 16-bit model on a CPU without 16-bit units (pipeline/model/compute.py)
        result = {"perplexity": measure_perplexity(model, ids, ppl_cfg, out, reference, label),
                  "footprint_bytes": int(model.get_memory_footprint()), "compute": describe_compute(dtype, device),
                  "size_on_disk_bytes": folder_bytes(model_dir), "bits_per_weight": linear_bits_per_weight(model_dir)}
        if offload is not None:
            result["offload"] = {"in_memory_bytes": in_memory, "limit_bytes": memory_limit}
        if smoke_cfg.enabled:
            result["smoke"] = smoke_test(model, tokenizer, smoke_cfg)
        if in_llama_cpp is not None:  # the report's "how each model was computed" line says so
            result["compute"] = (f"llama.cpp (llama-cpp-python {llama_cpp_version()}) on the file's blocks, because "
                                 f"{in_llama_cpp}")
    if offload is not None:
        shutil.rmtree(offload[1], ignore_errors=True)
    if not math.isfinite(result["perplexity"]["value"]):
        log.warning("%s: perplexity is not finite", label)
    return result


def worker_task(args: dict) -> dict:
    """The worker's "quality" task (pipeline/base/worker.py TASKS)."""
    ref = Path(args["reference"]) if args.get("reference") else None
    return evaluate(Path(args["model_dir"]), Path(args["out"]), PerplexityConfig(**args["perplexity"]),
                    SmokeConfig(**args["smoke"]), args["device"], ref, args["label"], args.get("memory_limit"))

"""Calibration samples: token windows drawn from a text corpus (pure functions over a tokenizer)."""
from __future__ import annotations

import random

import torch

from pipeline import data
from pipeline.base.errors import StageError


def training_documents(cfg) -> list[str]:
    """The corpus documents a run may train or calibrate on: the held-out tail is removed."""
    docs = data.documents(data.resolve(cfg.dataset, cfg.text_field))
    if cfg.held_out_docs >= len(docs):
        raise StageError(f"calibration.held_out_docs = {cfg.held_out_docs} leaves none of the "
                         f"{len(docs)} documents of {cfg.dataset!r} for calibration")
    return docs[: len(docs) - cfg.held_out_docs]


def held_out_documents(cfg) -> list[str]:
    docs = data.documents(data.resolve(cfg.dataset, cfg.text_field))
    return docs[len(docs) - cfg.held_out_docs:] if cfg.held_out_docs else []


def sample_token_windows(tokenizer, docs: list[str], n: int, seq_len: int, sampling: str, seed: int,
                         chat_template: bool = False) -> torch.Tensor:
    """[n, seq_len] token ids: documents (shuffled when sampling='random') joined by EOS, cut into
    consecutive windows. Deterministic for a given seed."""
    order = list(range(len(docs)))
    if sampling == "random":
        random.Random(seed).shuffle(order)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    stream: list[int] = []
    need = n * seq_len
    for i in order:
        text = docs[i]
        if chat_template:
            text = tokenizer.apply_chat_template([{"role": "user", "content": "Continue the text."},
                                                  {"role": "assistant", "content": text}], tokenize=False)
        stream.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        stream.append(eos)
        if len(stream) >= need:
            break
    if len(stream) < need:
        raise StageError(f"the calibration corpus has {len(stream)} tokens; {n} samples x {seq_len} tokens "
                         f"need {need}: lower num_samples or seq_len")
    return torch.tensor(stream[:need], dtype=torch.long).view(n, seq_len)

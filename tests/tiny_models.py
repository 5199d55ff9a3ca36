"""The tiny random Llama (2 layers, hidden 128, 512-token word-level tokenizer) the quantization tests share."""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 512


def tiny_tokenizer(out: Path, vocab: int = VOCAB) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, **{f"t{i}": i for i in range(1, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="t1", eos_token="t2")
    fast.save_pretrained(out)


def tiny_llama(out: Path, vocab: int = VOCAB) -> Path:
    """Random weights (seed 0), saved with a tokenizer: a checkpoint every engine can load."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=128, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tiny_tokenizer(out, vocab)
    return out

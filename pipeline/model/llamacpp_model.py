"""A GGUF file run by llama.cpp itself (llama-cpp-python, the `gguf-serve` extra), for the GGUF files transformers'
GGUF loader cannot read or would rebuild as another model (olmo2, olmoe, granite, deepseek2, Mixtral written as
llama.cpp's 'llama' with experts, ...): validate scores them in the engine that serves them. It answers the calls
validate's quality stage makes of a transformers model (pipeline/eval/perplexity.py window_logprobs, quality.py's
smoke test): a forward's logits at every position, greedy `generate`, the memory footprint.

    m = LlamaCppLM(folder / "model-Q8_0.gguf", n_ctx=512, threads=2)
    m(input_ids=ids[None]).logits      # [1, n, vocab] float32, llama.cpp's own kernels (Q8_0 dot products)
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from pipeline.base.env import LLAMA_CPP_INSTALL, llama_cpp_installed, llama_cpp_threads

try:  # optional: the gguf-serve / gguf-kquants extras build it from source
    import llama_cpp
except ImportError:  # pragma: no cover - depends on the extra
    llama_cpp = None

METRICS = "metrics.json"  # the quantize unit's description of the file (pipeline/base/unit.py METRICS)
INSTALL = LLAMA_CPP_INSTALL
installed = llama_cpp_installed


def version() -> str | None:
    return getattr(llama_cpp, "__version__", None)


def scored_in_llama_cpp(folder: Path) -> str | None:
    """Why a GGUF variant's folder is measured in llama.cpp (its quantize unit found that transformers' GGUF loader
    cannot rebuild the model from it), or None: measured through transformers."""
    try:
        metrics = json.loads((Path(folder) / METRICS).read_text())
    except (OSError, ValueError):
        return None
    return metrics.get("scored_in_llama_cpp")


class LlamaCppLM(torch.nn.Module):
    """llama.cpp running one GGUF file on the CPU, called like a transformers causal LM by validate."""

    def __init__(self, path: Path, n_ctx: int, threads: int | None = None, eos_token_id: int | None = None) -> None:
        super().__init__()
        if llama_cpp is None:
            raise RuntimeError(f"{path.name} is measured in llama.cpp, and llama-cpp-python is not installed: "
                               f"{INSTALL}")
        self.path = Path(path)
        self.n_ctx = n_ctx
        # logits_all: one row of logits per position (n_ctx x vocab floats), what perplexity reads
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                                   n_threads=llama_cpp_threads(threads), seed=0, verbose=False)
        self.eos_token_id = eos_token_id if eos_token_id is not None else self.llm.token_eos()
        self.anchor = torch.nn.Parameter(torch.zeros(0), requires_grad=False)  # next(parameters()).device: the CPU
        self.dtype = torch.float32  # llama.cpp computes in float32 on the file's blocks

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False, **_: object) -> SimpleNamespace:
        rows = []
        for seq in input_ids.tolist():
            if len(seq) > self.n_ctx:
                raise ValueError(f"{len(seq)} tokens in one forward, over the {self.n_ctx}-token context it opened")
            self.llm.reset()
            self.llm.eval(seq)
            rows.append(torch.from_numpy(np.array(self.llm.scores[: len(seq)], dtype=np.float32, copy=True)))
        return SimpleNamespace(logits=torch.stack(rows))

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 32, do_sample: bool = False,
                 **_: object) -> torch.Tensor:
        """Greedy continuation of one prompt (the smoke test's call), stopping at end of sequence."""
        if do_sample or input_ids.shape[0] != 1:
            raise ValueError("llama.cpp scoring decodes one prompt greedily")
        prompt = input_ids[0].tolist()
        new: list[int] = []
        budget = min(max_new_tokens, self.n_ctx - len(prompt))
        for token in self.llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if token == self.eos_token_id or len(new) >= budget:
                break
            new.append(token)
        return torch.tensor([prompt + new], dtype=torch.long)

    def get_memory_footprint(self) -> int:
        return self.path.stat().st_size  # the mapped file: llama.cpp computes on its blocks as they are

"""The model of an export folder behind transformers' continuous-batching manager, as an async token stream.

One manager (one background generation thread) batches every request in flight; each request registers a result
handler that pushes its GenerationOutput into its own asyncio.Queue. A request that ends early (client gone, server
draining) is cancelled in the manager and its handler removed, so nothing keeps its slot.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, ContinuousBatchingConfig, GenerationConfig

from pipeline.quant.checkpoint import load_checkpoint


@dataclass
class Step:
    tokens: list[int]  # all tokens generated so far
    finished: bool
    error: str | None = None


class TransformersEngine:
    name = "transformers (continuous batching)"
    POLL_S = 1.0  # how often a request waiting for its next token checks that the generation thread still runs

    def __init__(self, folder: Path, max_batch: int, max_len: int, device: str = "cpu") -> None:
        """max_batch requests at once, each at most max_len tokens (prompt + output, capped at the model's context).
        The paged KV cache is sized for exactly that: left to itself the manager sizes it to 60% of free memory,
        which on a CPU means zeroing gigabytes before the first request (tens of seconds, measured here)."""
        self.model = load_checkpoint(folder, device=device)
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        eos = self.model.generation_config.eos_token_id
        self.eos = [eos] if isinstance(eos, int) else list(eos or [])
        gc = GenerationConfig(do_sample=False, max_new_tokens=16, eos_token_id=self.eos or -1)
        model_ctx = getattr(self.model.config.get_text_config(), "max_position_embeddings", None) or max_len
        self.context = min(model_ctx, max_len)
        page = 256
        cfg = ContinuousBatchingConfig(max_requests_per_batch=max_batch, page_size=page,
                                       num_blocks=max_batch * -(-self.context // page) + 1,
                                       max_batch_tokens=max(self.context, 256))
        self._cb = self.model.init_continuous_batching(generation_config=gc, continuous_batching_config=cfg)
        self._serialize_forwards()
        self._ids = itertools.count()
        self._torch = torch
        self.versions = {"transformers": __import__("transformers").__version__, "torch": torch.__version__}

    def _serialize_forwards(self) -> None:
        """One forward pass of the model at a time: the manager's steps (its thread calls `model(**batch)`) and
        `score`'s forward share the model's modules and attention state, and side by side they corrupt each other's
        results (measured: lm-eval's log-likelihood requests at 4 concurrent clients through this server flipped 83
        of 200 task items against the in-process scores, 3 of 200 one client at a time;
        research/tasks_served.py). The lock is the model's instance `forward`, which `nn.Module.__call__` calls."""
        lock, forward = threading.Lock(), self.model.forward

        def serialized(*args, **kwargs):
            with lock:
                return forward(*args, **kwargs)

        self.model.forward = serialized

    def start(self) -> None:
        self._cb.start()

    def alive(self) -> bool:
        return self._cb.is_running() and self._cb.background_thread_status.fatal_error is None

    def stop(self, timeout: float) -> bool:
        """Stop the generation thread; True if it ended within timeout."""
        if self._cb.is_running():
            self._cb.stop(block=True, timeout=timeout, hard_stop=True)
        return not self._cb.is_running()

    async def generate(self, input_ids: list[int], max_new_tokens: int, ignore_eos: bool) -> AsyncIterator[Step]:
        """Greedy tokens as they come. Leaving the loop early (break, cancellation) cancels the request."""
        queue: asyncio.Queue = asyncio.Queue()
        rid = f"cmp-{next(self._ids)}"
        finished = False
        # the handler first: the generation thread may emit this request's first output (or its last, for a short
        # request) before add_request returns, and an output with no handler goes to the shared queue, lost to this
        # request (a missing token in the stream, or a request that never ends and keeps its slot)
        self._cb.register_result_handler(rid, queue.put_nowait)
        added = self._cb.add_request(list(input_ids), request_id=rid, max_new_tokens=max_new_tokens, streaming=True,
                                     eos_token_id=-1 if ignore_eos or not self.eos else self.eos)
        if added is None:
            self._forget(rid)
            yield Step([], True, "the engine is not accepting requests (stopping)")
            return
        try:
            while True:
                try:
                    out = await asyncio.wait_for(queue.get(), self.POLL_S)
                except TimeoutError:  # asyncio.TimeoutError is TimeoutError from Python 3.11
                    if self.alive():
                        continue  # a long prefill, or a full batch: still coming
                    # nothing will come: end the request (cancelled and forgotten below), not hold its slot forever
                    yield Step([], True, "the generation thread stopped")
                    return
                finished = out.is_finished()
                yield Step(list(out.generated_tokens), finished, out.error)
                if finished:
                    return
        finally:
            if not finished:
                self._cb.cancel_request(rid)
                self._forget(rid)
                self.drop_orphans()

    def score(self, ids: list[int], first: int, k: int) -> list[tuple[float, list[tuple[int, float]]]]:
        """For each position i in [first, len(ids)): (log p(ids[i] | ids[:i]), the k most likely (id, log p) there),
        from one forward pass of the model (its log-softmax in float32). Blocking: run it off the event loop. The
        manager's thread keeps generating meanwhile (the forward pass uses no cache and changes no state)."""
        torch = self._torch
        keep = len(ids) - first + 1  # the logits at positions first-1 .. len-1; the last one predicts nothing here
        with torch.inference_mode():
            x = torch.tensor([ids], device=self.model.device)
            logits = self.model(input_ids=x, logits_to_keep=keep).logits[0, :-1]
            target = x[0, first:]
            out = []
            for s in range(0, logits.shape[0], 256):  # log-softmax a block of rows at a time: one vocab-wide copy
                lp = logits[s:s + 256].float().log_softmax(-1)
                chosen = lp.gather(-1, target[s:s + 256, None])[:, 0].tolist()
                top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
                for c, vs, is_ in zip(chosen, top_v.tolist(), top_i.tolist(), strict=True):
                    out.append((c, list(zip(is_, vs, strict=True))))
        return out

    def _forget(self, rid: str) -> None:
        with self._cb.output_router._lock:
            self._cb.output_router.result_handlers.pop(rid, None)

    def drop_orphans(self) -> None:
        """Outputs of cancelled requests (no handler any more) land on the manager's shared queue, which this server
        never reads: empty it so they do not accumulate."""
        q = self._cb.output_router.output_queue
        while not q.empty():
            try:
                q.get_nowait()
            except Exception:
                break

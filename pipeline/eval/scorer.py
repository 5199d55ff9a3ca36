"""Multiple-choice scoring with one forward per item's choices, sharing the context: lm-eval's HF backend, faster.

lm-eval's HFLM scores every (context, continuation) request as its own row: an item's four choices repeat the
context four times through the network and through the vocabulary projection + log-softmax at every position
(its own comment: "TODO: implement some kind of efficient-request-middleware that lumps together requests with the
same context"). `SharedContextLM` is that middleware: requests with the same context tokens (an item's choices)
are scored together, the context (all but its last token) once into the KV cache, then the choices as one batch
on a copy of that cache, and the vocabulary projection only where a continuation token is scored. A request whose
context no other request shares (Winogrande: the choice is in the context) and any request lm-eval would truncate
go through HFLM's own code, batched as lm-eval batches them.

Everything else is lm-eval's: tokenization (`_encode_pair`, the empty-context prefix token), the request order it
returns, the cache hook, the metrics. The log-probabilities equal HFLM's up to float rounding (the context's keys
and values are computed once instead of per row); tests/unit/test_tasks.py compares both per request and per
item on real items.
"""
from __future__ import annotations

import inspect
from collections import defaultdict

import torch
import torch.nn.functional as F
from lm_eval.models.huggingface import HFLM
from tqdm import tqdm


class SharedContextLM(HFLM):
    """HFLM whose `_loglikelihood_tokens` scores an item's choices in one forward over a shared context cache."""

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        if self.backend != "causal":
            return super()._loglikelihood_tokens(requests, disable_tqdm, override_bs)
        groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
        alone = []
        for i, (_, ctx, cont) in enumerate(requests):
            if len(ctx) + len(cont) > self.max_length + 1:
                alone.append(i)  # lm-eval truncates it from the left: its own code
            else:
                groups[tuple(ctx)].append(i)
        for key in [k for k, idx in groups.items() if len(idx) == 1]:
            alone += groups.pop(key)
        res: list = [None] * len(requests)
        if alone:
            alone.sort()
            for i, answer in zip(alone, super()._loglikelihood_tokens([requests[i] for i in alone], disable_tqdm,
                                                                      override_bs)):
                res[i] = answer
        pbar = tqdm(total=sum(map(len, groups.values())), disable=disable_tqdm or self.rank != 0,
                    desc="Scoring choices (shared context)")
        # longest first, as lm-eval orders its batches (a memory error shows at once)
        for ctx, idx in sorted(groups.items(), key=lambda kv: -(len(kv[0]) + max(len(requests[i][2])
                                                                                   for i in kv[1]))):
            for i, answer in zip(idx, self._score_group(list(ctx), [requests[i][2] for i in idx])):
                res[i] = answer
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
                pbar.update(1)
        pbar.close()
        return res

    @torch.no_grad()
    def _score_group(self, ctx: list[int], conts: list[list[int]]) -> list[tuple[float, bool]]:
        """(sum of log-probabilities, greedy) of each continuation after `ctx`: the context but its last token
        once into the cache, then a batch of rows [ctx[-1]] + cont[:-1], right-padded (causal attention keeps a
        row's real tokens from seeing its padding, as in lm-eval's right-padded batches)."""
        n, width = len(conts), max(map(len, conts))
        rows = torch.zeros((n, width), dtype=torch.long)
        for j, cont in enumerate(conts):
            rows[j, :len(cont)] = torch.tensor([ctx[-1], *cont[:-1]])
        cache = None
        if len(ctx) > 1:
            prefix = torch.tensor([ctx[:-1]], dtype=torch.long, device=self.device)
            cache = self.model(prefix, use_cache=True, **self._keep_last()).past_key_values
            cache.batch_repeat_interleave(n)
        logits = self.model(rows.to(self.device), past_key_values=cache, use_cache=cache is not None).logits
        logprobs = F.log_softmax(logits, dim=-1, dtype=self.softmax_dtype)
        out = []
        for j, cont in enumerate(conts):
            lp = logprobs[j, :len(cont)]
            target = torch.tensor(cont, dtype=torch.long, device=lp.device)
            greedy = bool((lp.argmax(dim=-1) == target).all())
            out.append((float(lp.gather(1, target[:, None]).sum()), greedy))
        return out

    def _keep_last(self) -> dict:
        """`logits_to_keep=1` where the model takes it (every transformers causal LM of 5.x): the context's pass
        needs no logits at all, and the vocabulary projection is the largest matmul of a small model."""
        if not hasattr(self, "_keep_kw"):
            params = inspect.signature(self.model.forward).parameters
            self._keep_kw = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        return self._keep_kw

"""Multiple-choice scoring over one pass of each item's shared context: lm-eval's HF backend's numbers, faster.

lm-eval's HFLM scores every (context, continuation) request as its own row: an item's four choices repeat the
context four times through the network and through the vocabulary projection + log-softmax at every position
(its own comment: "TODO: implement some kind of efficient-request-middleware that lumps together requests with the
same context"). `SharedContextLM` is that middleware: requests with the same context tokens (an item's choices)
are scored together, the context (all but its last token) once into the KV cache, then the choices as rows that
read that cache, and the vocabulary projection only where a continuation token is scored. Items are batched up to
`batch_size` choice rows (their contexts right-padded into one cache, padding masked, each row's positions
continuing its own context), so the matmuls stay as large as lm-eval's. A request whose
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

from pipeline.model.forward import cache_kwargs


class SharedContextLM(HFLM):
    """HFLM whose `_loglikelihood_tokens` scores an item's choices over one cached pass of their shared context."""

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
            # lm-eval answers each request it is given, in order
            for i, answer in zip(alone, super()._loglikelihood_tokens([requests[i] for i in alone], disable_tqdm,
                                                                      override_bs), strict=True):
                res[i] = answer
        pbar = tqdm(total=sum(map(len, groups.values())), disable=disable_tqdm or self.rank != 0,
                    desc="Scoring choices (shared context)")
        # longest first, as lm-eval orders its batches (a memory error shows at once); items with a context of
        # one token (nothing to cache) apart, so that no row of the context pass is all padding
        order = sorted(groups.items(), key=lambda kv: -(len(kv[0]) + max(len(requests[i][2]) for i in kv[1])))
        for cached in (True, False):
            todo = [(list(ctx), idx) for ctx, idx in order if (len(ctx) > 1) == cached]
            for batch in self._batches(todo):
                scores = self._score_groups([(ctx, [requests[i][2] for i in idx]) for ctx, idx in batch])
                for i, answer in zip([i for _, idx in batch for i in idx], scores, strict=True):
                    res[i] = answer
                    if requests[i][0] is not None:
                        self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
                    pbar.update(1)
        pbar.close()
        return res

    def _batches(self, groups: list) -> list[list]:
        """Consecutive groups, as many as fill `batch_size` choice rows (at least one group a batch)."""
        size = self.batch_size if isinstance(self.batch_size, int) and self.batch_size > 0 else 16
        out: list[list] = []
        cur: list = []
        rows = 0
        for g in groups:
            if cur and rows + len(g[1]) > size:
                out.append(cur)
                cur, rows = [], 0
            cur.append(g)
            rows += len(g[1])
        return out + [cur] if cur else out

    @torch.no_grad()
    def _score_groups(self, groups: list[tuple[list[int], list[list[int]]]]) -> list[tuple[float, bool]]:
        """(sum of log-probabilities, greedy) of every continuation of every (context, continuations) group, in
        order. The contexts but their last token go through the model once, right-padded into one cache; each
        continuation row [ctx[-1]] + cont[:-1] then reads its item's cache rows (padding masked, positions
        continuing its own context), right-padded itself (causal attention keeps a row's real tokens from
        seeing its padding, as in lm-eval's right-padded batches)."""
        dev = self.device
        prefix_len = [len(ctx) - 1 for ctx, _ in groups]
        owner = [g for g, (_, conts) in enumerate(groups) for _ in conts]
        conts = [c for _, cs in groups for c in cs]
        width, pmax = max(map(len, conts)), max(prefix_len)
        rows = torch.zeros((len(conts), width), dtype=torch.long)
        for r, (g, cont) in enumerate(zip(owner, conts, strict=True)):
            rows[r, :len(cont)] = torch.tensor([groups[g][0][-1], *cont[:-1]])
        kwargs = {}
        if pmax > 0:
            prefix = torch.zeros((len(groups), pmax), dtype=torch.long)
            pmask = torch.zeros((len(groups), pmax), dtype=torch.long)
            for g, (ctx, _) in enumerate(groups):
                prefix[g, :prefix_len[g]] = torch.tensor(ctx[:-1])
                pmask[g, :prefix_len[g]] = 1
            cache = self.model(prefix.to(dev), attention_mask=pmask.to(dev), use_cache=True,
                               **self._keep_last()).past_key_values
            select = torch.tensor(owner, device=dev)
            cache.batch_select_indices(select)
            starts = torch.tensor([prefix_len[g] for g in owner])
            kwargs = {**cache_kwargs(self.model, cache), "use_cache": True,
                      "attention_mask": torch.cat([pmask[owner], torch.ones((len(conts), width), dtype=torch.long)],
                                                  dim=1).to(dev),
                      "position_ids": (starts[:, None] + torch.arange(width)[None, :]).to(dev)}
        logits = self.model(rows.to(dev), **kwargs).logits
        logprobs = F.log_softmax(logits, dim=-1, dtype=self.softmax_dtype)
        out = []
        for r, cont in enumerate(conts):
            lp = logprobs[r, :len(cont)]
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

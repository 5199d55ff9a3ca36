"""Teacher targets for distillation: the verifier's top-k log-probabilities at every position of
every training sequence, computed once and kept (in memory and on disk) so later epochs, a
resumed run and other draft configurations reuse them instead of re-running the verifier.

Two kinds of training sequence, both from the training corpus (C4), never from evaluation text:
  off-policy  "c4:i"   window i of the tokenized corpus (documents joined by EOS);
  on-policy   "gen:j"  the first `prompt_len` tokens of a corpus window, continued by the
                       verifier itself (sampled at `gen_temperature`, 0 = greedy), the text the
                       draft will actually have to predict at decode time.
Keys name the record ("c4:17", "gen[p32,t0.7,b32,s0]:3"); the store's folder is named by a
fingerprint of what every record depends on (verifier, corpus windows, top-k, temperature,
precision). A record stores top-k log-probs as float16 and ids as int32, plus the exact log of the mass
outside the top-k; values are rounded to the stored dtype immediately, so a run that reads them
back after a kill sees exactly what an uninterrupted run used.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from transformers import DynamicCache

from pipeline.base.fileio import atomic_path
from pipeline.model.forward import cache_kwargs


@dataclass
class Targets:
    ids: torch.Tensor        # [B, L] token ids
    logprobs: torch.Tensor   # [B, L, K] teacher top-k log-probs (float16), at the KD temperature
    top_ids: torch.Tensor    # [B, L, K] their token ids (int32), sorted by probability
    rest: torch.Tensor       # [B, L] log of the teacher's probability outside the top-k (float32)

    @staticmethod
    def cat(parts: list[Targets]) -> Targets:
        return Targets(*(torch.cat([getattr(p, f) for p in parts]) for f in TARGET_FIELDS))

    def to(self, device) -> Targets:
        return Targets(*(getattr(self, f).to(device) for f in TARGET_FIELDS))

    def row(self, i: int) -> Targets:
        return Targets(*(getattr(self, f)[i:i + 1] for f in TARGET_FIELDS))


TARGET_FIELDS = tuple(f.name for f in fields(Targets))   # ("ids", "logprobs", "top_ids", "rest"): the store's names


def topk_targets(ids: torch.Tensor, logits: torch.Tensor, k: int, temperature: float) -> Targets:
    """Top-k of log_softmax(logits / T) plus log(mass outside), rounded to the storage dtypes."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    vals, top = logp.topk(k, dim=-1)
    rest = logp.scatter(-1, top, float("-inf")).logsumexp(-1)
    return Targets(ids.cpu(), vals.half().cpu(), top.int().cpu(), rest.float().cpu())


def autocast(model, precision: str):
    """bf16 autocast around a forward (oneDNN bf16 matmuls: ~3-5x faster than fp32 on an
    AVX512-BF16 CPU); "fp32" is a no-op."""
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision must be fp32 or bf16; got {precision!r}")
    return torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


@torch.no_grad()
def teacher_targets(teacher, ids: torch.Tensor, k: int, temperature: float, precision: str = "fp32") -> Targets:
    """Off-policy targets: one teacher forward over the given sequences."""
    with autocast(teacher, precision):
        logits = teacher(input_ids=ids.to(teacher.device), use_cache=False).logits
    return topk_targets(ids, logits, k, temperature)


@torch.no_grad()
def generate_with_targets(teacher, prompts: torch.Tensor, new_tokens: int, k: int, temperature: float,
                          gen_temperature: float, generators: list[torch.Generator],
                          precision: str = "fp32") -> Targets:
    """On-policy targets: the verifier continues each prompt by `new_tokens` (KV cache, batched)
    and its top-k at every position is kept on the way, so the data costs one pass."""
    cache, seq = DynamicCache(), prompts.to(teacher.device)

    def forward(ids):
        with autocast(teacher, precision):
            return teacher(input_ids=ids, **cache_kwargs(teacher, cache), use_cache=True).logits.float()
    logits = forward(seq)
    parts = [topk_targets(seq, logits, k, temperature)]
    for _ in range(new_tokens):
        last = logits[:, -1]
        if gen_temperature == 0:
            nxt = last.argmax(-1)
        else:
            probs = torch.softmax(last / gen_temperature, -1).cpu()
            nxt = torch.stack([torch.multinomial(probs[r], 1, generator=g)[0] for r, g in enumerate(generators)])
        nxt = nxt.to(seq.device)[:, None]
        seq = torch.cat([seq, nxt], 1)
        logits = forward(nxt)
        parts.append(topk_targets(nxt, logits, k, temperature))
    return Targets(seq.cpu(), *(torch.cat([getattr(p, f) for p in parts], 1) for f in TARGET_FIELDS[1:]))


def token_windows(tokenizer, texts: list[str], seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """Documents tokenized, joined with EOS and cut into non-overlapping windows [N, seq_len]."""
    stream: list[int] = []
    eos = tokenizer.eos_token_id
    for text in texts:
        stream += tokenizer(text, add_special_tokens=False)["input_ids"] + ([eos] if eos is not None else [])
        if max_windows is not None and len(stream) >= max_windows * seq_len:
            break
    n = len(stream) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    if n == 0:
        raise ValueError(f"the training texts hold fewer than seq_len={seq_len} tokens")
    return torch.tensor(stream[: n * seq_len]).view(n, seq_len)


class TargetStore:
    """Records by key in memory, mirrored to `folder` one file per batch,
    written atomically. `folder` should be named by `fingerprint(...)` of what the records depend on."""

    def __init__(self, folder: Path | None):
        self.folder, self.records = (Path(folder) if folder else None), {}
        if self.folder and self.folder.exists():
            for f in sorted(self.folder.glob("*.pt")):
                blob = torch.load(f, weights_only=True)
                for i, key in enumerate(blob["keys"]):
                    self.records[key] = Targets(*(blob[n][i:i + 1] for n in TARGET_FIELDS))

    def __contains__(self, key: str) -> bool:
        return key in self.records

    def get(self, keys: list[str]) -> Targets:
        return Targets.cat([self.records[k] for k in keys])

    def put(self, keys: list[str], targets: Targets) -> None:
        for i, key in enumerate(keys):
            self.records[key] = targets.row(i)
        if self.folder is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        name = hashlib.sha1("|".join(keys).encode()).hexdigest()[:16]
        with atomic_path(self.folder / f"{name}.pt") as tmp:
            torch.save({"keys": keys, **{f: getattr(targets, f) for f in TARGET_FIELDS}}, tmp)


def fingerprint(**parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


class TrainingData:
    """Deterministic batches of teacher targets: batch `step` is a pure function of (seed, step),
    so a resumed run sees the same batches as an uninterrupted one."""

    def __init__(self, teacher, windows: torch.Tensor, store: TargetStore, *, batch_size: int, top_k: int,
                 temperature: float, on_policy_fraction: float = 0.0, prompt_len: int = 32,
                 gen_temperature: float = 0.7, pool_size: int | None = None, seed: int = 0,
                 precision: str = "fp32", gen_batch: int = 32):
        self.teacher, self.windows, self.store = teacher, windows, store
        self.vocab_size = teacher.get_output_embeddings().weight.shape[0]
        self.batch_size, self.top_k, self.temperature, self.seed = batch_size, top_k, temperature, seed
        self.n_on = round(on_policy_fraction * batch_size)
        self.prompt_len, self.gen_temperature, self.precision = prompt_len, gen_temperature, precision
        self.gen_batch = gen_batch
        n = windows.shape[0]
        self.pool_off = min(n, pool_size) if pool_size else n
        self.pool_on = min(n, pool_size) if pool_size else n
        if self.n_on and prompt_len >= windows.shape[1]:
            raise ValueError(f"on-policy prompt_len {prompt_len} must be shorter than seq_len {windows.shape[1]}")

    def _perm(self, tag: int, epoch: int, size: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + tag * 10_007 + epoch)
        return torch.randperm(size, generator=g)

    def _indices(self, step: int, per_step: int, pool: int, tag: int) -> list[int]:
        """Corpus windows in a fresh seeded permutation each epoch; on-policy sequences (tag 1)
        in order, so the chunks generated together are used together."""
        out = []
        for pos in range(step * per_step, (step + 1) * per_step):
            epoch, offset = divmod(pos, pool)
            out.append(offset if tag == 1 else int(self._perm(tag, epoch, pool)[offset]))
        return out

    def batch(self, step: int) -> Targets:
        parts = []
        n_off = self.batch_size - self.n_on
        if n_off:
            idx = self._indices(step, n_off, self.pool_off, tag=0)
            keys = [f"c4:{i}" for i in idx]
            missing = [(k, i) for k, i in zip(keys, idx, strict=True) if k not in self.store]
            if missing:
                self.store.put([k for k, _ in missing], teacher_targets(
                    self.teacher, self.windows[[i for _, i in missing]], self.top_k, self.temperature, self.precision))
            parts.append(self.store.get(keys))
        if self.n_on:
            parts.append(self._on_policy(self._indices(step, self.n_on, self.pool_on, tag=1)))
        return Targets.cat(parts)

    def _gen_key(self, j: int) -> str:
        # everything an on-policy record depends on beyond the store's fingerprint
        return f"gen[p{self.prompt_len},t{self.gen_temperature},b{self.gen_batch},s{self.seed}]:{j}"

    def _on_policy(self, idx: list[int]) -> Targets:
        """On-policy records, generated `gen_batch` at a time (a chunk of consecutive indices, so
        the same chunk is always generated together: batched decoding amortises the verifier's
        weight reads, and the result does not depend on which step first asked for it)."""
        keys = [self._gen_key(j) for j in idx]
        for chunk in sorted({j // self.gen_batch for j, k in zip(idx, keys, strict=True) if k not in self.store}):
            js = list(range(chunk * self.gen_batch, min((chunk + 1) * self.gen_batch, self.pool_on)))
            prompts = self.windows[[self.windows.shape[0] - 1 - j for j in js], : self.prompt_len]
            gens = [torch.Generator().manual_seed(self.seed * 7919 + j) for j in js]
            new = self.windows.shape[1] - self.prompt_len
            self.store.put([self._gen_key(j) for j in js], generate_with_targets(
                self.teacher, prompts, new, self.top_k, self.temperature, self.gen_temperature, gens, self.precision))
        return self.store.get(keys)

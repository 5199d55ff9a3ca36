"""The draft model: initialisation by layer selection, an optional reduced output head over a
frequency-chosen vocabulary subset (EAGLE-3 style), export as a standard HF checkpoint, and the
tokenizer compatibility check.

Export layout (a normal transformers folder, so it works as `assistant_model=`):
  config.json, model.safetensors, tokenizer files   full-vocabulary model
  draft_vocab.json                                  only with a reduced head: the token ids the
                                                    trained head rows belong to
The full head keeps the verifier's rows outside the subset, so the folder also works as a plain
full-vocabulary draft; our decoder slices the head to the subset and stays exact (q = 0 outside).
"""
from __future__ import annotations

import copy
import json
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.model.dtypes import torch_dtype
from pipeline.quant.checkpoint import load_checkpoint
from pipeline.speculative.targets import autocast

if TYPE_CHECKING:
    from transformers import PreTrainedModel

DRAFT_VOCAB_FILE = "draft_vocab.json"
PARAM_GROUPS = ("layers", "norm", "head", "embed")


def evenly_spaced_layers(total: int, keep: int) -> list[int]:
    """`keep` layer indices spread evenly over 0..total-1, first and last included."""
    if not 1 <= keep <= total:
        raise ValueError(f"num_layers must be between 1 and the verifier's {total} layers; got {keep}")
    if keep == 1:
        return [0]
    return sorted({round(i * (total - 1) / (keep - 1)) for i in range(keep)})


def init_draft_from_layers(verifier: PreTrainedModel, layers: list[int], untie_head: bool = False) -> PreTrainedModel:
    """A copy of `verifier` keeping only decoder `layers` (embeddings, final norm, head copied).
    The result is the same HF class with `num_hidden_layers = len(layers)`."""
    total = verifier.config.num_hidden_layers
    bad = [i for i in layers if not 0 <= i < total]
    if bad or len(set(layers)) != len(layers) or not layers:
        raise ValueError(f"draft layers must be distinct indices in [0, {total}); got {layers}")
    cfg = copy.deepcopy(verifier.config)
    cfg.num_hidden_layers = len(layers)
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = [cfg.layer_types[i] for i in layers]
    # MoE configs that name their dense layers by index or count (Qwen3-MoE's mlp_only_layers, DeepSeek's
    # first_k_dense_replace): renumbered, so each kept layer keeps its dense or sparse MLP
    if getattr(cfg, "mlp_only_layers", None):
        cfg.mlp_only_layers = [layers.index(i) for i in cfg.mlp_only_layers if i in layers]
    if isinstance(getattr(cfg, "first_k_dense_replace", None), int):
        cfg.first_k_dense_replace = sum(1 for i in layers if i < cfg.first_k_dense_replace)
    if untie_head:
        cfg.tie_word_embeddings = False
    state = {}
    for key, value in verifier.state_dict().items():
        m = re.match(r"(.*\.layers\.)(\d+)(\..*)", key)
        if m is None:
            state[key] = value.clone()
        elif int(m[2]) in layers:
            state[f"{m[1]}{layers.index(int(m[2]))}{m[3]}"] = value.clone()
    if untie_head and "lm_head.weight" not in state:
        state["lm_head.weight"] = verifier.get_output_embeddings().weight.detach().clone()
    draft = type(verifier)(cfg)
    missing, unexpected = draft.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"layer selection left weights unmatched: missing {missing}, unexpected {unexpected}")
    return draft.eval()


@torch.no_grad()
def fit_output_map(draft: PreTrainedModel, verifier: PreTrainedModel, windows: torch.Tensor, ridge: float = 1e-3,
                   batch_size: int = 8, precision: str = "bf16") -> float:
    """Tuned-lens initialisation of the draft's head, in closed form (cf. Belrose et al. 2023).

    With u = the draft's final hidden state (after its final norm) and v = the verifier's, both
    [N, H] over the training windows, fit the linear map v ~ M u by ridge regression shrunk
    towards the identity (the plain copied head, "logit lens", is M = I):
        M^T = (U^T U + lam I)^-1 (U^T V + lam I),   lam = ridge * mean(diag(U^T U))
    The verifier's logits are W v, so the draft's head becomes W M: its logits W M u are the
    verifier's head read through the best linear guess of the verifier's last hidden state.
    The draft must be untied (its head is replaced, its embeddings are not). Returns the
    unexplained fraction |V - U M^T|^2 / |V|^2."""
    if draft.config.tie_word_embeddings:
        raise ValueError("fit_output_map needs an untied draft (init_draft_from_layers(..., untie_head=True))")
    us, vs = [], []
    for i in range(0, windows.shape[0], batch_size):
        ids = windows[i:i + batch_size].to(draft.device)
        with autocast(draft, precision):
            us.append(draft.get_decoder()(input_ids=ids).last_hidden_state.float().flatten(0, 1))
            vs.append(verifier.get_decoder()(input_ids=ids).last_hidden_state.float().flatten(0, 1))
    u, v = torch.cat(us).double(), torch.cat(vs).double()
    gram = u.T @ u
    lam = ridge * gram.diagonal().mean() * torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    m_t = torch.linalg.solve(gram + lam, u.T @ v + lam)
    head = draft.get_output_embeddings().weight
    head.copy_((head.double() @ m_t.T).to(head.dtype))
    return float((v - u @ m_t).pow(2).sum() / v.pow(2).sum())


def select_vocab(token_streams, size: int, vocab_size: int, always: Iterable[int] = ()) -> torch.Tensor:
    """The `size` most frequent token ids of a corpus (plus `always`, e.g. EOS), sorted by id.
    Ties are broken by the smaller id, so the choice is deterministic."""
    if not 1 <= size <= vocab_size:
        raise ValueError(f"draft vocab_size must be in [1, {vocab_size}]; got {size}")
    counts: Counter[int] = Counter()
    for ids in token_streams:
        counts.update(ids)
    forced = sorted({int(i) for i in always})
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    chosen = set(forced)
    for tok, _ in ranked:
        if len(chosen) >= size:
            break
        chosen.add(tok)
    for tok in range(vocab_size):  # a corpus smaller than `size` distinct tokens: pad by id
        if len(chosen) >= size:
            break
        chosen.add(tok)
    return torch.tensor(sorted(chosen), dtype=torch.long)


def vocab_coverage(token_streams, vocab: torch.Tensor) -> float:
    """Fraction of corpus tokens that fall inside the subset (an upper bound on greedy alpha there)."""
    inside, total, keep = 0, 0, set(vocab.tolist())
    for ids in token_streams:
        inside += sum(1 for t in ids if t in keep)
        total += len(ids)
    return inside / total if total else 0.0


class DraftStudent(nn.Module):
    """A HF causal LM plus an optional reduced head: logits over `vocab` (None = full vocabulary).
    The reduced head is its own parameter, initialised from the model's head rows."""

    vocab: torch.Tensor | None  # a buffer (follows .to()), not saved in state_dict

    def __init__(self, model: PreTrainedModel, vocab: torch.Tensor | None = None):
        super().__init__()
        self.model = model
        self.register_buffer("vocab", vocab, persistent=False)
        self.head: nn.Parameter | None = None
        if vocab is not None and model.config.tie_word_embeddings:
            raise ValueError("a reduced head needs an untied draft (init_draft_from_layers(..., untie_head=True))")
        if vocab is not None:
            rows = model.get_output_embeddings().weight.detach()[vocab].clone()
            self.head = nn.Parameter(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.head is None:
            return self.model(input_ids=input_ids, use_cache=False).logits
        hidden = self.model.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state
        return F.linear(hidden, self.head)

    def full_to_student(self, full_vocab: int) -> torch.Tensor:
        """Map full id -> student index (-1 where the student has no row)."""
        if self.vocab is None:
            return torch.arange(full_vocab)
        index = torch.full((full_vocab,), -1, dtype=torch.long)
        index[self.vocab] = torch.arange(self.vocab.numel())
        return index

    def param_groups(self) -> dict[str, list[nn.Parameter]]:
        """Parameters by recipe group name: layers, norm, head, embed."""
        dec = self.model.get_decoder()
        head = [self.head] if self.head is not None else [self.model.get_output_embeddings().weight]
        groups = {"layers": list(dec.layers.parameters()), "norm": list(dec.norm.parameters()),
                  "head": head, "embed": list(self.model.get_input_embeddings().parameters())}
        return groups

    def set_trainable(self, names: list[str]) -> list[nn.Parameter]:
        unknown = sorted(set(names) - set(PARAM_GROUPS))
        if unknown:
            raise ValueError(f"unknown trainable group(s) {unknown}; choose from {list(PARAM_GROUPS)}")
        for p in self.parameters():
            p.requires_grad_(False)
        chosen, seen = [], set()
        for name in names:
            for p in self.param_groups()[name]:
                if id(p) not in seen:
                    seen.add(id(p))
                    p.requires_grad_(True)
                    chosen.append(p)
        return chosen

    def export(self, out_dir: Path, tokenizer=None, manifest: dict | None = None, dtype: str = "float32") -> None:
        """Save a standard HF checkpoint with weights in `dtype` (the model in memory is left as it is); a
        reduced head is written into its rows of the full head and its ids go to draft_vocab.json."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        if self.head is not None:
            assert self.vocab is not None  # a reduced head exists only with its vocab
            with torch.no_grad():
                weight = self.model.get_output_embeddings().weight
                weight[self.vocab.to(weight.device)] = self.head.detach()
        target = torch_dtype(dtype)
        if target == self.model.dtype:
            self.model.save_pretrained(out_dir)
        else:
            copy.deepcopy(self.model).to(target).save_pretrained(out_dir)
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)
        if self.vocab is not None:
            (out_dir / DRAFT_VOCAB_FILE).write_text(json.dumps(
                {"verifier_vocab_size": int(self.model.config.vocab_size), "token_ids": self.vocab.tolist()}))
        if manifest is not None:
            (out_dir / "draft_manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))


def load_draft_vocab(draft_dir: Path) -> torch.Tensor | None:
    """The reduced head's token ids stored beside a draft checkpoint, or None (full head)."""
    path = Path(draft_dir) / DRAFT_VOCAB_FILE
    if not path.exists():
        return None
    return torch.tensor(json.loads(path.read_text())["token_ids"], dtype=torch.long)


def tokenizer_differences(verifier_tok, draft_tok) -> list[str]:
    """What differs between two tokenizers (empty list = compatible for speculative decoding)."""
    diffs = []
    if len(verifier_tok) != len(draft_tok):
        diffs.append(f"vocabulary size {len(draft_tok)} vs the verifier's {len(verifier_tok)}")
    for attr in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id"):
        a, b = getattr(verifier_tok, attr, None), getattr(draft_tok, attr, None)
        if a != b:
            diffs.append(f"{attr} {b} vs the verifier's {a}")
    va, vb = verifier_tok.get_vocab(), draft_tok.get_vocab()
    differ = [t for t, i in va.items() if vb.get(t) != i]
    if differ:
        diffs.append(f"{len(differ)} tokens map to other ids (e.g. {differ[:3]})")
    return diffs


def check_tokenizers_match(verifier_tok, draft_tok) -> None:
    diffs = tokenizer_differences(verifier_tok, draft_tok)
    if diffs:
        raise ValueError("the draft's tokenizer differs from the verifier's: " + "; ".join(diffs))


def load_causal_lm(path: Path, device: str = "cpu"):
    """A checkpoint folder (a draft, the verifier variant, the baseline) as the validate stage loads it, in eval mode,
    on `device`: pipeline/quant/checkpoint.py, so a method's reload hook runs and a verifier with an FP8 KV cache
    reads its keys and values through float8 (plain from_pretrained ran it with a 16-bit cache)."""
    return load_checkpoint(Path(path), device)

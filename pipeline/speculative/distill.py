"""Knowledge distillation of the draft from the verifier.

Why these losses: with draft distribution q and verifier distribution p, the expected acceptance
of one speculative-sampling step is  alpha = sum_x min(p(x), q(x)) = 1 - TVD(p, q), so total
variation is the quantity we want small; KL divergences bound it (Pinsker: TVD <= sqrt(KL/2))
and have smoother gradients (DistillSpec, Zhou et al. 2024, compares all four):
  forward_kl  KL(p || q) = sum p log(p/q)      mass-covering
  reverse_kl  KL(q || p) = sum q log(q/p)      mode-seeking
  tvd         1/2 sum |p - q|                  = 1 - alpha
  jsd         1/2 KL(p || m) + 1/2 KL(q || m), m = (p + q)/2
Both distributions are softened by the same temperature T (no T^2 rescaling; lr absorbs it).

With top-k teacher targets the vocabulary is coarsened into k+1 buckets: the teacher's top-k
tokens (those the student can emit) and one "rest" bucket holding everything else, for both p
and q. A divergence between coarsened distributions is a lower bound of the full one (data
processing inequality) and it still punishes a student that leaks mass outside the teacher's
top-k. A student with a reduced vocabulary S has no row for some top-k tokens: the teacher is
conditioned on S (those tokens dropped, p renormalised), since q is 0 there anyway.
"""
from __future__ import annotations

import math
import pickle
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from pipeline.base.errors import StageError
from pipeline.base.fileio import atomic_path

LOSSES = ("forward_kl", "reverse_kl", "tvd", "jsd")
_LOG_FLOOR = -1e4


def divergence(logp: torch.Tensor, logq: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-position divergence between distributions given as log-probs over the last dim.
    log 0 = -inf is floored at -1e4 (exp(-1e4) == 0 in float32), so 0 * log 0 terms are 0 and
    no inf/nan reaches a gradient."""
    logp, logq = logp.clamp_min(_LOG_FLOOR), logq.clamp_min(_LOG_FLOOR)
    p, q = logp.exp(), logq.exp()
    if kind == "forward_kl":
        return (p * (logp - logq)).sum(-1)
    if kind == "reverse_kl":
        return (q * (logq - logp)).sum(-1)
    if kind == "tvd":
        return 0.5 * (p - q).abs().sum(-1)
    if kind == "jsd":
        logm = torch.logaddexp(logp, logq) - math.log(2.0)
        return 0.5 * (p * (logp - logm)).sum(-1) + 0.5 * (q * (logq - logm)).sum(-1)
    raise ValueError(f"unknown distillation loss {kind!r}; choose from {list(LOSSES)}")


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, kind: str = "forward_kl",
            temperature: float = 1.0, top_k: int | None = None) -> torch.Tensor:
    """Mean divergence over positions between softmax(teacher/T) and softmax(student/T), both
    [..., V] over the same vocabulary; with `top_k`, over the teacher's top-k + rest buckets."""
    teacher_logp = torch.log_softmax(teacher_logits.float() / temperature, -1)
    if top_k is None:
        student_logp = torch.log_softmax(student_logits.float() / temperature, -1)
        return divergence(teacher_logp, student_logp, kind).mean()
    vals, ids = teacher_logp.topk(top_k, dim=-1)
    rest = teacher_logp.scatter(-1, ids, float("-inf")).logsumexp(-1)
    return kd_loss_topk(student_logits, vals, ids, rest, kind, temperature)


def kd_loss_topk(student_logits: torch.Tensor, teacher_logp: torch.Tensor, teacher_ids: torch.Tensor,
                 teacher_rest: torch.Tensor, kind: str = "forward_kl", temperature: float = 1.0) -> torch.Tensor:
    """Bucketed loss. teacher_logp [..., K] top-k log-probs (already at temperature T),
    teacher_ids [..., K] their indices in the STUDENT's vocabulary (-1: the student has no row;
    the teacher is renormalised without it), teacher_rest [...] log of the teacher mass outside
    the top-k."""
    teacher_logp = teacher_logp.float()
    student_logp = torch.log_softmax(student_logits.float() / temperature, -1)
    inside = teacher_ids >= 0
    safe_ids = teacher_ids.clamp_min(0).long()
    q_top = torch.where(inside, student_logp.gather(-1, safe_ids), float("-inf"))
    # student "rest": logsumexp over all its tokens except the representable top-k ones
    # (amax so that a -1 id clamped onto index 0 never un-marks a real top-k hit at index 0)
    hit = torch.zeros_like(student_logp).scatter_reduce(-1, safe_ids, inside.float(), reduce="amax")
    masked = student_logp.masked_fill(hit > 0, float("-inf"))
    q_rest = masked.logsumexp(-1)
    # teacher: top-k tokens the student cannot emit are dropped and p renormalised, i.e. p
    # conditioned on the draft's vocabulary S: where q must be 0, the best q for acceptance
    # (sum min(p, q)) follows p restricted to S; pushing that mass into "rest" would teach the
    # draft to spread it over arbitrary tokens
    p_top = torch.where(inside, teacher_logp, float("-inf"))
    logp = torch.cat([p_top, teacher_rest.float()[..., None]], -1)
    logp = logp - logp.logsumexp(-1, keepdim=True)
    logq = torch.cat([q_top, q_rest[..., None]], -1)
    return divergence(logp, logq, kind).mean()


def top1_agreement(student_logits: torch.Tensor, teacher_top_ids: torch.Tensor) -> float:
    """Fraction of positions where the student's argmax (in its own index space) equals the
    teacher's top-1 mapped into that space (-1, never equal, if the student has no row for it)."""
    return (student_logits.argmax(-1) == teacher_top_ids[..., 0]).float().mean().item()


# ---------------------------------------------------------------------------- the training loop
def lr_factor(step: int, progress: float, schedule: str, warmup: int) -> float:
    """Linear warm-up over `warmup` steps, then `schedule` over progress in [0, 1] down to 10%."""
    warm = min(1.0, (step + 1) / (warmup + 1)) if warmup else 1.0
    progress = min(max(progress, 0.0), 1.0)
    if schedule == "cosine":
        decay = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
    elif schedule == "linear":
        decay = 1.0 - 0.9 * progress
    else:
        decay = 1.0
    return warm * decay


class InjectedFault(RuntimeError):
    """Raised by the fault-injection point of `distill` (resume tests kill a run this way)."""


def distill(student, data, cfg, work_dir: Path | None, seed: int, log=print, fault_at_step: int | None = None,
            progress: bool = True, run_fingerprint: str = "") -> dict:
    """Train `student` (a DraftStudent) on `data` (a TrainingData) per `cfg` (a DistillConfig).
    Checkpoints (trainable weights, AdamW state, RNG state, step = data position, elapsed time)
    go to work_dir/checkpoint.pt every cfg.checkpoint_every steps; a rerun with the same
    `run_fingerprint` resumes from it and, in steps mode, reaches the same weights."""
    torch.manual_seed(seed)
    params = student.set_trainable(cfg.train)
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    state: dict[str, Any] = {"step": 0, "elapsed": 0.0, "teacher_s": 0.0, "history": []}
    ckpt = Path(work_dir) / "checkpoint.pt" if work_dir else None
    if ckpt and ckpt.exists():
        state = _load_checkpoint(ckpt, student, opt, run_fingerprint, log) or state
    resumed_from = state["step"]
    device = next(student.parameters()).device  # the student trains where it lives; targets are kept on the CPU
    index = student.full_to_student(data.vocab_size).to(device)
    bar = tqdm(total=cfg.steps, initial=state["step"], disable=not progress, desc="distill draft",
               unit="step", dynamic_ncols=True)
    while not _done(state, cfg):
        if fault_at_step is not None and state["step"] == fault_at_step:
            raise InjectedFault(f"fault injected at step {fault_at_step}")
        loss, agree = _train_step(student, data, opt, params, index, cfg, state)
        state["history"].append((loss, agree))
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", top1=f"{agree:.3f}")
        if ckpt and state["step"] % cfg.checkpoint_every == 0:
            _save_checkpoint(ckpt, student, opt, state, run_fingerprint)
    bar.close()
    if ckpt:
        _save_checkpoint(ckpt, student, opt, state, run_fingerprint)
    tail = state["history"][-10:] or [(float("nan"), float("nan"))]
    return {"steps": state["step"], "resumed_from_step": resumed_from, "train_time_s": state["elapsed"],
            "teacher_time_s": state["teacher_s"], "final_loss": sum(h[0] for h in tail) / len(tail),
            "top1_agreement": sum(h[1] for h in tail) / len(tail),
            "trainable_params": sum(p.numel() for p in params),
            "tokens_seen": state["step"] * cfg.batch_size * cfg.seq_len}


def _done(state: dict, cfg) -> bool:
    return ((cfg.steps is not None and state["step"] >= cfg.steps)
            or (cfg.time_budget_s is not None and state["elapsed"] >= cfg.time_budget_s))


def _progress(state: dict, cfg) -> float:
    fractions = []
    if cfg.steps is not None:
        fractions.append(state["step"] / cfg.steps)
    if cfg.time_budget_s is not None:
        fractions.append(state["elapsed"] / cfg.time_budget_s)
    return max(fractions)


def _train_step(student, data, opt, params, index, cfg, state) -> tuple[float, float]:
    t0 = time.perf_counter()
    batch = data.batch(state["step"]).to(index.device)  # teacher targets (computed or cached)
    t1 = time.perf_counter()
    factor = lr_factor(state["step"], _progress(state, cfg), cfg.schedule, cfg.warmup)
    for group in opt.param_groups:
        group["lr"] = cfg.lr * factor
    student.train()
    with torch.autocast(batch.ids.device.type, dtype=torch.bfloat16, enabled=cfg.train_precision == "bf16"):
        logits = student(batch.ids)
    student_ids = index[batch.top_ids.long()]  # teacher's top-k in the student's index space
    loss = kd_loss_topk(logits, batch.logprobs, student_ids, batch.rest, cfg.loss, cfg.temperature)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    opt.step()
    state["step"] += 1
    state["teacher_s"] += t1 - t0
    state["elapsed"] += time.perf_counter() - t0
    return loss.item(), top1_agreement(logits.detach(), student_ids)


def _trainable_state(student) -> dict:
    return {n: p.detach().clone() for n, p in student.named_parameters() if p.requires_grad}


def _save_checkpoint(path: Path, student, opt, state: dict, run_fingerprint: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:  # a kill never leaves a half-written checkpoint
        torch.save({"fingerprint": run_fingerprint, "state": state, "params": _trainable_state(student),
                    "optimizer": opt.state_dict(), "torch_rng": torch.get_rng_state()}, tmp)


def _load_checkpoint(path: Path, student, opt, run_fingerprint: str, log) -> dict | None:
    """Tensors, dicts, lists, numbers and strings only (weights_only=True): unpickling anything else could run
    code, and a checkpoint is a file on disk that anything may have replaced."""
    try:
        blob = torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
        reason = next((ln for ln in lines if "unsupported" in ln.lower()), lines[0])  # torch: "Unsupported global: …"
        raise StageError(f"draft checkpoint {path} holds more than tensors and plain values, so it was not loaded "
                         f"({reason}); delete it to distil afresh") from None
    if blob["fingerprint"] != run_fingerprint:
        log(f"draft: ignoring checkpoint {path} from a different configuration; starting afresh")
        return None
    named = dict(student.named_parameters())
    with torch.no_grad():
        for name, value in blob["params"].items():
            named[name].copy_(value)
    opt.load_state_dict(blob["optimizer"])
    torch.set_rng_state(blob["torch_rng"])
    log(f"draft: resuming distillation from step {blob['state']['step']} ({path})")
    return blob["state"]

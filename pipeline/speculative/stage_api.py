"""Entry points for the draft stage and the speculative part of validate (thin stage files call
these): build_draft (init, vocabulary subset, distillation, export). Measuring a draft is
pipeline/speculative/evaluate.py, so that changing how a draft is measured never re-distils it."""
from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from pipeline.base.public import public_tree
from pipeline.model.models import load_source
from pipeline.model.sources import parse
from pipeline.speculative.config import DraftConfig
from pipeline.speculative.distill import distill
from pipeline.speculative.draft_model import (
    DraftStudent,
    check_tokenizers_match,
    evenly_spaced_layers,
    fit_output_map,
    init_draft_from_layers,
    load_causal_lm,
    select_vocab,
    vocab_coverage,
)
from pipeline.speculative.targets import TargetStore, TrainingData, fingerprint, token_windows

MEASURE_ONLY = {"measure", "gamma"}  # read only when the draft is measured: never part of what a draft is


def init_draft(verifier, cfg: DraftConfig, base_dir: Path | None,
               verifier_tok) -> tuple[torch.nn.Module, list[int] | None]:
    """The undistilled draft: verifier layers (copied from `base_dir`, the unquantized model, if
    the verifier is quantized) or another model with the same tokenizer ([draft] source: any model
    source, loaded in float32 like [model])."""
    untie = (cfg.vocab_size is not None or cfg.init_head == "lens"
             or bool({"head", "embed"} & set(cfg.distill.train)))
    if cfg.init == "model":
        assert cfg.source is not None  # DraftConfig: init = 'model' needs source
        draft, draft_tok = load_source(parse(cfg.source), "float32", 0, None)
        check_tokenizers_match(verifier_tok, draft_tok)
        if untie and draft.config.tie_word_embeddings:
            raise ValueError("[draft] a reduced or trainable head needs a draft with untied embeddings")
        return draft, None
    base = load_causal_lm(base_dir, str(verifier.device)) if base_dir else verifier
    total = base.config.num_hidden_layers
    if cfg.layers is not None:
        layers = cfg.layers
    else:
        assert cfg.num_layers is not None  # DraftConfig sets it to 1 when neither is given
        layers = evenly_spaced_layers(total, cfg.num_layers)
    return init_draft_from_layers(base, layers, untie_head=untie), layers


def build_draft(verifier_dir: Path, cfg: DraftConfig, train_texts: list[str], out_dir: Path, work_dir: Path,
                seed: int, log=print, base_dir: Path | None = None, progress: bool = True,
                targets_root: Path | None = None,
                save_initial: bool = False, device: str = "cpu") -> dict:
    """Initialise, distill and save the draft (HF checkpoint + tokenizer + draft_vocab.json when
    reduced + draft_manifest.json naming the verifier). The undistilled draft is saved to
    work_dir/undistilled for comparison. Teacher targets are kept under `targets_root` (default
    work_dir), in a folder named by what they depend on, so several drafts can share them.
    `save_initial` also keeps the tuned-lens draft before distillation (work_dir/initial).
    Returns the distillation metrics."""
    t_start = time.perf_counter()
    torch.manual_seed(seed)
    verifier_dir, out_dir, work_dir = Path(verifier_dir), Path(out_dir), Path(work_dir)
    tok = AutoTokenizer.from_pretrained(str(verifier_dir))
    verifier = load_causal_lm(verifier_dir, device)
    draft, layers = init_draft(verifier, cfg, base_dir, tok)
    draft = draft.to(verifier.device)  # built on the CPU; it trains and is fitted where the verifier runs
    d = cfg.distill
    windows = token_windows(tok, train_texts, d.seq_len)
    vocab, coverage = choose_vocab(cfg, windows, verifier, tok)
    undistilled_dir = work_dir / "undistilled"
    if d.steps != 0 and not (undistilled_dir / "config.json").exists():  # steps = 0: it would be the draft itself
        DraftStudent(draft, vocab).export(undistilled_dir, tok, {"verifier": cfg.verifier, "distilled": False},
                                          dtype=cfg.dtype)
    lens = tuned_lens(cfg, draft, verifier, windows, log) if cfg.init_head == "lens" else None
    student = DraftStudent(draft, vocab)
    if save_initial and lens is not None and not (work_dir / "initial" / "config.json").exists():
        student.export(work_dir / "initial", tok, {"verifier": cfg.verifier, "distilled": False, "lens": lens},
                       dtype=cfg.dtype)
    head = "full" if vocab is None else f"{vocab.numel()} tokens (coverage {coverage:.3f})"
    log(f"draft: layers {layers}, head {head}, {len(windows)} training windows of {d.seq_len} tokens")
    metrics: dict[str, Any]
    if d.steps == 0:
        log("draft: [draft.distill] steps = 0: no distillation, the draft is used as initialised")
        metrics = {"steps": 0, "resumed_from_step": 0, "train_time_s": 0.0, "teacher_time_s": 0.0,
                   "final_loss": None, "top1_agreement": None, "trainable_params": 0, "tokens_seen": 0}
    else:
        data, data_fp = training_data(verifier_dir, verifier, windows, d, Path(targets_root or work_dir), seed)
        run_fp = fingerprint(data=data_fp, draft=cfg.model_dump(exclude=MEASURE_ONLY), seed=seed)
        metrics = distill(student, data, d, work_dir, seed, log, progress=progress, run_fingerprint=run_fp)
    # published with the draft: the verifier checkpoint's folder name and file names, never a path of this machine
    manifest = {"verifier": cfg.verifier, "verifier_dir": verifier_dir.name, "layers": layers,
                "draft_vocab_size": None if vocab is None else int(vocab.numel()), "vocab_coverage": coverage,
                "seed": seed, "distill": metrics,
                "config": public_tree(cfg.model_dump(mode="json", exclude=MEASURE_ONLY))}
    student.export(out_dir, tok, manifest, dtype=cfg.dtype)
    metrics.update(layers=layers, draft_vocab_size=manifest["draft_vocab_size"], vocab_coverage=coverage, lens=lens,
                   undistilled_dir=str(undistilled_dir), total_time_s=time.perf_counter() - t_start)
    return metrics


def tuned_lens(cfg: DraftConfig, draft, verifier, windows: torch.Tensor, log) -> dict:
    """Closed-form head initialisation on the last corpus windows (see fit_output_map)."""
    t0 = time.perf_counter()
    n = max(1, -(-cfg.lens_tokens // windows.shape[1]))
    unexplained = fit_output_map(draft, verifier, windows[-n:], precision=cfg.distill.teacher_precision)
    lens = {"unexplained": unexplained, "tokens": n * windows.shape[1], "time_s": time.perf_counter() - t0}
    log(f"draft: tuned-lens head fitted on {lens['tokens']} tokens in {lens['time_s']:.0f}s "
        f"(unexplained variance {unexplained:.3f})")
    return lens


def training_data(verifier_dir: Path, verifier, windows: torch.Tensor, d, targets_root: Path, seed: int):
    """Batches of teacher targets; the store's folder is named by what its records depend on."""
    data_fp = fingerprint(verifier=str(verifier_dir.resolve()), config=_read(verifier_dir / "config.json"),
                          windows=_tensor_hash(windows), top_k=d.top_k, t=d.temperature, precision=d.teacher_precision)
    store = TargetStore(targets_root / f"targets-{data_fp}" if d.cache_teacher else None)
    data = TrainingData(verifier, windows, store, batch_size=d.batch_size, top_k=d.top_k, temperature=d.temperature,
                        on_policy_fraction=d.on_policy_fraction, prompt_len=d.prompt_len,
                        gen_temperature=d.on_policy_temperature, pool_size=d.pool_size, seed=seed,
                        precision=d.teacher_precision, gen_batch=d.on_policy_batch)
    return data, data_fp


def choose_vocab(cfg: DraftConfig, windows: torch.Tensor, verifier, tok):
    if cfg.vocab_size is None:
        return None, 1.0
    full = verifier.get_output_embeddings().weight.shape[0]
    if cfg.vocab_size > full:
        raise ValueError(f"[draft] vocab_size {cfg.vocab_size} exceeds the verifier's vocabulary ({full})")
    streams = windows.tolist()
    always = [i for i in (tok.eos_token_id, tok.bos_token_id) if i is not None]
    vocab = select_vocab(streams, cfg.vocab_size, full, always)
    return vocab, vocab_coverage(streams, vocab)


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _tensor_hash(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()[:16]

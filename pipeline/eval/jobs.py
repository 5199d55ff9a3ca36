"""The quality worker's job, built in one place for both callers: `compress eval` (pipeline/app/cli.py) and the
validate/<model>/quality unit (pipeline/stages/validate.py). Its reader is pipeline/eval/quality.py worker_task.
Torch-free: the measuring happens in the worker process. (Speed has its one entry too: eval/speed.py
run_speed_subprocess, used by `compress bench` and the speed unit.)"""
from __future__ import annotations

from pathlib import Path

from pipeline.base.worker import run_task


def quality_args(model_dir: str | Path, out: str | Path, ppl_cfg, smoke_cfg, device: str, *,
                 reference: str | Path | None = None, label: str | None = None,
                 memory_limit: int | None = None) -> dict:
    """The "quality" task's arguments. reference: the baseline's quality folder (KL, top-1, its exact tokens);
    memory_limit: [run] max_memory_gb in bytes (a plain checkpoint over it is offloaded; None: no limit)."""
    return {"model_dir": str(model_dir), "out": str(out), "perplexity": ppl_cfg.model_dump(),
            "smoke": smoke_cfg.model_dump(), "device": device,
            "reference": None if reference is None else str(reference),
            "label": label if label is not None else Path(model_dir).name, "memory_limit": memory_limit}


def run_quality(model_dir: str | Path, out: Path, ppl_cfg, smoke_cfg, device: str, threads: int | None, *,
                reference: str | Path | None = None, label: str | None = None,
                memory_limit: int | None = None) -> dict:
    """Perplexity (and KL, top-1, the smoke test, size) of one checkpoint in a fresh worker process; its log is
    out/quality.log."""
    args = quality_args(model_dir, out, ppl_cfg, smoke_cfg, device, reference=reference, label=label,
                        memory_limit=memory_limit)
    return run_task("quality", args, Path(out), threads)

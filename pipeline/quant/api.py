"""The one entry point the quantize stage calls: one variant in, one complete checkpoint folder out."""
from __future__ import annotations

import importlib
import logging
import time
from pathlib import Path

import torch

from pipeline.env import tame
from pipeline.errors import StageError
from pipeline.memory import PeakMemory
from pipeline.quant.capabilities import caps
from pipeline.quant.common import calibration_fingerprint, captured_output

# library loggers whose lines go to the variant's log file rather than the console
ENGINE_LOGGERS = ("logbar", "gptqmodel", "tokenicer", "transformers", "bitsandbytes", "optimum", "autoround")


def quantize_variant(base_dir: Path, variant, calib_ids: torch.LongTensor | None, out_dir: Path,
                     log: logging.Logger, seed: int, device: str | None = None) -> dict:
    """Quantize the HF checkpoint in base_dir as `variant` into out_dir (config, safetensors, tokenizer,
    generation config, the engine's log). Returns the manifest fields. Writes nothing outside out_dir
    except library caches (torch extensions, HF)."""
    c = caps(variant)
    base_dir, out_dir = Path(base_dir).resolve(), Path(out_dir).resolve()  # engines may chdir
    if c.needs_calibration and calib_ids is None:
        raise StageError(f"variant {variant.name!r} ({c.name}) needs calibration ids; none were given")
    if calib_ids is not None and (calib_ids.dim() != 2 or calib_ids.dtype != torch.long):
        raise StageError(f"calibration ids must be a LongTensor [n_samples, seq_len], got "
                         f"{calib_ids.dtype} {list(calib_ids.shape)}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    out_dir.mkdir(parents=True, exist_ok=True)
    tame()
    log_name = f"{c.engine}.log"
    log.info("quantize %s: %s (%s) on %s; engine log: %s", variant.name, c.name, c.engine, device, log_name)
    with captured_output(out_dir / log_name, ENGINE_LOGGERS) as console:
        impl = implementation(variant)
        importlib.import_module(c.engine)  # import-time memory is not the variant's: import before measuring
        torch.manual_seed(seed)
        try:
            with PeakMemory() as mem, impl.session(out_dir):
                t0 = time.perf_counter()
                model = impl.quantize(base_dir, variant, calib_ids if c.needs_calibration else None, console, device)
                details = impl.save(model, base_dir, out_dir, variant)
                elapsed = time.perf_counter() - t0
        # the engine's, with its log named (libraries also assert their own preconditions)
        except (RuntimeError, ValueError, OSError, NotImplementedError, AssertionError) as e:
            raise StageError(f"quantize {variant.name}: {c.engine} failed: {type(e).__name__}: {e} "
                             f"(its log: {out_dir / log_name})") from e
    log.info("quantize %s: done in %.1f s, peak memory +%.0f MiB", variant.name, elapsed, mem.above_start_bytes / 2**20)
    return {
        "method": c.name, "params": variant.model_dump(mode="json"), **details, "device": device, "seed": seed,
        "time_s": round(elapsed, 3), "peak_rss_above_baseline_bytes": mem.above_start_bytes,
        "calibration": calibration_fingerprint(calib_ids) if c.needs_calibration else None,
        "log": log_name,
    }


def implementation(variant):
    """The method's module: session(out_dir) context, quantize(base_dir, variant, calib_ids, console, device)
    -> in-memory model, save(model, base_dir, out_dir, variant) -> manifest details."""
    spec = caps(variant).impl
    try:
        return importlib.import_module(spec)
    except ImportError as e:
        raise StageError(f"{spec} cannot be imported ({e}); install the project's dependencies "
                         "(pip install -e .)") from e

"""What every quantization method shares: output capture, progress, the finished checkpoint's files."""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import torch
from safetensors import safe_open
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM

from pipeline.model.dtypes import config_dtype
from pipeline.quant.shapes import is_skipped

# Tokenizer files a checkpoint folder may carry (copied verbatim from the base checkpoint).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt")


_patch_lock = threading.Lock()
_patches: dict[tuple[type, str], list] = {}  # (class, attribute) -> [callers inside, the library's own]


@contextlib.contextmanager
def library_method_replaced(cls: type, name: str, make: Callable[[Callable], Callable]) -> Iterator[None]:
    """`cls.name` is `make(the library's own)` while any caller is inside; the library's own is back when the last
    one leaves. Re-entrant and thread-safe: an engine's worker threads call the method, stages may nest."""
    key = (cls, name)
    with _patch_lock:
        entry = _patches.setdefault(key, [0, getattr(cls, name)])
        if entry[0] == 0:
            setattr(cls, name, make(entry[1]))
        entry[0] += 1
    try:
        yield
    finally:
        with _patch_lock:
            entry[0] -= 1
            if entry[0] == 0:
                setattr(cls, name, entry[1])
                del _patches[key]


def calibration_fingerprint(ids: torch.Tensor | None) -> dict | None:
    """sha256 of the int64 token ids (row-major bytes) plus their shape."""
    if ids is None:
        return None
    ids = ids.to(torch.int64).contiguous().cpu()
    return {"sha256": hashlib.sha256(ids.numpy().tobytes()).hexdigest(), "shape": list(ids.shape)}


def base_dtype(base_dir: Path) -> str:
    return config_dtype(json.loads((base_dir / "config.json").read_text()))


@contextlib.contextmanager
def captured_output(log_path: Path, loggers: tuple[str, ...] = ()) -> Iterator[IO[str]]:
    """Send everything written to file descriptors 1 and 2 while the block runs (Python prints, library
    loggers and progress bars, C++ compiler output, background threads) to log_path, and raise the
    named library loggers to INFO so their lines land in the file, not on the console.
    Yields a text stream on the real stderr for our own progress bar."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    console = os.fdopen(os.dup(saved[1]), "w", buffering=1)
    levels = {name: logging.getLogger(name).level for name in loggers}
    with open(log_path, "ab", buffering=0) as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        for name in loggers:
            logging.getLogger(name).setLevel(logging.INFO)
        try:
            yield console
        finally:
            _drain_logbar()
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            console.close()
            for name, level in levels.items():
                logging.getLogger(name).setLevel(level)


def _drain_logbar() -> None:
    """GPTQModel's logger writes through a queue drained by a thread: flush it before restoring the fds."""
    buffer = sys.modules.get("logbar.buffer")
    if buffer is None:
        return
    with contextlib.suppress(Exception):
        buffer.get_buffered_stdout(sys.stdout).flush()


def finish_checkpoint(base_dir: Path, out_dir: Path, quantization_config: dict, dtype: str | None = None) -> None:
    """Make out_dir a clean HF checkpoint: the base model's config.json plus `quantization_config`
    (engines also rewrite pad tokens and sampling defaults: those edits are dropped), the base
    generation_config.json and tokenizer files verbatim, and safetensors weights only."""
    cfg = json.loads((base_dir / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    if dtype is not None:
        cfg["dtype"] = dtype
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for name in TOKENIZER_FILES + ("generation_config.json",):
        if (base_dir / name).is_file():
            shutil.copyfile(base_dir / name, out_dir / name)
        elif (out_dir / name).exists():
            (out_dir / name).unlink()  # the engine's invention (e.g. do_sample=true): keep the base's behaviour
    pickled = sorted(p.name for p in out_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl"))
    if pickled:
        raise RuntimeError(f"the engine wrote pickled weights {pickled} in {out_dir}; only safetensors are allowed")
    if not any(out_dir.glob("*.safetensors")):
        raise RuntimeError(f"the engine wrote no .safetensors weights in {out_dir}")


class LayerProgress:
    """A tqdm bar that counts decoder layers as the engine reports each one done."""

    def __init__(self, total: int, label: str, stream: IO[str]) -> None:
        self._seen: set[int] = set()
        self.bar = tqdm(total=total, desc=f"quantize {label}", unit="layer", file=stream, dynamic_ncols=True,
                        mininterval=0.5)

    def layer_done(self, layer_idx: int, **_: object) -> None:
        if layer_idx not in self._seen:
            self._seen.add(layer_idx)
            self.bar.update(1)

    def finish(self) -> None:
        """All layers are done (engines without per-layer callbacks, e.g. GPTQModel's weight-only RTN)."""
        self.bar.update(self.bar.total - self.bar.n)

    def close(self) -> None:
        self.bar.close()


def skipped_linears(base_dir: Path, modules_to_skip: list[str]) -> list[str]:
    """Full names of the model's nn.Linear modules that modules_to_skip names (model built on the meta device)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base_dir))
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and is_skipped(n, modules_to_skip)]


def quantized_in_blocks(out_dir: Path) -> list[list[str]]:
    """transformers (through optimum) ignores GPTQModel's `dynamic` skips when it loads a checkpoint and
    would build quantized modules for skipped layers; it honours `modules_in_block_to_quantize`, matched
    as name suffixes. Read the quantized names back from the weights: one kind list when every layer
    has the same ones, else the full names."""
    names = set()
    for f in sorted(out_dir.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            names |= {k.removesuffix(".qweight")
                      for k in st.keys() if k.endswith(".qweight")}  # noqa: SIM118 - safe_open is not iterable
    per_layer: dict[str, set[str]] = {}
    for n in names:
        m = re.match(r"^(.*\.\d+)\.(.+)$", n)
        if m:
            per_layer.setdefault(m.group(1), set()).add(m.group(2))
    kinds = list(per_layer.values())
    if kinds and all(k == kinds[0] for k in kinds):
        return [sorted(kinds[0])]
    return [sorted(n for n in names if re.match(r"^.*\.\d+\.", n))]

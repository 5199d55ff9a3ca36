"""Decisions a stage makes at run time from the memory it can see: whether the baseline's perplexity offloads part
of its weights to disk under [run] max_memory_gb."""
from __future__ import annotations

import json
from pathlib import Path

from pipeline.base.errors import StageError
from pipeline.base.memory import rss_bytes
from pipeline.budget.formulas import GiB, window_bytes
from pipeline.model.models import folder_bytes, single_gguf


def offload_bytes(model_dir: Path, seq_len: int, limit: int | None, device: str) -> int | None:
    """None when the checkpoint in model_dir fits `limit` beside this process's memory now and one window's
    activations (or there is no limit); else the bytes of its weights to keep in memory, the rest offloaded.
    Quantized checkpoints and GPU runs are not offloaded here (`compress check` requires them to fit)."""
    if limit is None or device != "cpu":
        return None
    config = json.loads((model_dir / "config.json").read_text())
    if "quantization_config" in config or single_gguf(model_dir) is not None:
        return None
    room = limit - rss_bytes() - window_bytes(config, seq_len)
    weights = folder_bytes(model_dir)
    if weights <= room:
        return None
    layer = weights // max(config.get("num_hidden_layers") or 1, 1)
    if room < layer:
        raise StageError(f"{model_dir.name}: [run] max_memory_gb = {limit / GiB:.2f} GiB leaves {room / GiB:.2f} GiB "
                         f"for weights beside a {seq_len}-token window's activations "
                         f"({window_bytes(config, seq_len) / GiB:.2f} GiB); offloading needs room for at least one "
                         f"layer ({layer / GiB:.2f} GiB): raise max_memory_gb or lower validate.perplexity.seq_len")
    return room

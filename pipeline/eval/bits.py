"""Bits per weight of a checkpoint's decoder linears as stored: what a quantization format really costs."""
from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import gguf

from pipeline.model.models import single_gguf
from pipeline.quant.shapes import linear_shapes_from_config, module_kinds


def linear_bits_per_weight(folder: Path) -> float | None:
    """Bits per weight of the decoder blocks' linear layers as stored (quantized values, scales, zero points,
    g_idx, and skipped layers at their float size): 8 x their bytes / their weights. None when the layer
    shapes are not known (no architecture definition) or nothing matched."""
    folder = Path(folder)
    gguf_file = single_gguf(folder)
    if gguf_file is not None:
        blk = [t for t in gguf.GGUFReader(folder / gguf_file).tensors
               if t.name.startswith("blk.") and len(t.shape) == 2]  # norms are 1-D
        weights = sum(int(t.n_elements) for t in blk)
        return 8 * sum(int(t.n_bytes) for t in blk) / weights if weights else None

    arch = linear_shapes_from_config(json.loads((folder / "config.json").read_text()))
    if not arch.shapes_known:
        return None
    prefix = arch.layers + "."
    inner = {n: k for n, k in module_kinds(arch) if n.startswith(prefix)}  # routed experts counted one by one
    shapes = {n: (arch.linear_in_features[k], arch.linear_out_features[k]) for n, k in inner.items()}
    stored = {n: 0 for n in shapes}
    for name, nbytes in _safetensors_sizes(folder):
        module = name.rsplit(".", 1)[0]
        while module and module not in stored:  # bnb's "<module>.weight.absmax" and the like
            module = module.rpartition(".")[0]
        if module:
            stored[module] += nbytes
    weights = sum(i * o for n, (i, o) in shapes.items() if stored[n])
    return 8 * sum(stored.values()) / weights if weights else None


def _safetensors_sizes(folder: Path) -> Iterator[tuple[str, int]]:
    """(tensor name, bytes) from the safetensors headers: no tensor is read."""
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        for name, meta in header.items():
            if name != "__metadata__":
                yield name, meta["data_offsets"][1] - meta["data_offsets"][0]

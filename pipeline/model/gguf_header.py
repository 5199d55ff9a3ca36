"""Read a GGUF file's metadata and tensor table without loading any weights.

gguf.GGUFReader materialises every array (49k-token vocabularies included) and takes
~6 s on SmolLM2; `compress check` must answer in well under that, so this reads the
header directly and skips array payloads. Format: github.com/ggml-org/ggml docs/gguf.md.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# ggml type id -> name (the ones that occur in released checkpoints)
GGML_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 10: "Q2_K", 11: "Q3_K",
              12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 30: "BF16"}
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
              12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
              32: "BF16"}


# a metadata value: a scalar or a string (arrays are skipped; their lengths are kept in array_lengths)
Value = int | float | bool | str


@dataclass
class GGUFHeader:
    metadata: dict[str, Value] = field(default_factory=dict)
    array_lengths: dict[str, int] = field(default_factory=dict)
    tensors: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)

    @property
    def n_params(self) -> int:
        total = 0
        for shape, _ in self.tensors.values():
            n = 1
            for d in shape:
                n *= d
            total += n
        return total

    @property
    def file_type(self) -> str:
        ft = self.metadata.get("general.file_type")
        return FILE_TYPES.get(int(ft), f"type {ft}") if ft is not None else "unknown"


def _read(f: BinaryIO, fmt: str) -> int | float | bool:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("truncated GGUF header")
    return struct.unpack(fmt, data)[0]


def _read_int(f: BinaryIO, fmt: str) -> int:
    """An unsigned integer field (counts, lengths, type ids: fmt "<I" or "<Q")."""
    value = _read(f, fmt)
    assert isinstance(value, int)  # struct unpacks an integer format to an int
    return value


def _string(f: BinaryIO) -> str:
    n = _read_int(f, "<Q")
    return f.read(n).decode("utf-8", errors="replace")


def _skip_value(f: BinaryIO, vtype: int) -> None:
    if vtype == _STRING:
        f.seek(_read_int(f, "<Q"), 1)
    elif vtype in _SCALARS:
        f.seek(struct.calcsize(_SCALARS[vtype]), 1)
    elif vtype == _ARRAY:  # arrays may nest (the format allows arrays of arrays)
        etype, count = _read_int(f, "<I"), _read_int(f, "<Q")
        for _ in range(count):
            _skip_value(f, etype)
    else:
        raise ValueError(f"unknown GGUF value type {vtype}")


def _value(f: BinaryIO, vtype: int, key: str, header: GGUFHeader) -> Value | None:
    if vtype == _STRING:
        return _string(f)
    if vtype in _SCALARS:
        return _read(f, _SCALARS[vtype])
    if vtype == _ARRAY:
        etype, count = _read_int(f, "<I"), _read_int(f, "<Q")
        header.array_lengths[key] = count
        if etype in _SCALARS:
            f.seek(struct.calcsize(_SCALARS[etype]) * count, 1)
        else:
            for _ in range(count):
                _skip_value(f, etype)
        return None
    raise ValueError(f"unknown GGUF value type {vtype}")


def read_header(path: Path) -> GGUFHeader:
    header = GGUFHeader()
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (bad magic)")
        version = _read_int(f, "<I")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported")
        n_tensors, n_kv = _read_int(f, "<Q"), _read_int(f, "<Q")
        for _ in range(n_kv):
            key = _string(f)
            value = _value(f, _read_int(f, "<I"), key, header)
            if value is not None:
                header.metadata[key] = value
        for _ in range(n_tensors):
            name = _string(f)
            dims = tuple(_read_int(f, "<Q") for _ in range(_read_int(f, "<I")))
            ttype = _read_int(f, "<I")
            _read(f, "<Q")  # data offset
            header.tensors[name] = (dims, GGML_TYPES.get(ttype, str(ttype)))
    return header

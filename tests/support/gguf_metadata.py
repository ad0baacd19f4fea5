"""A tiny GGUF metadata reader for the tokenizer tests, until Part A's ``GGUFFile`` is on main.

It returns what ``GGUFFile.metadata`` promises: plain Python values, arrays as lists.
(``gguf.GGUFReader`` takes ~19 s on Gemma 3's file; this reads its metadata in well under one.)
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    data = Path(path).read_bytes() if Path(path).stat().st_size < (1 << 20) else _head(path)
    if data[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    _version, _tensors, count = struct.unpack_from("<IQQ", data, 4)
    offset = 24
    metadata: dict[str, Any] = {}
    for _ in range(count):
        key, offset = _string(data, offset)
        (kind,), offset = struct.unpack_from("<I", data, offset), offset + 4
        metadata[key], offset = _value(data, offset, kind)
    return metadata


def _head(path) -> bytes:
    with open(path, "rb") as f:
        return f.read(64 << 20)  # metadata sits at the start (Gemma's vocabulary is ~6 MB)


def _string(data: bytes, offset: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", data, offset)
    start = offset + 8
    return data[start : start + n].decode("utf-8", errors="surrogateescape"), start + n


def _value(data: bytes, offset: int, kind: int) -> tuple[Any, int]:
    if kind in _SCALARS:
        fmt = "<" + _SCALARS[kind]
        (value,) = struct.unpack_from(fmt, data, offset)
        return value, offset + struct.calcsize(fmt)
    if kind == _STRING:
        return _string(data, offset)
    if kind == _ARRAY:
        item, n = struct.unpack_from("<IQ", data, offset)
        offset += 12
        if item in _SCALARS:
            fmt = "<" + _SCALARS[item] * n
            return list(struct.unpack_from(fmt, data, offset)), offset + struct.calcsize(fmt)
        values = []
        for _ in range(n):
            value, offset = _value(data, offset, item)
            values.append(value)
        return values, offset
    raise ValueError(f"unknown GGUF value type {kind}")

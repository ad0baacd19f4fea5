"""A fast, strict reader of GGUF (v2 / v3) headers: metadata as plain Python values, tensor infos.

The gguf package's ``GGUFReader`` builds a numpy view per metadata array entry (one
per token of a vocabulary, e.g. Gemma 3 270M's 262,144); this reader walks the header
once with ``struct`` and turns numeric arrays into lists through one ``np.frombuffer``
each. It uses the package's constants (value types, ggml types, block sizes) only.

The layout (little-endian; ``str`` = u64 byte length + UTF-8 bytes)::

    "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv times:      str key | u32 value type | value   (arrays: u32 item type | u64 count | items)
    n_tensors times: str name | u32 n_dims | u64 dims[n_dims] (ggml order: fastest first)
                     | u32 ggml type | u64 offset (from the data section, aligned)
    padding to ``general.alignment`` (default 32) | tensor data

A tensor of ggml dims ``[640, 2048]`` in Q4_K (256 values in 144 bytes per block) is the
numpy-order shape ``(2048, 640)`` and holds ``2048 * 640 / 256 * 144 = 737,280`` bytes.

Anything that cannot be a GGUF file (bad magic, a version other than 2 / 3, a count or
length that runs past the end of the file, an array nested absurdly deep, a tensor
whose data ends past the file) is a :class:`~hybridkv.errors.GGUFFormatError` naming the
byte offset: every length is checked against the bytes left before anything is
allocated, so a corrupt count never turns into a MemoryError or a long loop.

    f = GGUFFile.open("model.gguf")
    f.metadata["general.architecture"]      # 'gemma3'
    info = f.tensor("token_embd.weight")    # GGUFTensorInfo(shape=(262144, 640), type_name='Q8_0', ...)
    f.raw(info)                             # np.memmap bytes (quantized) or float array
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridkv.errors import GGUFFormatError

__all__ = ["GGUFFile", "GGUFTensorInfo", "GGUF_MAGIC", "SUPPORTED_VERSIONS", "MAX_ARRAY_DEPTH"]

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
#: nested arrays deeper than this are refused (GGUFWriter writes depth 1; llama.cpp reads none deeper)
MAX_ARRAY_DEPTH = 8
#: ggml's GGML_MAX_DIMS
MAX_DIMS = 4
_DEFAULT_ALIGNMENT = 32

# value type id -> (struct format, size); the ids are gguf.GGUFValueType's (a test checks them)
_STRING, _ARRAY, _BOOL = 8, 9, 7
_SCALARS: dict[int, tuple[str, int]] = {
    0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4),
    6: ("f", 4), 7: ("?", 1), 10: ("Q", 8), 11: ("q", 8), 12: ("d", 8),
}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 10: "<u8", 11: "<i8", 12: "<f8"}



@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    """One tensor of a GGUF file.

    ``shape`` is numpy order (slowest first; ggml's dims reversed); ``offset`` is the absolute
    byte offset of its data in the file, ``nbytes`` its stored size.
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    type_name: str
    offset: int
    nbytes: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class _Cursor:
    """Bounds-checked little-endian reads from a buffer."""

    __slots__ = ("buf", "pos", "size", "path")

    def __init__(self, buf, path: str) -> None:
        self.buf = buf
        self.pos = 0
        self.size = len(buf)
        self.path = path

    def fail(self, what: str) -> GGUFFormatError:
        return GGUFFormatError(f"{self.path}: {what} (at byte {self.pos:,} of {self.size:,})")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"truncated GGUF file: {what} needs {n:,} bytes, {self.size - self.pos:,} left")

    def unpack(self, fmt: str, size: int, what: str):
        self.need(size, what)
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def u32(self, what: str) -> int:
        return self.unpack("I", 4, what)

    def u64(self, what: str) -> int:
        return self.unpack("Q", 8, what)

    def string(self, what: str) -> str:
        n = self.u64(f"the length of {what}")
        self.need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what} is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        scalar = _SCALARS.get(vtype)
        if scalar is not None:
            return self.unpack(*scalar, what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            return self.nested(what, depth)
        raise self.fail(f"{what} has unknown value type {vtype}")

    def array(self, item_type: int, count: int, what: str, depth: int) -> list[Any]:
        if item_type in _NUMPY:
            size = _SCALARS[item_type][1]
            self.need(count * size, f"{what} ({count:,} items)")
            import numpy as np

            items = np.frombuffer(self.buf, dtype=_NUMPY[item_type], count=count, offset=self.pos).tolist()
            self.pos += count * size
            return items
        if item_type == _BOOL:
            self.need(count, f"{what} ({count:,} items)")
            items = [b != 0 for b in self.buf[self.pos : self.pos + count]]
            self.pos += count
            return items
        if item_type == _STRING:  # the hot loop of a vocabulary: no method calls per item
            self.need(count * 8, f"{what} ({count:,} strings)")
            buf, pos, size, out = self.buf, self.pos, self.size, []
            unpack = struct.Struct("<Q").unpack_from
            append = out.append
            try:
                for _ in range(count):
                    (n,) = unpack(buf, pos)
                    pos += 8
                    if pos + n > size:
                        self.pos = pos
                        raise self.fail(f"truncated GGUF file: an item of {what} needs {n:,} bytes")
                    append(buf[pos : pos + n].decode("utf-8"))
                    pos += n
            except UnicodeDecodeError as exc:
                self.pos = pos
                raise self.fail(f"an item of {what} is not valid UTF-8 ({exc.reason})") from None
            except struct.error:
                self.pos = pos
                raise self.fail(f"truncated GGUF file inside {what}") from None
            self.pos = pos
            return out
        if item_type == _ARRAY:
            self.need(count * 12, f"{what} ({count:,} arrays)")  # each: u32 type + u64 count
            return [self.nested(what, depth) for _ in range(count)]
        raise self.fail(f"{what} has unknown item type {item_type}")

    def nested(self, what: str, depth: int) -> list[Any]:
        """An array value (item type, count, items) ``depth`` arrays deep."""
        if depth >= MAX_ARRAY_DEPTH:
            raise self.fail(f"{what}: arrays nested more than {MAX_ARRAY_DEPTH} deep")
        item_type = self.u32(f"the item type of {what}")
        count = self.u64(f"the length of {what}")
        return self.array(item_type, count, what, depth + 1)


#: files parsed in this process, by (path, size, modification time, inode): GGUFFile.open's cache
_PARSED: dict[tuple, "GGUFFile"] = {}
_PARSED_MAX = 8


class GGUFFile:
    """A parsed GGUF header; tensor data stays on disk (see :meth:`raw`)."""

    def __init__(
        self,
        path: Path,
        version: int,
        metadata: dict[str, Any],
        value_types: dict[str, int],
        tensors: tuple[GGUFTensorInfo, ...],
        alignment: int,
        data_offset: int,
        size: int,
    ) -> None:
        self.path = path
        self.version = version
        #: key -> plain Python value (str, int, float, bool, nested lists of them)
        self.metadata = metadata
        #: key -> its gguf.GGUFValueType id (arrays: 9)
        self.value_types = value_types
        #: the tensors in file order
        self.tensors = tensors
        self.alignment = alignment
        self.data_offset = data_offset
        self.size = size
        self._by_name = {t.name: t for t in tensors}
        self._sha256: str | None = None

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> "GGUFFile":
        """Parse the header of ``path``; GGUFFormatError if it is not a complete GGUF file. A
        file parsed before and unchanged since (the same size and modification time) is not
        parsed again: a tokenizer's metadata arrays take most of a second to read, and a load
        opens the file for its config, its tokenizer and its tensors."""
        path = Path(path)
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                size = st.st_size
                if size == 0:
                    raise GGUFFormatError(f"{path}: empty file (0 bytes), not GGUF")
                key = (str(path.resolve()), size, st.st_mtime_ns, st.st_ino)
                if key in _PARSED:
                    return _PARSED[key]
                buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                try:
                    parsed = cls._parse(path, buf, size)
                    if len(_PARSED) >= _PARSED_MAX:
                        _PARSED.pop(next(iter(_PARSED)))
                    _PARSED[key] = parsed
                    return parsed
                finally:
                    try:
                        buf.close()
                    except BufferError:  # a numpy view still alive (an error's traceback): the GC closes it
                        pass
        except IsADirectoryError:
            raise GGUFFormatError(f"{path} is a folder, not a GGUF file") from None
        except OSError as exc:
            raise GGUFFormatError(f"cannot read {path}: {exc.strerror or exc}") from None

    @classmethod
    def _parse(cls, path: Path, buf: mmap.mmap, size: int) -> "GGUFFile":
        cur = _Cursor(buf, str(path))
        try:
            if size < 4 or buf[:4] != GGUF_MAGIC:
                raise GGUFFormatError(f"{path}: not a GGUF file (starts with {buf[:4]!r}, not b'GGUF')")
            cur.pos = 4
            version = cur.u32("the version")
            if version not in SUPPORTED_VERSIONS:
                hint = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
                raise cur.fail(f"GGUF version {version} is not supported{hint}; supported: {SUPPORTED_VERSIONS}")
            n_tensors = cur.u64("the tensor count")
            n_kv = cur.u64("the metadata count")
            # each entry holds at least a key length, a type and 1 byte; each tensor info 8 + 4 + 4 + 8
            cur.need(n_kv * 13, f"{n_kv:,} metadata entries")
            cur.need(n_tensors * 24, f"{n_tensors:,} tensor infos")
            metadata: dict[str, Any] = {}
            value_types: dict[str, int] = {}
            for i in range(n_kv):
                key = cur.string(f"metadata key {i}")
                if key in metadata:
                    raise cur.fail(f"metadata key {key!r} appears twice")
                vtype = cur.u32(f"the type of {key!r}")
                metadata[key] = cur.value(vtype, repr(key))
                value_types[key] = vtype
            infos = [cls._tensor_info(cur, i) for i in range(n_tensors)]
            alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
            aligned_u32 = value_types.get("general.alignment", 4) == 4 and isinstance(alignment, int)
            if not aligned_u32 or alignment <= 0 or alignment & (alignment - 1):
                raise cur.fail(f"general.alignment must be a power-of-two uint32, got {alignment!r}")
            data_offset = -(-cur.pos // alignment) * alignment
            tensors = cls._place(path, infos, alignment, data_offset, size)
        except RecursionError:
            raise GGUFFormatError(f"{path}: metadata nested too deeply") from None
        return cls(path, version, metadata, value_types, tensors, alignment, data_offset, size)

    @staticmethod
    def _tensor_info(cur: _Cursor, i: int) -> tuple[str, tuple[int, ...], int, int]:
        name = cur.string(f"the name of tensor {i}")
        n_dims = cur.u32(f"the dims of {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.fail(f"tensor {name!r} has {n_dims} dims (1 to {MAX_DIMS} allowed)")
        dims = [cur.u64(f"the dims of {name!r}") for _ in range(n_dims)]
        ggml_type = cur.u32(f"the type of {name!r}")
        offset = cur.u64(f"the offset of {name!r}")
        return name, tuple(reversed(dims)), ggml_type, offset

    @staticmethod
    def _place(path: Path, infos, alignment: int, data_offset: int, size: int) -> tuple[GGUFTensorInfo, ...]:
        """Tensor infos with absolute offsets and sizes, each checked to lie inside the file."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        out: list[GGUFTensorInfo] = []
        seen: set[str] = set()
        for name, shape, ggml_type, offset in infos:
            if name in seen:
                raise GGUFFormatError(f"{path}: tensor {name!r} appears twice")
            seen.add(name)
            try:
                qtype = GGMLQuantizationType(ggml_type)
                block, type_size = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise GGUFFormatError(f"{path}: tensor {name!r} has unknown ggml type {ggml_type}") from None
            n = 1
            for d in shape:
                n *= d
            if shape[-1] % block:
                raise GGUFFormatError(
                    f"{path}: tensor {name!r} rows of {shape[-1]} values are not whole {qtype.name} blocks of {block}"
                )
            nbytes = n // block * type_size
            if offset % alignment:
                raise GGUFFormatError(f"{path}: tensor {name!r} data offset {offset} is not aligned to {alignment}")
            start = data_offset + offset
            if start + nbytes > size:
                raise GGUFFormatError(
                    f"{path}: truncated GGUF file: tensor {name!r} ends at byte {start + nbytes:,} "
                    f"but the file holds {size:,}"
                )
            out.append(GGUFTensorInfo(name, shape, ggml_type, qtype.name, start, nbytes))
        return tuple(out)

    # ---------------------------------------------------------------- access
    @property
    def architecture(self) -> str | None:
        arch = self.metadata.get("general.architecture")
        return arch if isinstance(arch, str) else None

    def tensor(self, name: str) -> GGUFTensorInfo:
        """The tensor called ``name`` (KeyError if absent)."""
        return self._by_name[name]

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def raw(self, info: GGUFTensorInfo):
        """The stored data of ``info``, memory-mapped read-only: for F32 / F16 / BF16 ... a typed
        array of ``info.shape``; for block-quantized types uint8 of shape ``(*shape[:-1], row bytes)``
        (what ``gguf.quants.dequantize`` takes)."""
        import numpy as np
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        qtype = GGMLQuantizationType(info.ggml_type)
        plain = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                 "I32": np.int32, "I64": np.int64}.get(qtype.name)
        if plain is not None:
            shape = info.shape
            dtype = plain
        else:
            block, type_size = GGML_QUANT_SIZES[qtype]
            shape = (*info.shape[:-1], info.shape[-1] // block * type_size)
            dtype = np.uint8
        data = np.memmap(self.path, dtype=np.uint8, mode="r", offset=info.offset, shape=(info.nbytes,))
        return data.view(dtype).reshape(shape)

    def sha256(self) -> str:
        """The hex sha256 of the whole file (computed once, 1 MiB at a time)."""
        if self._sha256 is None:
            h = hashlib.sha256()
            with open(self.path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            self._sha256 = h.hexdigest()
        return self._sha256

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, v{self.version}, {len(self.metadata)} keys, {len(self.tensors)} tensors)"

"""A disk cache of a GGUF file's dequantized fp32 tensors, keyed by the file's sha256.

Dequantizing a GGUF file's tensors decodes every block; reading the cached fp32 tensors
back (a memory-mapped safetensors file) is only a read. The first load streams each
tensor to ``<cache>/gguf-<sha256>-v<CACHE_VERSION>.safetensors.tmp-<pid>`` as it is
loaded (the header is known up front from the GGUF's tensor infos, so nothing is held
twice in memory) and renames it into place when every tensor is written: a reader
sees a complete file or none. A cache file that does not open, or whose tensors are
not the ones the GGUF file gives, is removed and rebuilt.

``<cache>`` is ``$HYBRIDKV_CACHE_DIR``, else ``~/.cache/hybridkv``; ``HYBRIDKV_CACHE_DIR=off``
turns the cache off. The sha256 of a file is remembered per (path, size, mtime), so a
warm load does not hash the whole file again.

The safetensors layout written (as the ``safetensors`` package reads it)::

    u64 N | N bytes of JSON {"name": {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}, ...,
                             "__metadata__": {...}} padded with spaces to a multiple of 8 | data
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

__all__ = ["CACHE_VERSION", "cache_dir", "file_sha256", "cached_tensors", "cache_path"]

#: bump when the conversion of GGUF tensors changes (names, layouts, values)
CACHE_VERSION = 1
_OFF = ("off", "0", "none", "false")


def cache_dir() -> Path | None:
    """The cache folder (None: the cache is off)."""
    env = os.environ.get("HYBRIDKV_CACHE_DIR")
    if env is not None:
        return None if env.strip().lower() in _OFF or not env.strip() else Path(env)
    return Path.home() / ".cache" / "hybridkv"


def _stat_key(path: Path) -> str:
    st = path.stat()
    return hashlib.sha1(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()


def file_sha256(path: str | Path, folder: Path | None = None) -> str:
    """The hex sha256 of ``path``, remembered under ``folder`` per (path, size, mtime)."""
    path = Path(path)
    memo = folder / "sha256" / _stat_key(path) if folder is not None else None
    if memo is not None:
        try:
            text = memo.read_text().strip()
            if len(text) == 64:
                return text
        except OSError:
            pass
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    digest = h.hexdigest()
    if memo is not None:
        _write_atomic(memo, digest.encode())
    return digest


def _write_atomic(path: Path, data: bytes) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache folder only costs speed


def cache_path(folder: Path, sha256: str) -> Path:
    return folder / f"gguf-{sha256}-v{CACHE_VERSION}.safetensors"


def _header(plan: list[tuple[str, tuple[int, ...]]], sha256: str) -> bytes:
    table: dict[str, object] = {"__metadata__": {"gguf_sha256": sha256, "version": str(CACHE_VERSION)}}
    offset = 0
    for name, shape in plan:
        n = 4
        for d in shape:
            n *= d
        table[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(table, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _read_cache(path: Path, plan: list[tuple[str, tuple[int, ...]]]) -> Iterator[tuple[str, torch.Tensor]] | None:
    """The cached tensors if ``path`` holds exactly ``plan``'s names and shapes in fp32 (this
    CACHE_VERSION), else None (and the file is removed)."""
    from safetensors import safe_open

    want = {name: (tuple(shape), "F32") for name, shape in plan}
    try:
        handle = safe_open(str(path), framework="pt")
        with handle as f:
            found = {name: (tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype()) for name in f.keys()}
            if (f.metadata() or {}).get("version") != str(CACHE_VERSION):
                found = None
    except Exception:  # a truncated / corrupt file: safetensors raises its own types
        found = None
    if found != want:
        try:
            path.unlink()
        except OSError:
            pass
        return None

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        with safe_open(str(path), framework="pt") as f:
            for name, _ in plan:
                yield name, f.get_tensor(name)

    return tensors()


def cached_tensors(
    sha256: str,
    plan: list[tuple[str, tuple[int, ...]]],
    build: Callable[[], Iterable[tuple[str, torch.Tensor]]],
    folder: Path | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors ``build()`` yields (in ``plan``'s order and shapes, fp32), from the cache when it
    holds them, else built and written to it on the way. ``folder``: :func:`cache_dir` by default."""
    folder = folder if folder is not None else cache_dir()
    if folder is None:
        yield from build()
        return
    path = cache_path(folder, sha256)
    if path.exists():
        cached = _read_cache(path, plan)
        if cached is not None:
            yield from cached
            return
    yield from _build_and_write(path, sha256, plan, build)


def _build_and_write(path: Path, sha256: str, plan, build) -> Iterator[tuple[str, torch.Tensor]]:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        out = open(tmp, "wb")
    except OSError:
        yield from build()  # cannot write the cache: load without it
        return
    expected = iter(plan)
    complete = False
    try:
        with out:
            out.write(_header(plan, sha256))
            writing = True
            for name, tensor in build():
                want = next(expected, None)
                if writing and (want is None or want[0] != name or tuple(tensor.shape) != tuple(want[1])):
                    writing = False  # not what the header says: give up the cache, keep loading
                if writing:
                    try:
                        out.write(tensor.detach().to(torch.float32).contiguous().numpy().data)
                    except OSError:  # disk full, ...
                        writing = False
                yield name, tensor
            complete = writing and next(expected, None) is None
        if complete:
            try:
                os.replace(tmp, path)
            except OSError:
                pass
    finally:
        if not complete or tmp.exists():
            try:
                tmp.unlink()
            except OSError:
                pass

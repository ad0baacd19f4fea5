"""``generate``'s checks of a model argument, run before torch loads anything.

:func:`resolve_model_source` takes an installed model's name (``gemma-3-270m``), a
``.gguf`` file, a model directory or its ``config.json``, and checks what it can
without torch: a GGUF file's header, tensor extents and architecture (a truncated
file is one GGUFFormatError line), a directory's config and weight files.
:func:`resolve_model_dir` takes what ``plan`` takes for a checkpoint on disk: the
directory, or its ``config.json``. :func:`check_weight_files` says what is wrong
with which weight file (a broken link, a folder, an empty or truncated file) where
the safetensors reader would say "No such file" or "header too large".

A safetensors file starts with an 8-byte little-endian header length ``N``, then
``N`` bytes of JSON (each tensor's ``data_offsets``, relative to the end of the
header), then the tensors; so a file shorter than ``8 + N + the largest end offset``
is truncated (or not safetensors)::

    00 01 00 00 00 00 00 00 | {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}} ...
    N = 256: the file holds 8 + 256 + 16 = 280 bytes
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

from hybridkv.checkpoint import (
    INSTALLED_MODELS,
    GGUFFile,
    ModelSource,
    checkpoint_files,
    hf_config_from_gguf,
    installed_model_path,
)
from hybridkv.errors import InvalidArgumentError, WeightLoadError
from hybridkv.planner.presets import find_preset

__all__ = ["resolve_model_source", "check_gguf_file", "resolve_model_dir", "check_weight_files"]

_WANTED = "a model directory (config.json + *.safetensors) or its config.json"
_WANTED_ANY = f"an installed model ({', '.join(INSTALLED_MODELS)}), a .gguf file, {_WANTED}"


def check_gguf_file(path: Path) -> None:
    """GGUFFormatError for a file that is not a complete GGUF file, UnknownArchitectureError for
    an architecture hybridkv cannot run (reads the header only)."""
    gguf = GGUFFile.open(path)
    hf_config_from_gguf(gguf.metadata, [t.name for t in gguf.tensors])


def resolve_model_source(text: str) -> ModelSource:
    """The model ``text`` names, checked (see the module docstring): an installed name, a GGUF
    file, else a model directory (as :func:`resolve_model_dir`) whose weight files are checked."""
    key = text.strip().lower()
    if key in INSTALLED_MODELS:
        path, sha256 = installed_model_path(key)
        check_gguf_file(path)
        return ModelSource("gguf", path, key, sha256)
    path = Path(text)
    if path.is_file() and path.name != "config.json":  # GGUF, or a file that is not a model
        check_gguf_file(path)
        return ModelSource("gguf", path, text)
    if not path.exists() and find_preset(text) is None:
        raise InvalidArgumentError(f"{path} does not exist; give {_WANTED_ANY}")
    model_dir = resolve_model_dir(text)
    check_weight_files(checkpoint_files(model_dir))
    return ModelSource("dir", model_dir, text)


def resolve_model_dir(text: str) -> Path:
    """The model directory named by ``text``: the directory itself, or the folder of its ``config.json``."""
    path = Path(text)
    if path.is_file():
        if path.name != "config.json":
            raise InvalidArgumentError(f"{path} is a file; generate needs {_WANTED}")
        path = path.parent
    elif not path.exists():
        hint = f" ({text!r} is a plan preset: a config without weights)" if find_preset(text) else ""
        raise InvalidArgumentError(f"{path} does not exist{hint}; generate needs {_WANTED}")
    elif not path.is_dir():
        raise InvalidArgumentError(f"{path} is not a directory; generate needs {_WANTED}")
    config = path / "config.json"
    if config.is_dir():
        raise InvalidArgumentError(f"{config} is a folder, not a file")
    if not config.exists():
        raise InvalidArgumentError(f"no config.json in {path}; generate needs {_WANTED}")
    return path


def _problem(path: Path) -> str | None:
    """What makes ``path`` unreadable as a safetensors file, or None."""
    if path.is_symlink() and not path.exists():
        return f"is a broken symbolic link (to {os.readlink(path)}, which does not exist)"
    if not path.exists():
        return "does not exist"
    if path.is_dir():
        return "is a folder, not a safetensors file"
    if not path.is_file():
        return "is not a regular file"
    if not os.access(path, os.R_OK):
        return "is not readable (permission denied)"
    size = path.stat().st_size
    if size == 0:
        return "is empty (0 bytes); was the download interrupted?"
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if len(head) < 8:
        return f"holds {size} bytes, too few for a safetensors header"
    header = int.from_bytes(head, "little")
    if 8 + header > size:
        return (
            f"is not a complete safetensors file: its header claims {header:,} bytes but the file holds {size:,} "
            "(truncated, or not safetensors)"
        )
    try:
        with open(path, "rb") as f:
            f.seek(8)
            entries = json.loads(f.read(header).decode("utf-8"))
        ends = [e["data_offsets"][1] for k, e in entries.items() if k != "__metadata__"]
        need = 8 + header + max(ends, default=0)
    except (OSError, ValueError, RecursionError, TypeError, KeyError, IndexError, AttributeError):
        return "is not a safetensors file (its header is not the JSON table of tensors)"
    if not isinstance(need, int) or need > size:
        return f"is truncated: its tensors end at byte {need:,} but the file holds {size:,}"
    return None


def check_weight_files(files: Iterable[Path]) -> None:
    """Raise WeightLoadError naming the first of ``files`` that cannot be read as safetensors."""
    for path in files:
        problem = _problem(Path(path))
        if problem is not None:
            raise WeightLoadError(f"{path} {problem}")

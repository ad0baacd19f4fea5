"""The config dict of any model source: a directory's ``config.json`` or a GGUF file's metadata.

    read_model_config("gemma-3-270m")["layer_types"][:6]   # 5 x 'sliding_attention', 'full_attention'
    read_model_config("ckpt/")                             # ckpt/config.json, parsed

Torch-free: the planner and the CLI call it before anything loads weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hybridkv.checkpoint.gguf_config import hf_config_from_gguf
from hybridkv.checkpoint.gguf_file import GGUFFile
from hybridkv.checkpoint.installed import ModelSource, resolve_model
from hybridkv.checkpoint.model_dir import read_config_json

__all__ = ["read_model_config", "as_model_source"]


def as_model_source(source: str | Path | ModelSource) -> ModelSource:
    """``source`` itself, or the ModelSource its text names (:func:`resolve_model`)."""
    return source if isinstance(source, ModelSource) else resolve_model(source)


def read_model_config(source: str | Path | ModelSource) -> dict[str, Any]:
    """The HF-shaped config of ``source`` (GGUF: :func:`hf_config_from_gguf` of its metadata)."""
    source = as_model_source(source)
    if source.kind == "dir":
        return read_config_json(source.path)
    gguf = GGUFFile.open(source.path)
    return hf_config_from_gguf(gguf.metadata, [t.name for t in gguf.tensors])

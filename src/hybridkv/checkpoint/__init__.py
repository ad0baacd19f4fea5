"""Checkpoints on disk, torch-free: which file a model name means, GGUF headers, configs.

- :mod:`~hybridkv.checkpoint.installed`: ``resolve_model(text) -> ModelSource`` (a name such as
  ``gemma-3-270m``, a ``.gguf`` file, a model directory or its ``config.json``).
- :mod:`~hybridkv.checkpoint.gguf_file`: ``GGUFFile.open(path)``: metadata and tensor infos.
- :mod:`~hybridkv.checkpoint.gguf_config`: GGUF metadata -> an HF ``config.json``-shaped dict.
- :mod:`~hybridkv.checkpoint.model_dir`: a model directory's ``config.json`` and safetensors files.
- :mod:`~hybridkv.checkpoint.config`: ``read_model_config(source)`` for any of them.

The torch side (dequantizing, renaming, loading) is :mod:`hybridkv.engine.loading.gguf_weights`.
numpy and the ``gguf`` package are imported only when a GGUF file is read.
"""

from hybridkv.checkpoint.config import as_model_source, read_model_config
from hybridkv.checkpoint.gguf_config import SUPPORTED_GGUF_ARCHITECTURES, gguf_eos_token_ids, hf_config_from_gguf
from hybridkv.checkpoint.gguf_file import GGUFFile, GGUFTensorInfo
from hybridkv.checkpoint.installed import (
    INSTALLED_MODELS,
    ModelSource,
    installed_model_path,
    looks_like_gguf,
    resolve_model,
)
from hybridkv.checkpoint.model_dir import checkpoint_files, read_config_json

__all__ = [
    "ModelSource",
    "INSTALLED_MODELS",
    "resolve_model",
    "installed_model_path",
    "looks_like_gguf",
    "GGUFFile",
    "GGUFTensorInfo",
    "hf_config_from_gguf",
    "gguf_eos_token_ids",
    "SUPPORTED_GGUF_ARCHITECTURES",
    "read_config_json",
    "checkpoint_files",
    "read_model_config",
    "as_model_source",
]

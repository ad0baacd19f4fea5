"""The torch side of hybridkv: paged KV storage, attention backends, layers, models, runner.

Needs the ``[engine]`` extra (torch, safetensors). Nothing outside this package imports
torch, and importing this package does not either (names load on first use, PEP 562).

    storage = PagedKVStorage(groups, block_size, num_blocks, num_kv_heads, head_size)
    model = load_model("path/to/hf_checkpoint")
    runner = PagedModelRunner(model, storage)
    tokens = runner.execute(scheduler_output)      # {request_id: token}
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["AttentionMetadata", "AttentionType", "PagedKVStorage", "PagedModelRunner", "load_model", "paged_attention"]

_LAZY = {
    "AttentionMetadata": "hybridkv.engine.attention.metadata",
    "AttentionType": "hybridkv.engine.attention.types",
    "paged_attention": "hybridkv.engine.attention.layer",
    "PagedKVStorage": "hybridkv.engine.kv_storage",
    "PagedModelRunner": "hybridkv.engine.model_runner",
    "load_model": "hybridkv.engine.models",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Paged attention: the step metadata, the backend interface and registry, and the backends.

    types.py          attention types (full, sliding W, chunked C): which keys a query sees
    plan.py           how a step's queries are cut into padded buckets (the reference's plan)
    metadata.py       AttentionMetadata: the per-step fields every backend reads
    backend.py        AttentionBackend: the interface (name, unavailable, new_state, forward)
    registry.py       backend names -> classes, and the ``auto`` rule (torch-free)
    layer.py          paged_attention: the one call a model layer makes
    reference.py      the ``reference`` backend (torch ops, any device)
    cpu.py            the ``cpu`` backend (C decode kernel); cpu_stack.py its fused decode step
    triton.py         the ``triton`` backend; triton_forward.py, cascade.py, decode_graphs.py and
                      triton_kernels/ beside it

Names are imported on first use (PEP 562), so importing the registry imports no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from hybridkv.engine.attention.registry import (
    backend_names,
    check_backend_name,
    get_backend,
    register_backend,
    resolve_backend,
    unregister_backend,
)

__all__ = ["FULL", "AttentionBackend", "AttentionMetadata", "AttentionType", "allowed_key_mask", "backend_names",
           "check_backend_name", "get_backend", "padded_tables", "paged_attention", "register_backend",
           "resolve_backend", "unregister_backend"]

_LAZY = {
    "FULL": "types", "AttentionType": "types", "allowed_key_mask": "types",
    "AttentionMetadata": "metadata", "padded_tables": "metadata",
    "AttentionBackend": "backend",
    "paged_attention": "layer",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

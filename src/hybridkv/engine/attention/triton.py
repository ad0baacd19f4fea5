"""The ``triton`` attention backend: Triton kernels on CUDA (and under triton's interpreter on a CPU).

This module imports no kernel: the registry asks :meth:`TritonBackend.unavailable` before anything
is compiled, and triton's ``@jit`` must first be imported with the interpreter setting in force.
The forward, its step state and the cascade live in :mod:`~hybridkv.engine.attention.triton_forward`;
decode steps may be captured as CUDA graphs (:mod:`~hybridkv.engine.attention.decode_graphs`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridkv.engine.attention.backend import AttentionBackend
from hybridkv.engine.attention.triton_kernels import triton_unavailable

if TYPE_CHECKING:
    import torch

    from hybridkv.engine.attention.metadata import AttentionMetadata
    from hybridkv.engine.attention.triton_forward import TritonState
    from hybridkv.engine.attention.types import AttentionType

__all__ = ["TritonBackend"]


class TritonBackend(AttentionBackend):
    """One KV-write kernel and one attention launch per layer; cascade attention over a long shared prefix."""

    name = "triton"
    decode_graphs = True

    def unavailable(self, device_type: str) -> str | None:
        return triton_unavailable(device_type)

    def new_state(self, meta: "AttentionMetadata") -> "TritonState":
        from hybridkv.engine.attention.triton_forward import TritonState

        return TritonState(meta)

    def forward(
        self,
        query: "torch.Tensor",
        key: "torch.Tensor",
        value: "torch.Tensor",
        meta: "AttentionMetadata",
        layer: int,
        attn: "AttentionType",
        scale: float,
        sinks: "torch.Tensor | None" = None,
        softcap: float | None = None,
        keep: "torch.Tensor | None" = None,
    ) -> "torch.Tensor":
        from hybridkv.engine.attention.triton_forward import triton_paged_attention

        return triton_paged_attention(query, key, value, meta, layer, attn, scale, sinks, softcap, keep)

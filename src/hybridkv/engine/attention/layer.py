"""The one attention call every model layer makes: the step's backend does the rest."""

from __future__ import annotations

import torch

from hybridkv.engine.attention.metadata import AttentionMetadata
from hybridkv.engine.attention.types import AttentionType

__all__ = ["paged_attention"]


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    meta: AttentionMetadata,
    layer: int,
    attn: AttentionType,
    scale: float,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write this step's K/V of ``layer``, then attend through its block tables, on ``meta.backend``.

    query: [T, Hq, D]; key / value: [T, Hkv, D]; returns [T, Hq, D] ([N, Hq, D] with ``keep``):
    the contract of :meth:`~hybridkv.engine.attention.backend.AttentionBackend.forward`.
    """
    return meta.backend.forward(query, key, value, meta, layer, attn, scale, sinks, softcap, keep)

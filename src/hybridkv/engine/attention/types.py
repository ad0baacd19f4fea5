"""Attention types: which keys a query at position ``p`` may see.

Transformers 5.24's conventions (``masking_utils``), which every model here uses unchanged:

    full       k in [0, p]                              (causal)
    sliding W  k in (p - W, p]      i.e. k > p - W       (W keys, itself included)
    chunked C  k in [floor(p/C)*C, p]  i.e. k//C == p//C

Worked example: sliding W = 4 at p = 10 sees keys 7..10; chunked C = 4 at p = 10 sees 8..10.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv.engine.attention.plan import visible_keys
from hybridkv.errors import InvalidConfigError

__all__ = ["AttentionType", "FULL", "allowed_key_mask"]


@dataclass(frozen=True, slots=True)
class AttentionType:
    """``kind`` is ``"full"``, ``"sliding"`` (``size`` = window) or ``"chunked"`` (``size`` = chunk);
    ``"linear"`` (the planner's ``LINEAR_KIND``) names a Gated DeltaNet layer, which has no KV and never runs
    :func:`paged_attention` (see :mod:`hybridkv.engine.layers.gated_deltanet`)."""

    kind: str
    size: int | None = None

    def __post_init__(self) -> None:
        if self.kind in ("full", "linear"):
            if self.size is not None:
                raise InvalidConfigError(f"{self.kind} attention takes no window/chunk size")
        elif self.kind in ("sliding", "chunked"):
            if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size <= 0:
                raise InvalidConfigError(f"{self.kind} attention needs a positive int size, got {self.size!r}")
        else:
            raise InvalidConfigError(
                f"unknown attention kind {self.kind!r}; expected full, sliding, chunked or linear"
            )

    def first_key(self, pos: torch.Tensor) -> torch.Tensor:
        """Smallest key position a query at ``pos`` may attend to (elementwise)."""
        if self.kind == "sliding":
            return (pos - self.size + 1).clamp(min=0)
        if self.kind == "chunked":
            return torch.div(pos, self.size, rounding_mode="floor") * self.size
        return torch.zeros_like(pos)

    def as_tuple(self) -> tuple[str, int | None]:
        return (self.kind, self.size)


FULL = AttentionType("full")


def allowed_key_mask(attn: AttentionType, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Bool mask, True where query position ``q_pos[..., i, None]`` may see ``k_pos[..., None, j]``."""
    return visible_keys(attn.kind, attn.size, q_pos, k_pos)

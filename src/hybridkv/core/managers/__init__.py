"""One manager per attention type; ``manager_for_spec`` picks the class for a spec."""

from __future__ import annotations

from hybridkv.core.managers.base import AttentionManager, RequestBlocks
from hybridkv.core.managers.chunked_local import ChunkedLocalAttentionManager
from hybridkv.core.managers.full import FullAttentionManager
from hybridkv.core.managers.sliding_window import SlidingWindowManager
from hybridkv.core.managers.state import StateManager
from hybridkv.core.specs import CacheSpec, ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec
from hybridkv.core.state_spec import StateSpec
from hybridkv.errors import InvalidSpecError

__all__ = [
    "AttentionManager",
    "RequestBlocks",
    "FullAttentionManager",
    "SlidingWindowManager",
    "ChunkedLocalAttentionManager",
    "StateManager",
    "MANAGER_FOR_SPEC",
    "manager_class_for",
]

#: spec class -> manager class; a new attention type adds one entry (and one module)
MANAGER_FOR_SPEC: dict[type[CacheSpec], type[AttentionManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    ChunkedLocalAttentionSpec: ChunkedLocalAttentionManager,
    StateSpec: StateManager,
}


def manager_class_for(spec: CacheSpec) -> type[AttentionManager]:
    try:
        return MANAGER_FOR_SPEC[type(spec)]
    except KeyError:
        raise InvalidSpecError(
            f"no KV cache manager for {type(spec).__name__}; known: {[c.__name__ for c in MANAGER_FOR_SPEC]}"
        ) from None

"""What :class:`~hybridkv.core.kv_cache_manager.KVCacheManager` hands a scheduler:
blocks per KV cache group (a prefix hit, or the blocks one allocation added)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridkv.core.blocks import KVCacheBlock

if TYPE_CHECKING:
    from hybridkv.core.coordinator import KVCacheCoordinator
    from hybridkv.core.request import Request

__all__ = ["KVCacheBlocks"]


class KVCacheBlocks:
    """Blocks per KV cache group (``blocks[g]`` is group g's list).

    A prefix hit from :meth:`KVCacheManager.get_computed_blocks` and the result of
    ``allocate_slots`` keep the coordinator's compact form ({manager: its first
    group's blocks}; striped groups' lists follow from their leads) and build the
    per-group lists only when asked. A hit also remembers the request it was found
    for and the pool's cache epoch then, so ``allocate_slots`` can tell in O(1)
    that it is still valid.
    """

    __slots__ = ("_blocks", "_hit", "_coordinator", "_request", "_epoch")

    def __init__(self, blocks: tuple[list[KVCacheBlock], ...] | None = None, *, hit: dict | None = None,
                 coordinator: KVCacheCoordinator | None = None, request: Request | None = None, epoch: int = -1):
        if blocks is None and hit is None:
            blocks = ()
        self._blocks = blocks
        self._hit = hit
        self._coordinator = coordinator
        self._request = request
        self._epoch = epoch

    @property
    def blocks(self) -> tuple[list[KVCacheBlock], ...]:
        if self._blocks is None:
            self._blocks = self._coordinator.expand(self._hit)
        return self._blocks

    def get_block_ids(self, allow_none: bool = False) -> tuple[list[int], ...] | None:
        """Block ids per group (new lists). With ``allow_none``, None when there are no
        blocks at all (as vLLM's scheduler asks for a running request's new blocks:
        most decode steps add none)."""
        blocks = self._blocks
        if blocks is None:  # the compact form: ids straight from the leads
            hit = self._hit
            if allow_none and not any(hit.values()):
                return None
            return self._coordinator.expand_ids(hit)
        if not any(blocks):  # e.g. a decode step that needed no block
            return None if allow_none else tuple(map(list, blocks))
        return tuple([b.block_id for b in group] for group in blocks)

    def num_blocks(self) -> int:
        return sum(len(group) for group in self.blocks)

    def __len__(self) -> int:
        return len(self.blocks)

    def __repr__(self) -> str:
        return f"KVCacheBlocks({self.get_block_ids()})"

"""Pinned prefix hits: a queued request holds references on the cached prefix it will hit.

A server that a router chose *because* a prefix is cached there must still have it when
the request is scheduled, after the requests queued before it have allocated. A pin
takes one reference on each block of the request's current hit (reviving free ones out
of the LRU), so no allocation can evict them; the scheduler releases the pin once the
request holds the blocks itself (admission), when it leaves the queue (abort), and,
best effort, whenever the pool runs short: before a running request would be preempted
or the queue's head could not be admitted, the most recent pin goes first (the oldest
waiters, next to run, keep theirs).

Pins change no table, no cached content and no statistic; a pinned block is simply not
free. Example (block 4, one full group, pool of 10): a cached 8-token prefix in free
blocks 3 and 4; ``pin(request of those 8 tokens + 1)`` -> 8 tokens, blocks 3 and 4 held
(free count 9 -> 7); ``unpin`` -> both free again, at the LRU's tail in the order
head-first eviction keeps the prefix longest (tail block first).
"""

from __future__ import annotations

from hybridkv.core.coordinator import KVCacheCoordinator
from hybridkv.core.request import Request

__all__ = ["PrefixPins"]


class PrefixPins:
    """Per request id, the hit it pins: {manager: its leads (stripe leads, null blocks)}."""

    def __init__(self, coordinator: KVCacheCoordinator):
        self.coordinator = coordinator
        self._pins: dict[str, dict] = {}

    def __len__(self) -> int:
        return len(self._pins)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._pins

    def __iter__(self):
        """The pinned requests' ids, oldest pin first."""
        return iter(self._pins)

    def pin(self, request: Request) -> int:
        """Hold the request's current prefix hit (at most ``num_tokens - 1`` tokens, whole
        blocks, valid for every group); the pinned tokens (0: nothing to pin). A request
        pinned already keeps its pin."""
        coord = self.coordinator
        rid = request.request_id
        if rid in self._pins:
            return 0
        hit, num_hit = coord.find_hit(request.block_hashes, request.num_tokens - 1)  # {} without caching
        if not num_hit:
            return 0
        for leads in hit.values():
            coord.pool.touch(leads)
        self._pins[rid] = hit
        return num_hit

    def unpin(self, request_id: str) -> bool:
        """Release the request's pin (False: it had none)."""
        hit = self._pins.pop(request_id, None)
        if hit is None:
            return False
        free = self.coordinator.pool.free_blocks
        for leads in hit.values():
            free(leads[::-1])  # tail-most first: evicted before the prefix's head
        return True

    def unpin_last(self, keep: str | None = None) -> bool:
        """Release the most recent pin other than ``keep``'s (False: none)."""
        for rid in reversed(self._pins):
            if rid != keep:
                return self.unpin(rid)
        return False

    def clear(self) -> None:
        for rid in list(self._pins):
            self.unpin(rid)

    def ref_counts(self) -> dict[int, int]:
        """References the pins hold, per block id (every group's block of a stripe)."""
        out: dict[int, int] = {}
        for hit in self._pins.values():
            for m, leads in hit.items():
                for table in m._per_group(leads):
                    for block in table:
                        if not block.is_null:
                            out[block.block_id] = out.get(block.block_id, 0) + 1
        return out

"""Prefix hits as :class:`~hybridkv.core.kv_cache_manager.KVCacheManager` hands them out and takes them back.

A hit is the longest cached prefix of a request valid for every group, as
{manager: its first group's blocks (stripe leads, null blocks)}; at most
``num_tokens - 1`` tokens, in whole blocks (the last prompt token is always recomputed:
its logits are needed). :func:`find_computed_hit` finds one for a new request and counts
the lookup in :class:`PrefixCacheStats`; with state groups it also sets the request's
``shared_prefix_boundary`` (the junction: see
:meth:`~hybridkv.core.coordinator.KVCacheCoordinator.find_hit_and_junction`).

A hit takes no references until ``allocate_slots`` adopts it, so allocating other
requests in between can evict its blocks. :func:`decode_hit` reads back what a scheduler
passed (:class:`~hybridkv.core.kv_cache_blocks.KVCacheBlocks`) and says whether it can be
*trusted*: found for this very request, by this coordinator, and no cached block lost
its address since (the pool's cache epoch is unchanged) -- then :func:`take_hit`'s
check costs O(1). Otherwise one pass over the hit's blocks compares each one's hash and group
with the request's hash at that position, and a *stale* hit raises StaleHitError
(:meth:`~hybridkv.core.coordinator.KVCacheCoordinator.check_hit`); the caller looks it
up again (it may now be shorter, and its token counts follow it).

:func:`refresh_hit` marks the cached prefix a queued request would hit as just used (its
free blocks move to the LRU's tail), counting nothing: for a request queued behind others
(a server, or a router that sent it here because of this prefix), whose queue's
allocations could otherwise evict the prefix it came for (SGLang's radix cache refreshes a
match's access time on the same occasion). Within each group the hit's tail blocks move
first, so they stay evicted before its head, as when a request frees its blocks. Nothing
here changes a table.
This module does not import ``kv_cache_manager`` (which imports it).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.core.coordinator import KVCacheCoordinator
from hybridkv.core.kv_cache_blocks import KVCacheBlocks
from hybridkv.core.request import Request
from hybridkv.errors import InvalidArgumentError, RequestError

__all__ = ["PrefixCacheStats", "decode_hit", "find_computed_hit", "refresh_hit", "take_hit"]


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache lookups since the last reset, in tokens."""

    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def find_computed_hit(coordinator: KVCacheCoordinator, request: Request, stats: PrefixCacheStats) -> tuple[dict, int]:
    """The hit of a new request and its tokens (0: none), counted in ``stats``."""
    if coordinator.state_managers:
        hit, num_hit, request.shared_prefix_boundary = coordinator.find_hit_and_junction(
            request.block_hashes, request.num_tokens - 1)
    else:
        hit, num_hit = coordinator.find_hit(request.block_hashes, request.num_tokens - 1)
    stats.requests += 1
    stats.queries += request.num_tokens
    stats.hits += num_hit
    return hit, num_hit


def decode_hit(coordinator: KVCacheCoordinator, request: Request,
               new_computed_blocks: KVCacheBlocks | None) -> tuple[dict | None, bool]:
    """(the hit as {manager: first-group blocks} or None, trusted): trusted when it was
    found for this request and no cached block lost its address since (then it needs
    no content check). Not KVCacheBlocks: InvalidArgumentError."""
    if new_computed_blocks is None:
        return None, False
    if not isinstance(new_computed_blocks, KVCacheBlocks):
        raise InvalidArgumentError(
            f"new_computed_blocks must be KVCacheBlocks (from get_computed_blocks), got {new_computed_blocks!r:.60}"
        )
    if new_computed_blocks._hit is not None and new_computed_blocks._coordinator is coordinator:
        trusted = new_computed_blocks._request is request and new_computed_blocks._epoch == coordinator.pool.cache_epoch
        return new_computed_blocks._hit or None, trusted
    return coordinator.hit_of(new_computed_blocks.blocks) or None, False


def take_hit(coordinator: KVCacheCoordinator, request: Request, new_computed_blocks: KVCacheBlocks | None,
             num_new_computed_tokens: int, block_size: int, holds_blocks: bool) -> dict | None:
    """The hit ``allocate_slots`` adopts (None: none), checked before anything changes: only
    for a request holding no blocks (else RequestError), still the request's prefix unless
    trusted (else StaleHitError), and exactly ``num_new_computed_tokens`` long (else
    InvalidArgumentError)."""
    hit, trusted = decode_hit(coordinator, request, new_computed_blocks)
    if hit is None and not num_new_computed_tokens:
        return None
    if holds_blocks:
        raise RequestError(f"request {request.request_id!r} already holds blocks; prefix hits are for new requests")
    hit_blocks = 0
    if hit is not None:
        hit_blocks = len(next(iter(hit.values()))) if trusted else coordinator.check_hit(hit, request.block_hashes)
    if hit_blocks * block_size != num_new_computed_tokens:
        raise InvalidArgumentError(
            f"num_new_computed_tokens {num_new_computed_tokens} != "
            f"{hit_blocks * block_size} tokens of new_computed_blocks"
        )
    return hit


def refresh_hit(coordinator: KVCacheCoordinator, request: Request) -> int:
    """Move the free blocks of the hit ``request`` would find now to the LRU's tail, each
    group's tail blocks first (so they stay evicted before its head); the hit's tokens."""
    hit, num_hit = coordinator.find_hit(request.block_hashes, request.num_tokens - 1)  # {} without caching
    for leads in hit.values():
        coordinator.pool.refresh(leads[::-1])
    return num_hit

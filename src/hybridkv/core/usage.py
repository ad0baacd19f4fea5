"""Pool accounting: the one home of how many blocks are usable, free, cached and held per group.

The scheduler, planner, engine summary and server metrics ask here
(:meth:`KVCacheManager.pool_usage <hybridkv.core.kv_cache_manager.KVCacheManager.pool_usage>`,
:func:`usable_blocks`); nothing outside the core reads the pool's or the managers' state.

* ``usable``: ``num_blocks - 1`` (block 0 is the null block, never holding KV);
* ``free``: free blocks, O(1) (the pool's count); ``cached_free`` the part of them still
  holding a prefix-cache entry (a hit can revive it; evicted when needed), O(1) when the
  free queue keeps uncached blocks apart (the default);
* ``used_per_group``: distinct non-null blocks each group's block tables hold (a block two
  requests share through the prefix cache counts once). One set of block objects per
  manager: the groups of a manager advance in lock-step and hold stripes, so each of its
  groups holds as many blocks as there are distinct leads. The full-attention manager is
  not walked (its tables grow with every request): every held block sits in one manager's
  tables (``width`` blocks per lead) and the pool knows how many are held, so the full
  groups hold what the others leave. Sliding / chunked tables stay within their window /
  chunk: the cost is bounded by ``running * (span / block + 2)``.
* peaks: the most ``used`` per group (and in all) over the calls so far (the engine asks
  once per step).

Worked example (block 4, groups full, sliding(12), sliding(12)): request A, a 20-token
prompt, after its first decode step holds full [99 1 2 3 4 15] and sliding [0 0 9 11 13 17]
(tokens 0-7 are out of token 20's window: the null block 0). Then B, A's first 16 tokens and
4 others, hits 16 tokens: full [99 1 2 3 16], sliding [0 7 9 11 19] (7, freed by A but still
cached, revived). ``used_per_group``: full 7 (99, 1, 2, 3 shared), each sliding group 6.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PoolUsage", "UsagePeaks", "pool_usage", "usable_blocks"]


def usable_blocks(num_blocks: int) -> int:
    """Blocks that can hold KV in a pool of ``num_blocks``: all but the null block (>= 0)."""
    return max(num_blocks - 1, 0)


@dataclass(frozen=True, slots=True)
class PoolUsage:
    """The pool now (see the module docstring); ``used = usable - free``."""

    usable: int
    free: int
    cached_free: int
    used_per_group: tuple[int, ...]
    peak_per_group: tuple[int, ...]
    peak_used: int  # the most blocks the groups' tables held in all (sum over groups), over the calls so far

    @property
    def used(self) -> int:
        return self.usable - self.free


class UsagePeaks:
    """Peaks over the :func:`pool_usage` calls of one manager."""

    __slots__ = ("per_group", "used")

    def __init__(self, num_groups: int) -> None:
        self.per_group = [0] * num_groups
        self.used = 0


def pool_usage(coordinator, peaks: UsagePeaks) -> PoolUsage:
    """The :class:`PoolUsage` of ``coordinator``'s pool and tables now; raises ``peaks``."""
    pool = coordinator.pool
    usable = usable_blocks(pool.num_blocks)
    free = pool.num_free_blocks
    out = [0] * coordinator.num_groups
    null = pool.null_block
    derived = next((m for m in coordinator.managers if m.downward_closed), None)
    rest = usable - free  # held blocks, all groups
    for m in coordinator.managers:
        if m is derived:
            continue
        held = set()
        for st in m.requests.values():  # past its leading null blocks (skipped tokens)
            held.update(st.blocks[st.num_skipped:] if st.num_skipped else st.blocks)
        held.discard(null)
        rest -= len(held) * m.width
        for g in m.group_ids:
            out[g] = len(held)
    if derived is not None:
        for g in derived.group_ids:
            out[g] = rest // derived.width
    fq = pool.free_queue
    if fq.uncached_first:
        cached_free = free - sum(w * len(st) for w, st in fq.stacks.items())
    else:
        cached_free = sum(b.width for b in fq.lru.values() if b.block_hash is not None)
    peaks.per_group = [max(p, n) for p, n in zip(peaks.per_group, out)]
    peaks.used = max(peaks.used, sum(out))
    return PoolUsage(usable, free, cached_free, tuple(out), tuple(peaks.per_group), peaks.used)

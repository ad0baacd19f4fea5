"""The coordinator: one pool, one manager per distinct spec, one answer for all groups.

Groups with identical specs share a manager (they advance in lock-step) and
hold stripes, so a Llama-4-Scout layout (1 full + 3 chunked groups) has two
managers and one block operation per position for the three chunked groups.
With ``stripe_groups=False`` every group gets its own manager (as in vLLM):
same hits, frees and counts, block ids as vLLM hands them out, k times the work.

Prefix-cache hits must be valid for *every* group. Each manager's
``find_longest_cache_hit(max_length)`` returns the longest hit R <= max_length that
is valid for its attention type, and R stays its answer for any max_length in
[R, max_length]. The coordinator starts from L = max_length and calls the managers
(full attention first: its left-to-right scan bounds L cheaply) with the current L,
lowering L to each answer, until a whole pass leaves L unchanged. Full attention is
downward closed, so it is never asked again: its hit is cut to L at the end. The
fixed point is :func:`fixed_point_hit`, the one implementation of the rule: a router
runs it over managers built on a remote index (:meth:`AttentionManager.detached`).

Example (block 1, full + chunked C 2, max_length 5, cached blocks 0-2 only):
full → 3; chunked(3) → chunk of token 3 starts at 2, block 2 hits → 3. L = 3.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Sequence

from hybridkv.core.block_pool import BlockPool, KVCacheBlock
from hybridkv.core.config import KVCacheConfig
from hybridkv.core.hashing import BlockHash
from hybridkv.core.managers import AttentionManager, StateManager, manager_class_for
from hybridkv.core.request import Request
from hybridkv.errors import InvalidArgumentError, InvariantViolation, StaleHitError

__all__ = ["KVCacheCoordinator", "fixed_point_hit", "hit_order"]

PerGroup = tuple[list[KVCacheBlock], ...]

_HASH = attrgetter("block_hash")
_GROUP = attrgetter("group_id")


class KVCacheCoordinator:
    """Routes per-group work to the managers and reconciles prefix hits across them."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        *,
        enable_caching: bool = True,
        use_eagle: bool = False,
        enable_kv_events: bool = False,
        uncached_first: bool = True,
        stripe_groups: bool = True,
        retention_interval: int | None = 0,
    ):
        self.config = kv_cache_config
        self.num_groups = len(kv_cache_config.groups)
        self.block_size = kv_cache_config.block_size
        self.enable_caching = enable_caching
        self.use_eagle = use_eagle
        self.pool = BlockPool(
            kv_cache_config.num_blocks,
            self.num_groups,
            enable_caching=enable_caching,
            enable_kv_events=enable_kv_events,
            group_kinds=[g.spec.kind for g in kv_cache_config.groups],
            group_spans=[g.spec.attention_span for g in kv_cache_config.groups],
            uncached_first=uncached_first,
            block_size=self.block_size,
        )
        by_spec: dict = {}
        for gid, group in enumerate(kv_cache_config.groups):
            by_spec.setdefault(group.spec if stripe_groups else gid, []).append(gid)
        self.managers: list[AttentionManager] = []
        options = {"retention_interval": retention_interval}
        for gids in by_spec.values():
            spec = kv_cache_config.groups[gids[0]].spec
            cls = manager_class_for(spec)
            self.managers.append(cls(spec, gids, self.pool, enable_caching, **{k: options[k] for k in cls.options}))
        #: state groups' managers: per-step bookkeeping (checkpoints cached this step), aligned chunks
        self.state_managers = [m for m in self.managers if isinstance(m, StateManager)]
        # full attention first: cheapest bound on the hit length
        self.find_order = hit_order(self.managers)
        self.skipping_managers = [m for m in self.managers if not m.downward_closed]
        # group id -> (manager, index of the group inside the manager)
        self.group_slot: list[tuple[AttentionManager, int]] = [None] * self.num_groups  # type: ignore[list-item]
        for m in self.managers:
            for j, gid in enumerate(m.group_ids):
                self.group_slot[gid] = (m, j)
        # request id -> (its live id lists by group, the striped managers' states to sync)
        self._ids: dict[str, tuple[tuple[list[int], ...], list]] = {}
        self.striped_managers = [m for m in self.managers if m.width > 1]
        #: the order blocks get their addresses (and KV events): tail_only managers last, so a
        #: run of theirs whose parent sits in their gap follows another group's event storing it
        self.cache_order = sorted(self.managers, key=lambda m: m.tail_only)

    def new_step_starts(self) -> None:
        for m in self.state_managers:
            m.new_step()

    # ------------------------------------------------------------------ hits
    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int) -> tuple[PerGroup, int]:
        """Blocks per group and the hit length (whole blocks) valid for every group."""
        hit, length = self.find_hit(block_hashes, max_length)
        return self.expand(hit), length

    def find_hit(self, block_hashes: Sequence[BlockHash], max_length: int) -> tuple[dict, int]:
        """The hit as {manager: its first group's blocks (stripe leads, nulls)} and its length."""
        hit, length, _ = self._find_hit(block_hashes, max_length, None)
        return hit, length

    def find_hit_and_junction(self, block_hashes: Sequence[BlockHash], max_length: int) -> tuple[dict, int, int]:
        """:meth:`find_hit` and the *junction*: the longest hit one manager found on the way
        (the first asked: full attention when there is one), if longer than the hit; else 0.
        A state group lacking the checkpoint there is what cut the hit: caching one at the
        junction lets the next request sharing that prefix hit all of it (vLLM's
        ``shared_prefix_boundary``)."""
        return self._find_hit(block_hashes, max_length, [])

    def _find_hit(self, block_hashes: Sequence[BlockHash], max_length: int, seen: list[int] | None) -> tuple[dict, int, int]:
        """The hit, its length and, when ``seen`` is a list, the junction (else 0)."""
        if not self.enable_caching or max_length < self.block_size:
            return {}, 0, 0
        found, length = fixed_point_hit(self.find_order, block_hashes, max_length, seen=seen)
        junction = max(seen, default=0) if seen else 0
        junction = junction if junction > length else 0
        if self.use_eagle and length > 0:
            # EAGLE recomputes at least the last hit block; the shorter hit must
            # itself be valid (chunked C 2, block 1: 4 null blocks → 2, not 3).
            found, length = fixed_point_hit(self.find_order, block_hashes, length - self.block_size)
        if length == 0:
            return {}, 0, junction
        nblocks = length // self.block_size
        return {m: leads[:nblocks] if len(leads) > nblocks else leads for m, (leads, _) in found.items()}, length, junction

    def expand(self, hit: dict) -> PerGroup:
        """Per-group block lists of a hit from :meth:`find_hit`."""
        out: list[list[KVCacheBlock]] = [[] for _ in range(self.num_groups)]
        for m, leads in hit.items():
            for gid, blocks in zip(m.group_ids, m._per_group(leads)):
                out[gid] = blocks
        return tuple(out)

    def expand_ids(self, hit: dict) -> tuple[list[int], ...]:
        """Block ids per group of a hit from :meth:`find_hit` (or of new blocks from
        :meth:`allocate_new_blocks`): ``tuple(ids of group) for group in expand(hit)``."""
        out: list[list[int]] = [None] * self.num_groups  # type: ignore[list-item]
        for m, leads in hit.items():
            if not leads:
                for gid in m.group_ids:
                    out[gid] = []
            elif m.width == 1:
                out[m.group_ids[0]] = [b.block_id for b in leads]
            elif len(leads) == 1 and leads[0].stripe is not None:  # one new stripe (a decode step)
                for gid, b in zip(m.group_ids, leads[0].stripe):
                    out[gid] = [b.block_id]
            else:
                for gid, blocks in zip(m.group_ids, m._per_group(leads)):
                    out[gid] = [b.block_id for b in blocks]
        if len(hit) < len(self.managers):
            for gid, ids in enumerate(out):
                if ids is None:
                    out[gid] = []
        return tuple(out)

    def hit_of(self, per_group: PerGroup) -> dict:
        """The inverse of :meth:`expand`: each manager's first group's list.

        For blocks a caller built (not from :meth:`find_hit`): one list per group, of
        this pool's blocks, else InvalidArgumentError. Their content is for
        :meth:`check_hit`.
        """
        if not isinstance(per_group, (tuple, list)):
            raise InvalidArgumentError(f"new_computed_blocks needs one block list per group ({self.num_groups})")
        if not any(per_group):
            return {}
        if len(per_group) != self.num_groups:
            raise InvalidArgumentError(f"new_computed_blocks needs one block list per group ({self.num_groups})")
        blocks = self.pool.blocks
        for group in per_group:
            try:
                if [blocks[b.block_id] for b in group] != list(group):  # identity: KVCacheBlock has no __eq__
                    raise LookupError
            except (AttributeError, TypeError, LookupError):
                raise InvalidArgumentError("new_computed_blocks holds something that is not a block of this pool") from None
        return {m: per_group[m.group_ids[0]] for m in self.managers if per_group[m.group_ids[0]]}

    def check_hit(self, hit: dict, block_hashes: Sequence[BlockHash]) -> int:
        """The hit's length in blocks, after checking that it is still the prefix of
        ``block_hashes`` (O(blocks in the hit), C-speed passes); StaleHitError if not.

        Every manager must have a list of one length; leading null blocks only where
        the manager skips tokens; every other block must still be cached, for the
        manager's first group, under the hash of its position. Example (block 4,
        full + sliding W 5, hit of 8 tokens: [b3, b7] and [null, b9]): b3, b7 and b9
        must hold hashes 0, 1 and 1; had b7 been evicted (hash None) or re-cached for
        other tokens, the hit is stale.
        """
        if len(hit) != len(self.managers):
            raise InvalidArgumentError("new_computed_blocks misses the blocks of some group")
        null = self.pool.null_block
        length = None
        for m, leads in hit.items():
            if length is None:
                length = len(leads)
            elif len(leads) != length:
                raise InvalidArgumentError(f"new_computed_blocks has lists of {length} and {len(leads)} blocks")
            n = leads.count(null)  # null blocks lead a hit
            if n > m.num_skipped_tokens(length * self.block_size) // self.block_size:
                raise InvalidArgumentError(f"new_computed_blocks has null blocks where group {m.group_ids[0]} needs KV")
            real = leads[n:] if n else leads
            gid = m.group_ids[0]
            if list(map(_HASH, real)) != block_hashes[n:length] or list(map(_GROUP, real)).count(gid) != len(real):
                i = next(i for i in range(n, length)
                         if i >= len(block_hashes) or leads[i].block_hash != block_hashes[i] or leads[i].group_id != gid)
                raise StaleHitError(
                    f"prefix hit block {leads[i].block_id} (group {gid}, position {i}) no longer holds the "
                    f"request's cached prefix (evicted or re-cached since the hit was found, or found for other tokens)"
                )
        return length or 0

    # ----------------------------------------------------------- allocation
    def freed_needed_blocks(self, request_id: str, num_computed_tokens: int) -> bool:
        """True when some group already freed a block the next token would read."""
        return any(m.freed_needed_blocks(request_id, num_computed_tokens) for m in self.skipping_managers)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for m in self.skipping_managers:
            m.remove_skipped_blocks(request_id, num_computed_tokens)

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, hit: dict | None, num_computed_tokens: int,
        step_end: int | None = None,
    ) -> int:
        """Blocks needed over all managers; ``hit`` from :meth:`find_hit` for a new request;
        ``step_end``: the step computes tokens ``[num_computed_tokens, step_end)`` (``tail_only``
        managers leave its gap unstored)."""
        total = 0
        for m in self.managers:
            total += m.get_num_blocks_to_allocate(request_id, num_tokens, hit.get(m) if hit else None,
                                                  num_computed_tokens, step_end)
        return total

    def save_new_computed_blocks(self, request_id: str, hit: dict | None, num_computed_tokens: int) -> None:
        for m in self.managers:
            m.save_new_computed_blocks(request_id, hit.get(m) if hit else None, num_computed_tokens)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_computed_tokens: int = 0,
                            step_end: int | None = None) -> dict:
        """Grow every manager's tables; {manager: its new blocks (stripe leads)} (see :meth:`expand`);
        ``num_computed_tokens`` / ``step_end`` as in :meth:`get_num_blocks_to_allocate`."""
        return {m: m.allocate_new_blocks(request_id, num_tokens, num_computed_tokens, step_end) for m in self.managers}

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        if self.enable_caching:
            for m in self.cache_order:
                m.cache_blocks(request, num_tokens)

    def uncache_from(self, request_id: str, first: int) -> int:
        """Every manager's :meth:`~AttentionManager.uncache_from`; blocks that lost their address."""
        return sum(m.uncache_from(request_id, first) for m in self.managers)

    def free(self, request_id: str) -> bool:
        """Free every block of the request, manager by manager in group order (a
        stripe frees with its first group), each tail-most first."""
        found = False
        self._ids.pop(request_id, None)
        free = self.pool.free_blocks
        for m in self.managers:  # built in order of their first group
            blocks = m.pop_blocks(request_id)
            if blocks is not None:
                free(blocks)
                found = True
        return found

    def has_request(self, request_id: str) -> bool:
        return request_id in self.managers[0].requests

    # ------------------------------------------------------------ inspection
    def get_blocks(self, request_id: str) -> PerGroup:
        return tuple(m.get_blocks(request_id)[j] for m, j in self.group_slot)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """Block ids per group: live lists, kept per request (followers' ids synced on demand)."""
        entry = self._ids.get(request_id)
        if entry is None:
            ids = tuple(m.get_block_ids(request_id)[j] for m, j in self.group_slot)
            entry = self._ids[request_id] = (ids, [(m, m.state(request_id)) for m in self.striped_managers])
            return ids
        for m, st in entry[1]:
            if st.synced < len(st.blocks):
                m._sync(st)
        return entry[0]

    def num_requests(self) -> int:
        return len(self.managers[0].requests)

    def check_invariants(self, extra_refs: dict[int, int] | None = None) -> None:
        """Pool consistency plus: every table entry is counted in its block's ref_cnt (with
        ``extra_refs``, references held outside the tables: pins), the managers know the
        same requests, and no block serves two groups."""
        ref_counts: dict[int, int] = dict(extra_refs or {})
        known = None
        for m in self.managers:
            ids = set(m.requests)
            if known is not None and ids != known:
                raise InvariantViolation(f"managers disagree on the live requests: {sorted(known ^ ids)}")
            known = ids
            m.check_invariants(ref_counts)
        owner: dict[int, int] = {}
        for m in self.managers:
            for rid in m.requests:
                for gid, table in zip(m.group_ids, m.get_blocks(rid)):
                    for block in table:
                        if block.is_null:
                            continue
                        if owner.setdefault(block.block_id, gid) != gid:
                            raise InvariantViolation(f"block {block.block_id} is used by groups {owner[block.block_id]} and {gid}")
                        if block.block_hash is not None and block.group_id != gid:
                            raise InvariantViolation(f"block {block.block_id} in group {gid} is cached for group {block.group_id}")
        self.pool.check_invariants(ref_counts)


def hit_order(managers: Sequence[AttentionManager]) -> list[AttentionManager]:
    """The order :func:`fixed_point_hit` asks managers in: downward-closed (full
    attention) first, since its left-to-right scan bounds the length cheapest."""
    return sorted(managers, key=lambda m: not m.downward_closed)


def fixed_point_hit(
    managers: Sequence[AttentionManager],
    block_hashes: Sequence[BlockHash],
    max_length: int,
    hashes_of: dict | None = None,
    seen: list[int] | None = None,
) -> tuple[dict, int]:
    """The longest hit of at most ``max_length`` tokens valid for every manager:
    ({manager: (its longest_hit blocks, its answer)}, length). The one implementation
    of the rule, for the coordinator (over its pool) and for a router (over managers
    made with :meth:`AttentionManager.detached` on a remote index).

    ``managers`` in :func:`hit_order`. Starting from L = ``max_length``, each manager is
    asked for its longest hit <= L and L drops to its answer, until a whole pass leaves
    L unchanged; a downward-closed manager is asked once (its hit is cut to L by the
    caller). ``hashes_of``: {manager: its block hashes} when the managers' block sizes
    differ (default: ``block_hashes`` for all, one block size); then every manager is
    asked again whenever L drops below its answer, so L ends whole blocks of each
    (full block 4 → 4, full block 2 → 2: the block-4 manager is asked at 2 → 0).
    ``seen``: a list the answers are appended to (the junction is its maximum).

    Example (block 1, full + chunked C 2, max_length 5, cached blocks 0-2 only):
    full → 3; chunked(3) → chunk of token 3 starts at 2, block 2 hits → 3. L = 3.
    """
    length = max_length
    found: dict[AttentionManager, tuple[list, int]] = {}
    changed = True
    while changed:
        changed = False
        for m in managers:
            prev = found.get(m)
            if prev is not None and (prev[1] == length or (m.downward_closed and hashes_of is None)):
                continue
            blocks, hit = m.longest_hit(block_hashes if hashes_of is None else hashes_of[m], length)
            found[m] = (blocks, hit)
            if seen is not None:
                seen.append(hit)
            if hit < length:
                length = hit
                changed = True
    return found, length

"""Recurrent state groups (linear attention, SSM layers): a request continues from one state.

A request's table in a state group is indexed by block position like an attention
table, but position ``i`` stands for the state *after* its first ``(i + 1) * B`` tokens
(a checkpoint), not for KV of those tokens. The next token needs only the latest state,
so a request holds at most two real blocks: the one it continues from and the one the
step writes (a decode inside one block position updates it in place); every other
position is the null block.

Allocation (``n`` tokens computed, a step up to ``m`` tokens): positions up to
``cdiv(m, B) - 1`` exist, the last one real (new when the table was shorter), the ones
between null; the engine copies the state of position ``cdiv(n, B) - 1`` (none when
``n == 0``) into the last block and runs the step there. Skipping: every block before
position ``cdiv(n, B) - 1`` is dead: ``num_skipped_tokens(n) = n - 1``.

Caching: a block holds a checkpoint only when a step ends exactly on its boundary
(``m = (i + 1) * B``), so only then is it cached, and only at positions the *retention
interval* keeps (vLLM's ``prefix_cache_retention_interval``): ``None`` every checkpoint;
``0`` (the default, vLLM's) the prompt's last one, at ``(P - 1) // B * B`` (the scheduler
splits a prefill there: :func:`aligned_num_new_tokens`); ``k`` (a multiple of ``B``)
every ``k`` tokens and the prompt's last one. ``0`` and ``k`` also keep the request's
*junction* (``Request.shared_prefix_boundary``: where its hit found full attention going
further than a state checkpoint, e.g. the end of a shared system prompt).

Hits are *not downward closed*: a state can be restored only at a position whose
checkpoint is cached, whatever is cached before it. The search goes right to left and
returns ``[null] * i + [block]`` (hit ``(i + 1) * B``); the coordinator's fixed point
(:func:`~hybridkv.core.coordinator.fixed_point_hit`) asks again at each shorter length.

Worked example (block 4, dense, a 14-token prompt in chunks 8, 4, 2, then decodes; 0 null)::

    step (n -> m)   table           cached
    0 -> 8          [0, 3]          3 (state after 8)
    8 -> 12         [0, 3, 5]       5 (after 12)
    12 -> 14        [0, 0, 5, 7]    - (block 3 freed: only 5 is needed to continue)
    14 -> 15        [0, 0, 0, 7]    - (in place)
    15 -> 16        [0, 0, 0, 7]    7 (after 16)

A request with these 14 tokens and 2 more hits 12 tokens: ``[0, 0, 5]``.
"""

from __future__ import annotations

from typing import Sequence

from hybridkv.core.block_pool import KVCacheBlock
from hybridkv.core.hashing import BlockHash
from hybridkv.core.managers.base import NEVER, AttentionManager, RequestBlocks
from hybridkv.core.request import Request
from hybridkv.core.specs import cdiv
from hybridkv.core.state_spec import StateSpec
from hybridkv.errors import InvalidConfigError, InvariantViolation

__all__ = ["StateManager", "aligned_num_new_tokens", "check_retention_interval", "last_checkpoint"]


def check_retention_interval(interval: object, block_size: int) -> None:
    """None, 0, or a positive multiple of the block size; else InvalidConfigError."""
    if interval is None:
        return
    if type(interval) is not int or interval < 0 or interval % block_size:
        raise InvalidConfigError(
            f"prefix_cache_retention_interval must be None (every block), 0 (the prompt's last block) "
            f"or a positive multiple of the block size {block_size}, got {interval!r}"
        )


def last_checkpoint(num_tokens: int, block_size: int) -> int:
    """The last block boundary before a sequence's final token, where its prefill's last
    checkpoint sits: 14 tokens, block 4 -> 12; 13 -> 12; 12 -> 8."""
    return (num_tokens - 1) // block_size * block_size


def aligned_num_new_tokens(num_computed: int, num_new: int, num_prompt_tokens: int, num_tokens: int,
                           block_size: int, max_num_batched_tokens: int | None = None, junction: int = 0) -> int:
    """How many of ``num_new`` prefill tokens to compute now so that a state group can cache
    its checkpoints (vLLM's aligned split): a chunk that is not the prefill's last ends on
    a block boundary, rounded down even to 0 (the request waits for a step with more
    budget) unless the block is longer than the step budget ``max_num_batched_tokens``
    (None: only when a boundary is reachable; then sub-block chunks run and re-align at
    the next boundary); it never runs past the prompt's last checkpoint
    ``(num_tokens - 1) // B * B`` or the shared-prefix ``junction`` before reaching them,
    and a chunk starting inside a block stops at that block's end. Decodes (nothing left
    to prefill) are untouched.

    Block 4, a 14-token prompt, 8 tokens a step: 0 -> 8, then 8 -> 12 (not 14: 12 is the
    last checkpoint), then 12 -> 14. 6 tokens from 0: 0 -> 4. 3 tokens left in a step of 8
    from 0: 0 (wait). Block 16, a step budget of 8, from 0: 0 -> 8, then 8 -> 16.
    """
    start = num_computed
    prefill_end = max(num_prompt_tokens, num_tokens - 1)
    if start >= prefill_end or num_new <= 0:
        return num_new
    bs = block_size
    end = start + num_new
    if end < prefill_end:
        aligned = end // bs * bs
        if aligned > start or (max_num_batched_tokens is not None and bs <= max_num_batched_tokens):
            end = aligned
    last = last_checkpoint(num_tokens, bs)
    stops = [cdiv(start, bs) * bs if start % bs else 0, last]
    if start < junction < end:
        stops.append(start + (junction - start) // bs * bs)
    end = min((s for s in stops if start < s < end), default=end)
    return max(end - start, 0)


class StateManager(AttentionManager):
    """Block tables of recurrent state groups (see the module docstring)."""

    options = ("retention_interval",)

    def __init__(self, spec: StateSpec, *args, retention_interval: int | None = 0, **kwargs):
        super().__init__(spec, *args, **kwargs)
        check_retention_interval(retention_interval, spec.block_size)
        self.retention_interval = retention_interval
        #: blocks cached in this step: their state is written by this step's model run, so
        #: a new request may not continue from them before the next step (vLLM defers it too)
        self.cached_this_step: set[int] = set()

    # ------------------------------------------------------------ semantics
    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens - 1 if num_computed_tokens > 0 else 0

    def next_skip_at(self, num_skipped_blocks: int) -> int:
        # (n - 1) // B > k  <=>  n >= (k + 1) * B + 1
        return (num_skipped_blocks + 1) * self.block_size + 1

    def longest_hit(self, block_hashes: Sequence[BlockHash], max_length: int) -> tuple[list[KVCacheBlock], int]:
        """The rightmost cached checkpoint at or before ``max_length``: block 4, max_length 14,
        checkpoints cached after 4 and 12 tokens -> ``[null, null, b]``, 12."""
        lookup = self._lookup
        for i in range(min(max_length // self.block_size, len(block_hashes)) - 1, -1, -1):
            block = lookup(block_hashes[i])
            if block is not None:
                return [self.null_block] * i + [block], (i + 1) * self.block_size
        return [], 0

    def retains(self, request: Request, index: int) -> bool:
        """Whether the checkpoint of block position ``index`` (after ``(index + 1) * B`` tokens) is cached."""
        interval = self.retention_interval
        if interval is None:
            return True
        end = (index + 1) * self.block_size
        if end == last_checkpoint(request.num_prompt_tokens, self.block_size):
            return True
        if end == request.shared_prefix_boundary:
            return True
        return interval > 0 and end % interval == 0

    def new_step(self) -> None:
        self.cached_this_step.clear()

    # ------------------------------------------------------------ life cycle
    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: list[KVCacheBlock] | None, num_computed_tokens: int,
                                   step_end: int | None = None) -> int:
        """One new block when the step reaches a new block position, plus a free hit block
        (``step_end`` is the attention managers' ``tail_only`` gap: a state has none).
        A hit on a checkpoint cached in this step cannot be used before the next one: more
        blocks than the pool has (the scheduler tries again next step)."""
        need = cdiv(num_tokens, self.block_size)
        st = self.requests.get(request_id)
        if st is not None:
            return self.width if need > len(st.blocks) else 0
        if not new_computed_blocks:
            return self.width if need > 0 else 0
        last = new_computed_blocks[-1]
        if last.block_id in self.cached_this_step:
            return NEVER
        return ((need > len(new_computed_blocks)) + (last.ref_cnt == 0)) * self.width

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_computed_tokens: int = 0,
                            step_end: int | None = None) -> list[KVCacheBlock]:
        """Null positions up to the step's last, which gets a new block; the positions added
        (nulls, then the block; as vLLM, so an append-only block table stays right), []
        when the step's position exists."""
        st = self.requests.get(request_id)
        if st is None:
            st = self.requests[request_id] = RequestBlocks(self.num_groups)
        n = cdiv(num_tokens, self.block_size) - len(st.blocks)
        if n <= 0:
            return []
        new = self.pool.get_new_stripes(1, self.width) if self.width > 1 else self.pool.get_new_blocks(1)
        if n > 1:
            new = [self.null_block] * (n - 1) + new
            st.ids[0] += [0] * (n - 1)
        st.blocks += new
        st.ids[0].append(new[-1].block_id)
        return new

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Cache the step's block if the step ends on its boundary and the retention keeps it."""
        st = self.requests[request.request_id]
        bs = self.block_size
        num_full = min(num_tokens // bs, len(request.block_hashes))
        if num_full <= st.num_cached:
            return
        st.num_cached = num_full
        i = num_full - 1
        if num_tokens != num_full * bs or i >= len(st.blocks) or st.blocks[i].is_null or not self.retains(request, i):
            return
        block = st.blocks[i]
        if block.block_hash is None:
            self.pool.cache_full_blocks(st.blocks, request.block_hashes, i, i + 1, self.group_ids[0],
                                        request.all_token_ids)
            self.cached_this_step.add(block.block_id)

    def uncache_from(self, request_id: str, first: int) -> int:
        dead = [b.block_id for b in self.state(request_id).blocks[first:]]
        self.cached_this_step.difference_update(dead)
        return super().uncache_from(request_id, first)

    # ------------------------------------------------------------ stripes with null gaps
    def _per_group(self, leads: list[KVCacheBlock]) -> list[list[KVCacheBlock]]:
        if self.width == 1:
            return [leads]
        null = self.null_block
        return [leads] + [[b if b is null else b.stripe[j] for b in leads] for j in range(1, self.width)]

    def _sync(self, st: RequestBlocks) -> None:
        n = len(st.blocks)
        if self.width > 1:
            tail = st.blocks[st.synced:n]
            for j, ids in enumerate(st.ids[1:], 1):
                ids.extend(0 if b.is_null else b.stripe[j].block_id for b in tail)
        st.synced = n

    def _check_table_shape(self, rid: str, st: RequestBlocks) -> None:
        """Nulls before ``num_skipped``; after it at most two real blocks, the last one real."""
        blocks = st.blocks
        if any(not b.is_null for b in blocks[:st.num_skipped]):
            raise InvariantViolation(f"request {rid!r}: a real state block before {st.num_skipped} skipped positions")
        real = [b for b in blocks if not b.is_null]
        if len(real) > 2 or (blocks and blocks[-1].is_null):
            raise InvariantViolation(
                f"request {rid!r}: state table {[b.block_id for b in blocks]} holds {len(real)} real blocks "
                f"(at most 2, the last position real)"
            )

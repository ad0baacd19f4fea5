"""The decode fast path of :meth:`~hybridkv.core.kv_cache_manager.KVCacheManager.allocate_slots`.

Most decode steps need no block: the last one has room, no block fills (so nothing is
cached) and none dies (no sliding window or chunk moves past one). After each allocation
the manager records a :class:`QuietSpan` per request (:func:`quiet_span`): up to which
token count that holds. A later ``allocate_slots`` with plain arguments (no hit, no
lookahead) whose request stays inside its span -- ``min_computed <= num_computed_tokens
< skip_at`` and ``num_computed_tokens + num_new_tokens <= max_tokens`` -- is answered at
once with no new blocks; anything else takes the checked slow path, which records a new
span. Freeing or uncaching a request drops its span.

Example (block 16): a request with 2 blocks, 1 of them cached, 20 tokens computed is
quiet while it needs at most 31 slots (at 32 its second block is full and gets cached)
and fewer tokens than the next chunk start are computed (a chunked group's block dies there).
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

from hybridkv.core.managers.base import NEVER
from hybridkv.core.request import Request

__all__ = ["QuietSpan", "quiet_span"]


class QuietSpan(NamedTuple):
    """How far a request can go with nothing to allocate, cache or skip: the decode fast path."""

    request: Request
    #: the most tokens (computed + new) it can reach with its blocks as they are
    max_tokens: int
    #: the num_computed_tokens at which one of its blocks dies (NEVER: none does)
    skip_at: int
    #: its num_computed_tokens when recorded; a count below it takes the slow path
    min_computed: int


def quiet_span(request: Request, managers: Iterable, block_size: int, max_model_len: int,
               enable_caching: bool) -> QuietSpan:
    """The request's span now, over its tables in every manager (``managers``: the coordinator's)."""
    rid = request.request_id
    bs = block_size
    limit = max_model_len
    skip_at = NEVER
    for m in managers:
        st = m.requests[rid]
        slots = len(st.blocks) * bs
        if slots < limit:
            limit = slots
        if enable_caching and (st.num_cached + 1) * bs - 1 < limit:
            limit = (st.num_cached + 1) * bs - 1
        if st.gap != (0, 0):  # a tail_only step's unstored blocks: the next call must see them
            limit = -1
        at = m.next_skip_at(st.num_skipped)
        if at < skip_at:
            skip_at = at
    # computed counts below today's take the slow path (a count moved back is checked there)
    return QuietSpan(request, limit, skip_at, request.num_computed_tokens)

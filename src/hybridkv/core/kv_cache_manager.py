"""The facade a scheduler talks to: prefix hits, slot allocation, freeing, stats.

Per step, for each request it schedules, a scheduler calls::

    blocks, n = kv.get_computed_blocks(req)            # new requests only
    new = kv.allocate_slots(req, num_new_tokens, n, blocks)
    if new is None: preempt someone, or leave req waiting
    ...run the model..., then req.num_computed_tokens += n + num_new_tokens
    req.append_token_ids(sampled)                     # hashes of full blocks follow

and ``kv.free(req)`` when the request finishes or is preempted. A hit is used at
once: allocating other requests first can evict its blocks, and allocate_slots then
raises StaleHitError (nothing changed; look it up again). Misuse of any call raises a
typed error from :mod:`hybridkv.errors` and changes nothing.

Block layout of one ``allocate_slots`` call (tokens)::

    | computed | new computed (hit) | new      | lookahead |
    |<-- num_computed_tokens ------>|
                                    |<- slots to allocate ->|
    |<------ cached after the call ----------->|

Its parts beside it (none imports this module): :mod:`~hybridkv.core.prefix_hits` (finding,
checking and refreshing hits; the stats), :mod:`~hybridkv.core.quiet_spans` (the decode
fast path), :mod:`~hybridkv.core.request_checks` (misuse checks) and
:mod:`~hybridkv.core.manager_invariants` (``check_invariants``).
"""

from __future__ import annotations

from typing import Iterable, Sequence

from hybridkv.core.config import CacheManagerConfig, KVCacheConfig
from hybridkv.core.coordinator import KVCacheCoordinator
from hybridkv.core.events import KVCacheEvent
from hybridkv.core.hashing import MultiModalFeature
from hybridkv.core.kv_cache_blocks import KVCacheBlocks
from hybridkv.core.manager_invariants import check_manager_invariants
from hybridkv.core.managers.state import aligned_num_new_tokens
from hybridkv.core.prefix_hits import PrefixCacheStats, decode_hit, find_computed_hit, refresh_hit, take_hit
from hybridkv.core.prefix_pins import PrefixPins
from hybridkv.core.quiet_spans import QuietSpan, quiet_span
from hybridkv.core.request import BlockHasher, Request
from hybridkv.core.request_checks import check_count, check_request, request_to_free, unknown_request_id
from hybridkv.core.usage import PoolUsage, UsagePeaks, pool_usage, usable_blocks
from hybridkv.errors import (
    InvalidArgumentError,
    InvalidConfigError,
    PromptTooLongError,
    RequestError,
    UnknownRequestError,
)

# KVCacheBlocks and PrefixCacheStats are named here too: callers take all three from this module
__all__ = ["KVCacheManager", "KVCacheBlocks", "PrefixCacheStats"]


class KVCacheManager:
    """Hybrid paged KV cache: one pool, per-type managers, prefix caching."""

    def __init__(self, kv_cache_config: KVCacheConfig, config: CacheManagerConfig, *, uncached_first: bool = True):
        if not isinstance(kv_cache_config, KVCacheConfig):
            raise InvalidConfigError(f"kv_cache_config must be a KVCacheConfig, got {kv_cache_config!r:.60}")
        if not isinstance(config, CacheManagerConfig):
            raise InvalidConfigError(f"config must be a CacheManagerConfig, got {config!r:.60}")
        if not isinstance(uncached_first, bool):
            raise InvalidConfigError(f"uncached_first must be a bool, got {uncached_first!r}")
        self.kv_cache_config = kv_cache_config
        self.config = config
        self.block_size = kv_cache_config.block_size
        self.max_model_len = config.max_model_len
        self.enable_caching = config.enable_caching
        self.coordinator = KVCacheCoordinator(
            kv_cache_config,
            enable_caching=config.enable_caching,
            use_eagle=config.use_eagle,
            enable_kv_events=config.enable_kv_events,
            uncached_first=uncached_first,
            stripe_groups=config.stripe_groups,
            retention_interval=config.prefix_cache_retention_interval,
        )
        self.pool = self.coordinator.pool
        #: queued requests' pinned prefix hits (a scheduler's ``queued_prefix="pin"``)
        self.pins = PrefixPins(self.coordinator)
        self.hasher = BlockHasher(self.block_size, config.hash_algo) if config.enable_caching else None
        self.stats = PrefixCacheStats()
        self._live: dict[str, Request] = {}
        self._freed: set[str] = set()
        self._empty = KVCacheBlocks(tuple([] for _ in range(self.coordinator.num_groups)))
        self._no_new_blocks = KVCacheBlocks(tuple(() for _ in range(self.coordinator.num_groups)))
        # request id -> its span of the decode fast path
        self._quiet: dict[str, QuietSpan] = {}
        self._peaks = UsagePeaks(self.coordinator.num_groups)  # pool_usage()'s peaks

    # ------------------------------------------------------------- requests
    def make_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        mm_features: Iterable[MultiModalFeature] = (),
        **unknown,
    ) -> Request:
        """A Request whose block hashes match this manager's block size and hash."""
        if unknown:
            raise InvalidArgumentError(f"make_request got unknown keyword(s) {sorted(unknown)}")
        return Request(request_id, prompt_token_ids, hasher=self.hasher, lora_name=lora_name,
                       cache_salt=cache_salt, mm_features=mm_features)

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix of a new request valid for every group.

        The last prompt token is always recomputed (its logits are needed), so at
        most ``num_tokens - 1`` tokens, rounded down to whole blocks, can hit.
        Takes no references: pass the result to :meth:`allocate_slots` before any
        other request is allocated (see there for a hit that went stale meanwhile).
        """
        check_request(request, self.hasher)
        if not self.enable_caching:
            return self._empty, 0
        hit, num_hit = find_computed_hit(self.coordinator, request, self.stats)
        if not num_hit:
            return self._empty, 0
        return KVCacheBlocks(hit=hit, coordinator=self.coordinator, request=request,
                             epoch=self.pool.cache_epoch), num_hit

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Give the request slots for ``num_new_tokens`` (+ lookahead) more tokens.

        Returns the newly allocated blocks per group, or None when the pool cannot
        hold them. On None the request's tables and counts are unchanged; blocks no
        future token attends to may already have been returned to the pool.

        A prefix hit (``new_computed_blocks``, from :meth:`get_computed_blocks`) is
        for a new request. It takes no references until this call, so allocating
        other requests in between can evict its blocks. Such a *stale* hit raises
        StaleHitError with nothing changed; call get_computed_blocks again (the
        hit may now be shorter, and the caller's token counts follow it, which is
        why the manager does not silently re-find it). When the check costs O(1):
        :mod:`hybridkv.core.prefix_hits`.

        Misuse raises a typed error (``hybridkv.errors``), again with nothing
        changed: negative or non-int counts (the request's num_computed_tokens
        too: it must be an int in [0, num_tokens]), a request with too few tokens,
        one beyond max_model_len, a hit for a request that already holds blocks,
        or a new (or freed) request whose num_computed_tokens is not 0.

        Fast path (:mod:`hybridkv.core.quiet_spans`): most decode steps need no block;
        after each call the manager remembers up to which token count that holds, and
        answers such calls at once with no new blocks.
        """
        try:
            quiet = self._quiet.get(request.request_id)
            if (
                quiet is not None
                and quiet.request is request
                and type(num_new_tokens) is int
                and num_new_tokens >= 0
                and new_computed_blocks is None
                and not num_new_computed_tokens
                and not num_lookahead_tokens
            ):
                computed = request.num_computed_tokens
                total = computed + num_new_tokens
                if (
                    total <= quiet.max_tokens
                    and quiet.min_computed <= computed < quiet.skip_at
                    and type(computed) is int
                    and total <= len(request.all_token_ids)
                ):
                    return self._no_new_blocks
        except (AttributeError, TypeError):  # not a Request / a non-number computed count: see below
            pass
        check_count("num_new_tokens", num_new_tokens)
        check_count("num_new_computed_tokens", num_new_computed_tokens)
        check_count("num_lookahead_tokens", num_lookahead_tokens)
        check_request(request, self.hasher)
        computed = request.check_num_computed_tokens()
        rid = request.request_id
        coord = self.coordinator
        live = self._live.get(rid)
        if live is not None and live is not request:
            raise RequestError(f"another request with id {rid!r} holds blocks")
        if live is None:
            if computed:
                raise RequestError(
                    f"request {rid!r} holds no blocks but has num_computed_tokens {computed}; "
                    f"a new (or freed) request starts at 0"
                )
        elif coord.freed_needed_blocks(rid, computed):
            raise InvalidArgumentError(
                f"request {rid!r}: num_computed_tokens {computed} moved back past blocks already freed "
                f"(outside the window / before the chunk); free the request and recompute it"
            )
        hit = take_hit(coord, request, new_computed_blocks, num_new_computed_tokens, self.block_size, live is not None)
        num_computed = computed + num_new_computed_tokens
        num_tokens = num_computed + num_new_tokens
        if num_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"request {rid!r} needs {num_tokens} tokens, more than max_model_len {self.max_model_len}"
            )
        if num_tokens > request.num_tokens:
            raise InvalidArgumentError(
                f"request {rid!r} has {request.num_tokens} tokens; cannot compute up to {num_tokens}"
            )
        num_slots = min(num_tokens + num_lookahead_tokens, self.max_model_len)

        if live is not None and (quiet is None or computed >= quiet.skip_at):
            coord.remove_skipped_blocks(rid, computed)  # a block may have died
        need = coord.get_num_blocks_to_allocate(rid, num_slots, hit, num_computed, num_tokens)
        if need > self.pool.num_free_blocks:
            return None

        if live is None:
            coord.save_new_computed_blocks(rid, hit, num_computed)
            self._live[rid] = request
            self._freed.discard(rid)
        new = coord.allocate_new_blocks(rid, num_slots, num_computed, num_tokens)
        if self.enable_caching:
            coord.cache_blocks(request, min(num_tokens, request.num_tokens))
        self._remember_quiet(request)
        return KVCacheBlocks(hit=new, coordinator=coord)

    def _remember_quiet(self, request: Request) -> None:
        """Record how far the request can go with no allocation, caching or skipping."""
        self._quiet[request.request_id] = quiet_span(request, self.coordinator.managers, self.block_size,
                                                     self.max_model_len, self.enable_caching)

    def free(self, request: Request | str) -> None:
        """Return every block of a finished or preempted request to the pool."""
        rid = request_to_free(request, self._live, self._freed)
        del self._live[rid]
        self._quiet.pop(rid, None)
        self.coordinator.free(rid)
        self._freed.add(rid)
        if len(self._freed) > 100_000:  # only for error messages; keep it bounded
            self._freed.clear()

    def uncache_unwritten(self, request: Request, num_written_tokens: int) -> int:
        """A step over the request failed: its K/V (and states) from token ``num_written_tokens``
        on may never have been written, so the blocks holding any of those tokens lose their
        content address (no later prefix hit reads them; KV events: BlockRemoved). The
        request keeps its blocks; free or recompute it next. Returns the blocks uncached.

        Block 4, a request computed to 6 before the failed step, which cached blocks 1-2
        (tokens 4-11): ``uncache_unwritten(req, 6)`` uncaches positions 6 // 4 = 1 onwards,
        the blocks of tokens 4-11; block 0 (tokens 0-3, written before) stays cached.
        """
        check_request(request, self.hasher)
        rid = request.request_id
        if self._live.get(rid) is not request:
            raise UnknownRequestError(f"request {rid!r} holds no blocks")
        check_count("num_written_tokens", num_written_tokens)
        self._quiet.pop(rid, None)
        return self.coordinator.uncache_from(rid, num_written_tokens // self.block_size)

    def remove_skipped_blocks(self, request: Request) -> None:
        """Free the request's blocks no future token attends to, now (allocate_slots also does)."""
        check_request(request, self.hasher)
        if request.request_id not in self._live:
            raise UnknownRequestError(f"request {request.request_id!r} holds no blocks")
        self.coordinator.remove_skipped_blocks(request.request_id, request.check_num_computed_tokens())

    def num_blocks_to_admit(
        self,
        request: Request,
        num_tokens: int,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_new_computed_tokens: int = 0,
        *,
        max_num_batched_tokens: int | None = None,
    ) -> int:
        """Free blocks a waiting request (holding none) needs for all its ``num_tokens`` beside
        its hit (vLLM's full-prompt admission gate): per manager, blocks for the tokens (at
        most its spec's per-request bound at ``max_num_batched_tokens``), less the hit
        blocks it keeps, plus the hit blocks that are free now (adopting takes them from
        the free queue). Block 4, full + chunked 8, budget 4: the chunked bound is 3
        blocks, so 20 tokens with no hit need 5 + 3 = 8 blocks."""
        check_request(request, self.hasher)
        rid = request.request_id
        if rid in self._live:
            raise InvalidArgumentError(f"request {rid!r} already holds blocks; admission is for waiting requests")
        hit = (decode_hit(self.coordinator, request, new_computed_blocks)[0] if num_new_computed_tokens else None) or {}
        bs = self.block_size
        return sum(
            m.get_num_blocks_to_allocate(
                rid, min(num_tokens, m.spec.max_num_blocks(self.max_model_len, max_num_batched_tokens) * bs),
                hit.get(m), num_new_computed_tokens,
            )
            for m in self.coordinator.managers
        )

    # ------------------------------------------------------------ inspection
    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        if not self.has_request(request_id):
            unknown_request_id(request_id)
        return KVCacheBlocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """Block ids per group (0 = null block). Live lists: copy before keeping them."""
        try:
            live = request_id in self._live
        except TypeError:  # an unhashable id
            live = False
        if not live:
            unknown_request_id(request_id)
        return self.coordinator.get_block_ids(request_id)

    def has_request(self, request_id: str) -> bool:
        try:
            return request_id in self._live
        except TypeError:  # an unhashable id
            raise InvalidArgumentError(f"a request id must be a str, got {request_id!r:.60}") from None

    def pool_usage(self) -> PoolUsage:
        """Usable, free, cached-free and per-group held blocks now, with their peaks so far
        (:mod:`hybridkv.core.usage`: the one home of the pool's accounting)."""
        return pool_usage(self.coordinator, self._peaks)

    @property
    def usable_blocks(self) -> int:
        """Blocks that can hold KV: all but the null block."""
        return usable_blocks(self.pool.num_blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of non-null blocks in use by requests (cached free blocks count as free)."""
        return self.pool.usage

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """The stats since the last call, and start counting anew."""
        stats, self.stats = self.stats, PrefixCacheStats()
        return stats

    def peek_prefix_hit(self, token_ids: Sequence[int]) -> int:
        """Tokens :meth:`get_computed_blocks` would find cached for a new request of
        ``token_ids`` now (whole blocks, at most ``len - 1``), without counting a query.
        For an external oracle (a router's benchmark asks the replica)."""
        if not self.enable_caching or len(token_ids) < 2:
            return 0
        request = self.make_request("peek", token_ids)
        return self.coordinator.find_hit(request.block_hashes, request.num_tokens - 1)[1]

    def new_step_starts(self) -> None:
        """A scheduler step begins (vLLM's hook): state checkpoints cached in the last step
        are written by now, so new requests may continue from them."""
        self.coordinator.new_step_starts()

    def align_num_new_tokens(self, request: Request, num_computed: int, num_new: int,
                             max_num_batched_tokens: int | None = None) -> int:
        """How many of ``num_new`` tokens a prefill step should compute from ``num_computed``
        so that state groups can cache their checkpoints (chunks end on block boundaries,
        the prompt's last checkpoint and the request's shared-prefix junction:
        :func:`~hybridkv.core.managers.state.aligned_num_new_tokens`); ``num_new`` without
        state groups or prefix caching. A scheduler asks it for every chunk, with its
        step budget; 0 means: not this step (the request waits, as in vLLM)."""
        if not self.coordinator.state_managers or not self.enable_caching:
            return num_new
        return aligned_num_new_tokens(num_computed, num_new, request.num_prompt_tokens, request.num_tokens,
                                      self.block_size, max_num_batched_tokens, request.shared_prefix_boundary)

    def refresh_prefix_hit(self, request: Request) -> int:
        """Mark the cached prefix ``request`` would hit now as just used: its free blocks move
        to the LRU's tail (:meth:`BlockPool.refresh`), so that the requests scheduled before
        it evict other cached blocks first. Takes no reference and counts no query; the
        hit is found again, as usual, when the request is scheduled. Returns the hit's
        tokens (whole blocks, at most ``num_tokens - 1``). Meant for a request queued behind
        others; why, and in which order the blocks move: :mod:`hybridkv.core.prefix_hits`.
        """
        check_request(request, self.hasher)
        return refresh_hit(self.coordinator, request)

    def take_events(self) -> list[KVCacheEvent]:
        """KV events since the last call (only when built with enable_kv_events)."""
        return self.pool.take_events()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while requests hold blocks."""
        return self.pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Raise InvariantViolation if the pool, the tables or the live set are inconsistent
        (:mod:`hybridkv.core.manager_invariants`)."""
        check_manager_invariants(self.coordinator, self._live, self.pins)

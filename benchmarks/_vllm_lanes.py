"""The vLLM lane and the side-by-side pair lane the vLLM comparisons share (vs_vllm.py,
vs_vllm_huge.py, _vllm_state.py): vLLM's KV cache manager driven like ours, and both
driven in lockstep with every decision compared (``Mismatch`` on the first difference)."""

from __future__ import annotations

import functools

from _traces import HybridLane, TraceSpec, group_specs

SLICE = 10  # steps of one manager before the other's turn (the order flips every slice)


# ----------------------------------------------------------------------- vLLM lane
class VllmLane:
    """vLLM 0.33's v1 KVCacheManager driven the way its scheduler drives it."""

    def __init__(self, plain_lru: bool = False, name: str | None = None, sched: bool = False, junction: bool = True):
        self.plain_lru = plain_lru
        self.junction = junction  # state traces: False drops the shared-prefix junction (an experiment)
        self.sched = sched  # used as vLLM's scheduler uses it (see _traces.py's docstring)
        self.name = name or ("vllm(lru)" if plain_lru else "vllm") + ("+sched" if sched else "")
        self.mgr = None

    def build(self, tr: TraceSpec) -> None:
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import (
            ChunkedLocalAttentionSpec,
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            MambaSpec,
            SlidingWindowSpec,
        )
        from vllm.v1.request import Request

        def state(**kw):  # align mode: what vLLM runs whenever prefix caching is on
            return MambaSpec(dtypes=(torch.bfloat16,) * len(kw["shapes"]), mamba_cache_mode="align", **kw)

        specs = group_specs(tr, FullAttentionSpec, ChunkedLocalAttentionSpec, SlidingWindowSpec, torch.bfloat16, state)
        groups = [KVCacheGroupSpec([f"layers.{i}"], spec) for i, spec in enumerate(specs)]
        cfg = KVCacheConfig(num_blocks=tr.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups,
                            prefix_cache_retention_interval=tr.retention)
        hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(tr.block_size, hash_fn)
        self._Request = Request
        self._params = SamplingParams(max_tokens=1 << 30)
        self.mgr = mgr = KVCacheManager(
            cfg,
            max_model_len=tr.max_model_len,
            scheduler_block_size=tr.block_size,
            hash_block_size=tr.block_size,
            enable_caching=True,
            log_stats=True,
        )
        if self.plain_lru:
            _patch_plain_lru(mgr.block_pool)
        self.lookup = mgr.get_computed_blocks
        self.alloc = mgr.allocate_slots
        self.free = mgr.free
        self.new_step = mgr.new_step_starts
        if tr.align is not None and any(g.kind == "state" for g in tr.groups):
            self._scheduler_rules(tr)
        if self.sched:
            from vllm.v1.core.kv_cache_manager import KVCacheBlocks

            self.hash_request = Request.update_block_hashes  # what Request.__init__ calls
            # the scheduler: new_blocks.get_block_ids(allow_none=True) for running requests
            # (CachedRequestData), get_blocks(id).get_block_ids() for new ones (NewRequestData)
            self.new_ids = functools.partial(KVCacheBlocks.get_block_ids, allow_none=True)
            self.table_ids = mgr.get_block_ids

    def _scheduler_rules(self, tr: TraceSpec) -> None:
        """State traces: what vLLM's scheduler does around the manager in "align" mode. It
        stores ``get_computed_blocks``' third value (the junction) in
        ``request.shared_prefix_boundary`` (the manager keeps the checkpoint there) and clips
        every chunk with its own ``Scheduler._mamba_block_aligned_split`` (block boundaries,
        the step budget, the prompt's last checkpoint, the junction)."""
        from _vllm_state import vllm_scheduler_split

        split = vllm_scheduler_split(tr, junction=self.junction)
        self.align = lambda req, num_prompt, num_tokens, start, n: split(req, n, start - req.num_computed_tokens)
        if self.junction:
            get = self.mgr.get_computed_blocks

            def lookup(req):
                out = get(req)
                req.shared_prefix_boundary = out[2]
                return out

            self.lookup = lookup

    def make_request(self, rid: str, tokens: list[int]):
        r = self._Request(request_id=rid, prompt_token_ids=list(tokens), sampling_params=self._params,
                          pooling_params=None, block_hasher=None if self.sched else self._hasher)
        if self.sched:  # hashed by the driver, timed (hash_request)
            r._block_hasher = self._hasher
        return r, r.append_output_token_ids

    def num_free_blocks(self) -> int:
        return self.mgr.block_pool.get_num_free_blocks()

    def block_ids(self, rid: str) -> list[list[int]]:
        return [[b.block_id for b in g] for g in self.mgr.coordinator.get_blocks(rid)]

    def num_cached_blocks(self) -> int:
        return sum(1 for b in self.mgr.block_pool.blocks if b.block_hash is not None)

    def table_tails(self, rid: str) -> list[tuple[int, int]]:
        return [(len(g), g[-1].block_id if g else -1) for g in self.mgr.coordinator.get_blocks(rid)]

    def close(self, running) -> None:
        pass


def patch_vllm_chunked_retry() -> None:
    """Experiment only (--vllm-chunked-fix): give vLLM's chunked-local finder hybridkv's
    F1 rule (retry shorter while the hit ends before the chunk start of max_length).
    With it the F1 disagreements of the fuzz vanish, which shows they are vLLM's."""
    from vllm.v1.core.single_type_kv_cache_manager import ChunkedLocalAttentionManager as V

    orig = V.find_longest_cache_hit.__func__

    def find(cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec, **kw):
        chunk = kv_cache_spec.attention_chunk_size
        while True:
            blocks, hit = orig(cls, block_hashes=block_hashes, max_length=max_length,
                               kv_cache_group_ids=kv_cache_group_ids, block_pool=block_pool,
                               kv_cache_spec=kv_cache_spec, **kw)
            if hit >= max_length // chunk * chunk or hit == max_length:
                return blocks, hit
            max_length = hit

    V.find_longest_cache_hit = classmethod(find)


def _patch_plain_lru(pool) -> None:
    """vLLM's free queue as plain LRU: every freed block goes to the tail, in order."""

    def free_blocks(ordered_blocks):
        out = []
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                out.append(block)
        pool.free_block_queue.append_n(out)

    pool.free_blocks = free_blocks


# ----------------------------------------------------------------- semantics check
class Mismatch(Exception):
    pass


class PairReq:
    __slots__ = ("a", "b", "rid")

    def __init__(self, a, b, rid):
        self.a, self.b, self.rid = a, b, rid

    @property
    def num_computed_tokens(self):
        return self.a.num_computed_tokens

    @num_computed_tokens.setter
    def num_computed_tokens(self, v):
        self.a.num_computed_tokens = v
        self.b.num_computed_tokens = v


class PairLane:
    """hybridkv (a) and vLLM (b) in lock-step; every call's outcome is compared.

    ``exact``: block ids must be equal; otherwise equal up to a relabelling.
    ``full_every``: every that many steps all live tables, free and cached counts
    are compared (tables of the request just allocated are compared at every call).
    """

    def __init__(self, a: HybridLane, b: VllmLane, exact: bool, full_every: int = 1, per_call_tables: bool = True,
                 deep_every: int = 1, compare_cached: bool = True):
        self.A, self.B = a, b
        self.exact = exact
        self.compare_cached = compare_cached
        self.full_every = full_every
        self.per_call_tables = per_call_tables
        self.deep_every = deep_every  # checkpoints between cached-count + check_invariants passes (O(pool))
        self.name = f"check({a.name} vs {b.name})"
        self.live: dict[str, PairReq] = {}
        self.calls = 0
        self.checkpoints = 0
        self.step = 0
        self.hits_a = 0
        self.hits_b = 0
        self.last_op = ""

    def build(self, tr):
        self.A.build(tr)
        self.B.build(tr)
        self.num_groups = len(tr.groups)

    def make_request(self, rid, tokens):
        ra, app_a = self.A.make_request(rid, tokens)
        rb, app_b = self.B.make_request(rid, tokens)
        pair = PairReq(ra, rb, rid)

        def append(tok):
            app_a(tok)
            app_b(tok)

        return pair, append

    # -- helpers
    def _fail(self, what: str):
        raise Mismatch(f"step {self.step}, {self.last_op}: {what}")

    def _cmp_tables(self, rid: str, ta: list[list[int]], tb: list[list[int]], full: bool, relabel=None):
        if len(ta) != len(tb):
            self._fail(f"{rid}: {len(ta)} vs {len(tb)} groups")
        for g, (xa, xb) in enumerate(zip(ta, tb)):
            if len(xa) != len(xb):
                self._fail(f"{rid} group {g}: table length {len(xa)} (hybridkv) vs {len(xb)} (vllm)")
            if self.exact:
                if (xa if full else xa[-1:]) != (xb if full else xb[-1:]):
                    self._fail(f"{rid} group {g}: block ids differ\n  hybridkv {_short(xa)}\n  vllm     {_short(xb)}")
            elif full:
                for i, (ia, ib) in enumerate(zip(xa, xb)):
                    if (ia == 0) != (ib == 0):
                        self._fail(f"{rid} group {g} block {i}: null in one only ({ia} vs {ib})")
                    if relabel is not None and ia:
                        fwd, back = relabel
                        if fwd.setdefault(ia, ib) != ib or back.setdefault(ib, ia) != ia:
                            self._fail(f"{rid} group {g} block {i}: ids {ia}/{ib} break the relabelling")

    def _cmp_free(self):
        fa, fb = self.A.num_free_blocks(), self.B.num_free_blocks()
        if fa != fb:
            self._fail(f"free blocks {fa} (hybridkv) vs {fb} (vllm)")

    # -- lane interface
    def new_step(self):
        self.A.new_step()
        self.B.new_step()

    def hook(self, step: int):
        self.step = step
        if step % self.full_every == 0:
            self.full_check()

    def full_check(self, final: bool = False):
        self.last_op = "end" if final else "checkpoint"
        self._cmp_free()
        relabel = None if self.exact else ({}, {})
        for rid in self.live:
            self._cmp_tables(rid, self.A.block_ids(rid), self.B.block_ids(rid), True, relabel)
        if final or self.checkpoints % self.deep_every == 0:
            ca, cb = self.A.num_cached_blocks(), self.B.num_cached_blocks()
            if ca != cb and self.compare_cached:
                self._fail(f"cached blocks {ca} (hybridkv) vs {cb} (vllm)")
            self.A.kv.check_invariants()
        self.checkpoints += 1

    def lookup(self, pair):
        self.last_op = f"get_computed_blocks({pair.rid})"
        ra = self.A.lookup(pair.a)
        rb = self.B.lookup(pair.b)
        self.calls += 1
        self.hits_a += ra[1]
        self.hits_b += rb[1]
        if ra[1] != rb[1]:
            self._fail(f"hit tokens {ra[1]} (hybridkv) vs {rb[1]} (vllm)")
        ia = ra[0].get_block_ids()
        ib = rb[0].get_block_ids()
        ib = tuple(list(x) for x in ib) if ib else tuple([] for _ in range(self.num_groups))
        self._cmp_tables(pair.rid, list(ia), list(ib), True)
        return (ra[0], rb[0]), ra[1]

    def alloc(self, pair, n, hit=0, blocks=None):
        self.last_op = f"allocate_slots({pair.rid}, n={n}, hit={hit})"
        ba, bb = blocks if blocks is not None else (None, None)
        out_a = self.A.alloc(pair.a, n, hit, ba)
        out_b = self.B.alloc(pair.b, n, hit, bb)
        self.calls += 1
        if (out_a is None) != (out_b is None):
            self._fail(f"allocation {'failed' if out_a is None else 'succeeded'} in hybridkv, "
                       f"{'failed' if out_b is None else 'succeeded'} in vllm")
        self._cmp_free()
        if out_a is not None:
            self.live[pair.rid] = pair
            na = [len(g) for g in out_a.blocks]
            nb = [len(g) for g in out_b.blocks] if out_b.blocks else [0] * self.num_groups
            if na != nb:
                self._fail(f"new blocks per group {na} (hybridkv) vs {nb} (vllm)")
            if self.exact and out_a.get_block_ids() != tuple(out_b.get_block_ids()):
                self._fail(f"new block ids {out_a.get_block_ids()} vs {out_b.get_block_ids()}")
            if self.per_call_tables and self.full_every == 1:
                self._cmp_tables(pair.rid, self.A.block_ids(pair.rid), self.B.block_ids(pair.rid), True)
            elif self.per_call_tables:  # cheap: table lengths (and, exact, the last block id) per group
                ta, tb = _tails(self.A.kv.get_block_ids(pair.rid)), self.B.table_tails(pair.rid)
                if [t[0] for t in ta] != [t[0] for t in tb] or (self.exact and ta != tb):
                    self._fail(f"{pair.rid}: (table length, last block id) per group {ta} (hybridkv) vs {tb} (vllm)")
        return out_a

    def free(self, pair):
        self.last_op = f"free({pair.rid})"
        self.A.free(pair.a)
        self.B.free(pair.b)
        self.calls += 1
        self.live.pop(pair.rid, None)
        self._cmp_free()

    def close(self, running):
        self.full_check(final=True)


def _tails(groups) -> list[tuple[int, int]]:
    return [(len(g), g[-1] if g else -1) for g in groups]


def _short(ids, n=24):
    return ids if len(ids) <= n else ids[:n // 2] + ["..."] + ids[-n // 2:]

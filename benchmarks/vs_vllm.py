"""hybridkv's KVCacheManager side by side with vLLM 0.33.0's v1 KVCacheManager.

One process, both managers, the same seeded traces (``_traces.py``), played side
by side: 10 scheduling steps of one, then 10 of the other (A B B A A B ...; the
order flips every slice and every round) so load on this shared machine cancels.
Prints, per trace, µs per scheduling step for each manager, the ratio
hybridkv / vLLM (median over rounds) and the prefix-cache hit tokens of each
(they must be equal: same semantics), in two lanes side by side: *plain* (the
manager calls) and *sched* (the managers used as vLLM's scheduler uses them:
prompt hashing of arriving requests timed, the new block ids of each running
request and the whole table of each admitted one read; see ``_traces.py``). Then a step-by-step semantics check
(untimed) of every trace in both free-queue modes, and optionally a randomised
differential fuzz on tiny configs.

Set-up (benchmark-only environment; never a dependency of hybridkv, never in CI)::

    python3 -m venv .venv-vllm
    .venv-vllm/bin/pip install torch==2.13.0
    .venv-vllm/bin/pip install --no-deps -r ../shared/bench/vllm-anchor-requirements.txt

Run (from the repository root)::

    PYTHONPATH=src .venv-vllm/bin/python benchmarks/vs_vllm.py            # ~2-3 min
    PYTHONPATH=src .venv-vllm/bin/python benchmarks/vs_vllm.py --quick    # ~20-40 s
    PYTHONPATH=src .venv-vllm/bin/python benchmarks/vs_vllm.py --check-only --fuzz 300
    PYTHONPATH=src .venv-vllm/bin/python benchmarks/vs_vllm.py --state [--quick]  # state groups (~2 min)

``--state``: the Qwen3-Next traces of ``_state_trace.py`` (1 full + 3 Gated DeltaNet state
groups, MambaSpec "align" mode in vLLM) at retention 0 and None, each side with its own
scheduler rules (chunk alignment with the step budget, the shared-prefix junction), timed like
the others, then checked step by step (``_vllm_state.py``: also junctions, every chunk and the
cached positions per group) at blocks 544 and 16, and the junction's effect on hits measured
apart.

Semantics check modes:

* ``exact``: vLLM with its free queue patched to plain LRU (every freed block
  appended at the tail) against hybridkv with ``uncached_first=False`` (plain
  LRU). Same calls, same order: block ids must be identical at every step.
* ``native``: vLLM 0.33 as shipped against hybridkv's default free queue, with
  one manager per group (``stripe_groups=False``, as vLLM has). vLLM 0.33's
  ``BlockPool.free_blocks`` already prepends freed *uncached* blocks
  (``prepend_n``) and appends cached ones, i.e. it is uncached-first too, only the
  order among the prepended uncached blocks differs (vLLM keeps each call's order,
  hybridkv reverses it). Uncached free blocks are interchangeable, so the two
  states must be equal up to a relabelling of block ids: hit tokens, free
  counts, table lengths and null positions must match, and the id map between
  the two must be a bijection at every checkpoint.
* ``striped``: hybridkv's defaults (groups of one spec hold stripes) against
  vLLM as shipped: the same checks except the cached-block count. A stripe is
  evicted whole (its other members could never hit without it) and a request's
  stripes are freed position by position, where vLLM frees group by group; so
  under memory pressure hybridkv keeps fewer useless cached blocks, and it may
  keep more hits (a disagreement on hit tokens then shows which side hit more).

vLLM features that would change hits are left at their plain-v1 defaults:
``watermark=0``, ``full_sequence_must_fit=False``, no EAGLE, no KV connector,
``prefix_cache_retention_interval=None`` (dense: SWA ``reachable_block_mask``
returns None, every full block is cached), ``num_in_flight_tokens=0`` (no async
scheduling), hash ``sha256`` for both (vLLM: pickle + sha256; hybridkv: int64
bytes + sha256).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _vllm_env import import_vllm, use_repo_src  # noqa: E402

use_repo_src()


def _import_vllm():
    import_vllm("vs_vllm.py", "vllm.v1.core.kv_cache_manager", " [--quick]")


from _traces import (  # noqa: E402
    TRACES,
    Driver,
    HybridLane,
    NullLane,
    TraceSpec,
    group_specs,
    make_fuzz_trace,
    make_trace,
    median,
    run_interleaved,
)

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


MODES = ("exact", "native", "striped")


def run_check(tr: TraceSpec, mode: str, full_every: int, per_call_tables: bool = True, deep_every: int = 1) -> dict:
    exact = mode == "exact"
    a = HybridLane(uncached_first=not exact, stripe_groups=mode == "striped")
    b = VllmLane(plain_lru=exact)
    pair = PairLane(a, b, exact=exact, full_every=full_every, per_call_tables=per_call_tables, deep_every=deep_every,
                    compare_cached=mode != "striped")
    d = Driver(tr, pair, hook=pair.hook)
    t = time.perf_counter()
    out = {"trace": tr.name, "mode": mode, "ok": True, "error": ""}
    try:
        res = d.run()
        out.update(steps=res.steps, preemptions=res.preemptions, admitted=res.admitted, finished=res.finished)
    except Mismatch as exc:
        out.update(ok=False, error=str(exc))
    except Exception as exc:  # an invariant or assertion inside one of the managers
        import traceback

        where = traceback.extract_tb(exc.__traceback__)[-1]
        out.update(ok=False, error=f"step {pair.step}, {pair.last_op}: {type(exc).__name__}: {exc} "
                                   f"(at {os.path.basename(where.filename)}:{where.lineno})")
    out.update(calls=pair.calls, checkpoints=pair.checkpoints, hits_a=pair.hits_a, hits_b=pair.hits_b,
               seconds=time.perf_counter() - t)
    return out


# --------------------------------------------------------------------------- timing
def timed_run(tr: TraceSpec, lane):
    d = Driver(tr, lane, freeze_gc=True)
    t = time.perf_counter()
    res = d.run()
    res.wall_s = time.perf_counter() - t
    return res


LANES = ("hybridkv", "vllm", "hybridkv+sched", "vllm+sched")


def make_lane(key: str):
    sched = key.endswith("+sched")
    return HybridLane(sched=sched) if key.startswith("hybridkv") else VllmLane(sched=sched)


def _make_trace(name: str, quick: bool):
    if name.startswith("q"):
        from _state_trace import make_state_trace

        return make_state_trace(name, quick=quick)
    return make_trace(name, quick=quick)


def bench(traces, quick: bool, rounds: int, lanes=LANES):
    """Per trace and round: every lane in ``lanes`` plays the trace side by side (run_interleaved),
    the lane order reversed every other round. Ratios are per round (hybridkv / vLLM of one kind)."""
    rows = []
    kinds = [k for k in ("", "+sched") if f"hybridkv{k}" in lanes and f"vllm{k}" in lanes]
    for name in traces:
        t_trace = time.perf_counter()
        tr = _make_trace(name, quick=quick)
        per = {k: [] for k in lanes}
        per_rs = {k: [] for k in lanes}
        hash_us = {k: [] for k in lanes}
        ratios = {k: [] for k in kinds}
        ratios_x = []
        hits = {k: set() for k in lanes}
        extra = {}
        null = timed_run(tr, NullLane())
        null_ns = sum(null.step_ns) / max(1, null.req_steps)
        for r in range(rounds):
            order = list(lanes) if r % 2 == 0 else list(lanes)[::-1]
            res = {o.lane: o for o in run_interleaved([(tr, make_lane(k)) for k in order], SLICE)}
            for key, o in res.items():
                per[key].append(o.us_per_step)
                hash_us[key].append(o.hash_ns / max(1, len(o.step_ns)) / 1e3)
                per_rs[key].append(o.us_per_req_step)
                hits[key].add((o.hit_tokens, o.timed_hit_tokens))
            for k in kinds:
                ratios[k].append(res[f"hybridkv{k}"].us_per_step / res[f"vllm{k}"].us_per_step)
            h, v = res[f"hybridkv{kinds[0]}"], res[f"vllm{kinds[0]}"]
            if "" in kinds:
                drv = null_ns * h.req_steps / max(1, len(h.step_ns)) / 1e3
                ratios_x.append((h.us_per_step - drv) / (v.us_per_step - drv))
            extra = dict(steps=len(h.step_ns), req_steps=h.req_steps, preempt=(h.preemptions, v.preemptions),
                         lookups=(h.lookups, v.lookups), query=h.query_tokens,
                         build_us=(h.build_ns / 1e3 / max(1, h.admitted + h.preemptions),
                                   v.build_ns / 1e3 / max(1, v.admitted + v.preemptions)),
                         init_s=(h.init_ns / 1e9, v.init_ns / 1e9))
            print(f"  [{name}] round {r + 1}/{rounds}: " + "  ".join(
                f"{k} {res[k].us_per_step:8.1f}" for k in lanes) + " us/step  ratio "
                + "  ".join(f"{k or 'plain'} {ratios[k][-1]:.3f}" for k in kinds), flush=True)
        print(f"  [{name}] {time.perf_counter() - t_trace:.0f} s", flush=True)
        rows.append(dict(trace=name, desc=tr.description, shape=tr.shape, per=per, per_rs=per_rs, ratios=ratios,
                         hash_us={k: median(v) for k, v in hash_us.items()},
                         ratios_x=ratios_x, hits=hits, null_us=null_ns / 1e3, kinds=kinds, **extra))
    return rows


TARGET = {"a": 0.5, "b": 0.5, "c": 0.7, "d": 0.7}


def _range(xs) -> str:
    return f"{min(xs):.2f}-{max(xs):.2f}" if xs else "-"


def print_bench(rows, rounds):
    print()
    print(f"Timing (median of {rounds} rounds; in each round the lanes play the trace side by side, "
          f"{SLICE} steps each in turn, the order flipping every slice and every round; µs per scheduling step)")
    print("  plain: manager calls (+ num_computed / append bookkeeping; appended tokens hashed) as before;")
    print("  sched: as vLLM's scheduler uses the manager: also prompt hashing of arriving requests, new block ids "
          "read for running requests, the whole table for admitted ones")
    hdr = (f"{'trace':5} {'layout':34} {'steps':>5} {'req/step':>8} "
           f"{'plain: hybridkv':>15} {'vLLM':>7} {'ratio':>6} {'(range)':>11} {'ex-drv':>6} "
           f"{'sched: hybridkv':>15} {'vLLM':>7} {'ratio':>6} {'(range)':>11} {'target':>6} "
           f"{'hit tokens (both)':>17} {'equal':>5}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        allhits = {k: sorted(v) for k, v in r["hits"].items()}
        first = next(iter(allhits.values()))
        eq = all(v == first for v in allhits.values()) and len(first) == 1
        cells = []
        for k in ("", "+sched"):
            if k in r["kinds"]:
                cells.append(f"{median(r['per']['hybridkv' + k]):>15.1f} {median(r['per']['vllm' + k]):>7.0f} "
                             f"{median(r['ratios'][k]):>6.3f} {_range(r['ratios'][k]):>11}")
            else:
                cells.append(f"{'-':>15} {'-':>7} {'-':>6} {'-':>11}")
            if k == "":
                cells[-1] += f" {median(r['ratios_x']) if r['ratios_x'] else float('nan'):>6.3f}"
        print(f"{r['trace']:5} {r['shape']:34} {r['steps']:>5} {r['req_steps'] / r['steps']:>8.1f} "
              f"{cells[0]} {cells[1]} {TARGET.get(r['trace'], '-'):>6} {first[0][0]:>17} {'yes' if eq else 'NO':>5}")
    print()
    print("ratio = hybridkv / vLLM per round, median (range over rounds); ex-drv = the plain ratio with the "
          "driver's own cost (null lane) subtracted from both.")
    for r in rows:
        print(f"  {r['trace']}: {r['desc']}; rounds: " + "; ".join(
            f"{k or 'plain'} " + ", ".join(f"{x:.3f}" for x in r["ratios"][k]) for k in r["kinds"])
              + f"; us/req-step " + ", ".join(f"{k} {median(v):.2f}" for k, v in r["per_rs"].items())
              + (f"; sched prompt hashing us/step hybridkv {r['hash_us']['hybridkv+sched']:.1f}, "
                 f"vllm {r['hash_us']['vllm+sched']:.1f}" if "+sched" in r["kinds"] else "")
              + f"; driver {r['null_us']:.2f} us/req; preemptions {r['preempt']}; lookups {r['lookups']}; "
              f"request build (untimed in plain) {r['build_us'][0]:.0f} / {r['build_us'][1]:.0f} us; "
              f"init {r['init_s'][0]:.2f} / {r['init_s'][1]:.2f} s")


def print_checks(checks):
    print()
    print("Semantics check (untimed, step by step: hit tokens and blocks per lookup, allocation success, free count "
          "after every call, table lengths per call, every table + cached-block count at checkpoints)")
    hdr = f"{'trace':6} {'mode':7} {'calls':>8} {'checkpts':>8} {'hits hybridkv':>13} {'hits vLLM':>10} {'result':<}"
    print(hdr)
    print("-" * 80)
    for c in checks:
        res = "agree" if c["ok"] else "DISAGREE: " + c["error"]
        print(f"{c['trace']:6} {c['mode']:7} {c['calls']:>8} {c['checkpoints']:>8} {c['hits_a']:>13} "
              f"{c['hits_b']:>10} {res}")


def known_difference(tr: TraceSpec, mode: str = "native") -> str:
    """The documented difference a tiny config can run into ('' if none); see RESULTS.md."""
    tags = []
    if mode == "striped" and len(set(tr.groups)) < len(tr.groups):
        tags.append("S1 stripes under pressure")
    if any(g.kind == "chunked" and g.param % tr.block_size for g in tr.groups):
        tags.append("F1 chunk % block != 0")
    if any(g.kind == "sliding" and g.param == 1 for g in tr.groups):
        tags.append("F2 window 1")
    return " + ".join(tags)


def fuzz(n: int, seed0: int, verbose: bool):
    """Differential fuzz: every seed in both modes; disagreements grouped by known cause."""
    fails = []
    t = time.perf_counter()
    calls = 0
    by_kind: dict[str, int] = {}
    for s in range(seed0, seed0 + n):
        for mode in MODES:
            tr = make_fuzz_trace(s, contiguous=mode == "exact")
            kind = known_difference(tr, mode) or "none"
            by_kind[kind] = by_kind.get(kind, 0) + 1
            c = run_check(tr, mode, full_every=1)
            calls += c["calls"]
            if not c["ok"]:
                fails.append((s, c["mode"], tr, c["error"], kind))
                if verbose:
                    print(f"  seed {s} {c['mode']}: {tr.description}\n    {c['error']}")
    print(f"\nFuzz: seeds {seed0}..{seed0 + n - 1} x {len(MODES)} modes, {calls} compared calls, {len(fails)} disagreements "
          f"({time.perf_counter() - t:.0f} s)")
    for kind in sorted(by_kind):
        k_fails = [f for f in fails if f[4] == kind]
        print(f"  configs with {kind:45}: {len(k_fails):4} disagreements in {by_kind[kind]} runs")
        shown = k_fails if kind == "none" else k_fails[:3]
        for f in shown:
            print(f"    seed {f[0]} {f[1]}: {f[2].description}\n      {f[3].splitlines()[0]}")
    return fails


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short traces, 2 rounds (~30 s)")
    ap.add_argument("--traces", default="abcd", help="subset of a, b, c, d")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per trace (default 3, --quick 2)")
    ap.add_argument("--lanes", default="both", choices=["both", "plain", "sched"],
                    help="plain: manager calls only; sched: as vLLM's scheduler uses it (default both, side by side)")
    ap.add_argument("--no-check", action="store_true", help="skip the semantics check")
    ap.add_argument("--check-only", action="store_true", help="only the semantics check (and --fuzz)")
    ap.add_argument("--fuzz", type=int, default=0, metavar="N", help="also fuzz N random tiny configs")
    ap.add_argument("--fuzz-seed", type=int, default=0)
    ap.add_argument("--vllm-chunked-fix", action="store_true",
                    help="experiment: patch vLLM's chunked-local hit search with the F1 retry rule")
    ap.add_argument("--state", action="store_true",
                    help="the state-group traces (Qwen3-Next: q0, qn timed; q0, qn, q0s, qns checked) instead")
    ap.add_argument("--vllm-deferral-fix", action="store_true",
                    help="experiment: patch vLLM's MambaManager to defer hits by block, not by hash")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    _import_vllm()
    import vllm

    if args.vllm_chunked_fix:
        patch_vllm_chunked_retry()
        print("NOTE: vLLM's ChunkedLocalAttentionManager.find_longest_cache_hit patched with the F1 retry rule")
    print(f"vLLM {vllm.__version__} imported in {time.perf_counter() - t0:.1f} s; python {sys.version.split()[0]}; "
          f"hybridkv from {os.path.dirname(__import__('hybridkv').__file__)}")
    rounds = args.rounds or (2 if args.quick else 3)
    if args.state:
        return state_main(args, rounds, t0)
    traces = [t for t in args.traces if t in TRACES]
    rows = []
    if not args.check_only:
        lanes = {"both": LANES, "plain": LANES[:2], "sched": LANES[2:]}[args.lanes]
        rows = bench(traces, args.quick, rounds, lanes)
        print_bench(rows, rounds)
    checks = []
    if not args.no_check:
        print("\nsemantics check ...", flush=True)
        for name in traces:
            tr = make_trace(name, quick=True)
            if args.quick:  # same streams and layouts, fewer running requests and steps
                tr.max_running = min(tr.max_running, 32)
                tr.num_blocks = max(tr.num_blocks // 4, 20_000)
                tr.warmup_steps, tr.num_steps = 0, 150
            for mode in MODES:
                c = run_check(tr, mode, full_every=10 if name in "ac" else 5, per_call_tables=True,
                              deep_every=8 if name == "a" else 2)
                checks.append(c)
                print(f"  [{name}] {c['mode']}: {'agree' if c['ok'] else 'DISAGREE'} ({c['seconds']:.0f} s)", flush=True)
        print_checks(checks)
    fails = []
    if args.fuzz:
        fails = fuzz(args.fuzz, args.fuzz_seed, args.verbose)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    return 0


def state_main(args, rounds: int, t0: float) -> int:
    from _state_trace import make_state_trace
    from _vllm_state import junction_experiment, patch_vllm_deferral_by_block, print_state_checks, run_state_check

    if args.vllm_deferral_fix:
        patch_vllm_deferral_by_block()
        print("NOTE: vLLM's MambaManager patched to defer same-step hits by block (hybridkv's rule)")
    if not args.check_only:
        lanes = {"both": LANES, "plain": LANES[:2], "sched": LANES[2:]}[args.lanes]
        rows = bench(["q0", "qn"], args.quick, rounds, lanes)
        print_bench(rows, rounds)
    if args.no_check:
        return 0
    print("\nstate semantics check ...", flush=True)
    checks = []
    for name in ("q0", "qn", "q0s", "qns"):
        for mode in MODES:
            c = run_state_check(make_state_trace(name, quick=args.quick), mode)
            checks.append(c)
            ok = "agree" if c["ok"] else "DISAGREE"
            print(f"  [{name}] {mode}: {ok} ({c['seconds']:.0f} s)", flush=True)
    print_state_checks(checks)
    print("\nThe junction's effect (retention 0), each manager alone, with its junction (as both schedulers run) "
          "and without:")
    for name in ("q0", "q0s"):
        for key, r in junction_experiment(make_state_trace(name, quick=args.quick)).items():
            print(f"  {name:3} {key:22} hit tokens {r['hit']:>8} of {r['query']:>8} "
                  f"({r['hit'] / max(1, r['query']):.3f}); admitted {r['admitted']}, finished {r['finished']}, "
                  f"preempted {r['preempt']}, cached blocks {r['cached']}", flush=True)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""State groups beside vLLM (``vs_vllm.py --state``): the Qwen3-Next trace (``_state_trace.py``)
played on hybridkv and on vLLM 0.33's KVCacheManager (MambaSpec, "align" mode) in lock-step.

On top of ``vs_vllm.PairLane``'s checks (hit tokens and null positions of every hit,
allocation success or failure, free blocks after every call, table lengths and null
positions, the id relabelling, cached-block counts) this checks at every call and
checkpoint which table positions hold a *cached* (hashed) block, and, for every prefill
chunk, four alignment rules: the driver's (``_state_trace.vllm_align``), vLLM's own
``Scheduler._mamba_block_aligned_split`` (called on a stand-in scheduler), ours
(``KVCacheManager.align_num_new_tokens``) and the notes' ``align_split``. The driver
follows vLLM's; disagreements of the others are counted, not fatal (the managers then
still see the same calls). Admissions refused because the hit's state was cached in the
same step (vLLM's deferral) are counted too.

``junction``: vLLM's scheduler also sets ``request.shared_prefix_boundary`` from
``get_computed_blocks``' third value (full attention hit further than the state groups:
a Marconi-style junction), stops the chunk there and, at retention 0, caches the state
there. hybridkv has no junction; :func:`junction_experiment` plays the trace on each
manager alone, vLLM with its junction, and compares hit tokens.
"""

from __future__ import annotations

import os
import time
import traceback
from types import SimpleNamespace

from _state_trace import notes_align_split
from _traces import Driver, HybridLane, TraceSpec
from vs_vllm import Mismatch, PairLane, VllmLane

__all__ = ["StatePairLane", "run_state_check", "junction_experiment", "vllm_scheduler_split",
           "patch_vllm_deferral_by_block"]


def patch_vllm_deferral_by_block() -> None:
    """Experiment only (``--vllm-deferral-fix``): vLLM's MambaManager defers a hit whose last
    block's *hash* was cached in this step; patched, only one whose *block* was (hybridkv's
    rule, tests/core/test_state_deferral_by_block.py). With it the qns disagreements vanish."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager as M

    get_num, cache, new_step = M.get_num_blocks_to_allocate, M.cache_blocks, M.new_step_starts

    def ids(self) -> set:
        return self.__dict__.setdefault("_ids_this_step", set())

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks, *a, **kw):
        last = new_computed_blocks[-1] if len(new_computed_blocks) else None
        h = last.block_hash if last is not None else None
        if h is not None and h in self.cached_blocks_this_step and last.block_id not in ids(self):
            self.cached_blocks_this_step.discard(h)
            try:
                return get_num(self, request_id, num_tokens, new_computed_blocks, *a, **kw)
            finally:
                self.cached_blocks_this_step.add(h)
        return get_num(self, request_id, num_tokens, new_computed_blocks, *a, **kw)

    def cache_blocks(self, request, num_tokens, *a, **kw):
        before = self.num_cached_block.get(request.request_id, 0)
        cache(self, request, num_tokens, *a, **kw)
        blocks = self.req_to_blocks[request.request_id]
        for b in blocks[before:self.num_cached_block.get(request.request_id, 0)]:
            if not b.is_null and b.block_hash is not None:
                ids(self).add(b.block_id)

    def new_step_starts(self):
        new_step(self)
        ids(self).clear()

    M.get_num_blocks_to_allocate = get_num_blocks_to_allocate
    M.cache_blocks = cache_blocks
    M.new_step_starts = new_step_starts


def vllm_scheduler_split(tr: TraceSpec, junction: bool = False):
    """vLLM's ``Scheduler._mamba_block_aligned_split`` bound to a stand-in with this trace's
    settings: ``split(request, n, num_new_local_computed_tokens)``."""
    from vllm.v1.core.sched.scheduler import Scheduler

    bs = tr.block_size
    fake = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=bs), block_size=bs, hash_block_size=bs,
        mamba_partial_cache_hit=False, use_eagle_block_drop=False, num_hash_lookahead_tokens=0,
        mamba_has_prefill_checkpoint_blocks=False, mamba_prefill_checkpoint_alignment=None,
        max_num_scheduled_tokens=tr.token_budget,
        scheduler_config=SimpleNamespace(long_prefill_token_threshold=0),
        mamba_shared_prefix_checkpoint=False,
    )
    fn = Scheduler._mamba_block_aligned_split

    def split(request, n, hit=0):
        if not junction:
            request.shared_prefix_boundary = 0
        return fn(fake, request, n, hit)

    return split


def _hashed_ours(kv, rid: str) -> list[list[bool]]:
    coord = kv.coordinator
    per = coord.get_blocks(rid)
    out = []
    for g, (m, j) in enumerate(coord.group_slot):
        lead = per[m.group_ids[0]]  # a stripe's hash is on its lead
        out.append([b.block_hash is not None for b in lead])
    return out


def _hashed_vllm(mgr, rid: str) -> list[list[bool]]:
    return [[b.block_hash is not None for b in g] for g in mgr.coordinator.get_blocks(rid)]


class StatePairLane(PairLane):
    """PairLane + hashed positions + the four alignment rules (see the module docstring)."""

    def __init__(self, a, b, exact, **kw):
        super().__init__(a, b, exact, **kw)
        self.align_disagree: dict[str, int] = {"vllm scheduler": 0, "hybridkv": 0, "notes": 0}
        self.align_examples: dict[str, str] = {}
        self.aligned_chunks = 0
        self.deferrals = 0
        self.null_padding_calls = 0  # allocations whose new blocks differ only by vLLM's null padding
        self.null_padding_example = ""

    def build(self, tr):
        super().build(tr)
        self.tr = tr
        self.rule = tr.align
        self.split = vllm_scheduler_split(tr)

    def align(self, pair, num_prompt, num_tokens, start, n):
        got = self.rule(pair, num_prompt, num_tokens, start, n)
        if start >= max(num_prompt, num_tokens - 1):
            return got
        self.aligned_chunks += 1
        bs = self.tr.block_size
        others = {
            "vllm scheduler": self.split(pair.b, n, start - pair.b.num_computed_tokens),
            "hybridkv": self.A.kv.align_num_new_tokens(pair.a, start, n),
            "notes": notes_align_split(num_prompt, num_tokens, start, n, bs),
        }
        for k, v in others.items():
            if v != got:
                self.align_disagree[k] += 1
                self.align_examples.setdefault(
                    k, f"{pair.rid}: prompt {num_prompt}, tokens {num_tokens}, computed {start}, n {n} "
                       f"(block {bs}): driver/vLLM rule {got}, {k} {v}")
        return got

    def _cmp_hashed(self, rid: str):
        ha, hb = _hashed_ours(self.A.kv, rid), _hashed_vllm(self.B.mgr, rid)
        if ha != hb:
            for g, (xa, xb) in enumerate(zip(ha, hb)):
                if xa != xb:
                    pa = [i for i, x in enumerate(xa) if x]
                    pb = [i for i, x in enumerate(xb) if x]
                    self._fail(f"{rid} group {g}: cached positions {pa[-12:]} (hybridkv) vs {pb[-12:]} (vllm)")

    def full_check(self, final: bool = False):
        super().full_check(final)
        for rid in self.live:
            self._cmp_hashed(rid)

    def alloc(self, pair, n, hit=0, blocks=None):
        """PairLane.alloc's checks, except that vLLM's new blocks of a state group include the
        null positions it appends (its worker's block table is append-only) where ours hold
        only the real block: the real (non-null) new blocks are compared, the rest counted."""
        self.last_op = f"allocate_slots({pair.rid}, n={n}, hit={hit})"
        ba, bb = blocks if blocks is not None else (None, None)
        out_a = self.A.alloc(pair.a, n, hit, ba)
        out_b = self.B.alloc(pair.b, n, hit, bb)
        self.calls += 1
        if (out_a is None) != (out_b is None):
            self._fail(f"allocation {'failed' if out_a is None else 'succeeded'} in hybridkv, "
                       f"{'failed' if out_b is None else 'succeeded'} in vllm")
        self._cmp_free()
        if out_a is None:
            if hit and ba is not None:
                last = ba.blocks[1][-1] if ba.blocks[1] else None
                if last is not None and any(last.block_id in m.cached_this_step
                                            for m in self.A.kv.coordinator.state_managers):
                    self.deferrals += 1
            return None
        self.live[pair.rid] = pair
        ga = [list(g) for g in out_a.blocks]
        gb = [list(g) for g in out_b.blocks] if out_b.blocks else [[] for _ in range(self.num_groups)]
        ra = [sum(not b.is_null for b in g) for g in ga]
        rb = [sum(not b.is_null for b in g) for g in gb]
        if ra != rb:
            self._fail(f"real new blocks per group {ra} (hybridkv) vs {rb} (vllm)")
        if [len(g) for g in ga] != [len(g) for g in gb]:
            self.null_padding_calls += 1
            self.null_padding_example = self.null_padding_example or (
                f"{self.last_op}: new block ids hybridkv {out_a.get_block_ids()} vs vllm {out_b.get_block_ids()}")
        if self.exact and [[b.block_id for b in g if not b.is_null] for g in ga] != \
                [[b.block_id for b in g if not b.is_null] for g in gb]:
            self._fail(f"new block ids {out_a.get_block_ids()} vs {out_b.get_block_ids()}")
        self._cmp_tables(pair.rid, self.A.block_ids(pair.rid), self.B.block_ids(pair.rid), True)
        self._cmp_hashed(pair.rid)
        return out_a


def run_state_check(tr: TraceSpec, mode: str, full_every: int = 1) -> dict:
    """One lock-step run (mode as in vs_vllm: exact / native / striped)."""
    exact = mode == "exact"
    a = HybridLane(uncached_first=not exact, stripe_groups=mode == "striped")
    b = VllmLane(plain_lru=exact)
    pair = StatePairLane(a, b, exact=exact, full_every=full_every, compare_cached=mode != "striped")
    t = time.perf_counter()
    out = {"trace": tr.name, "mode": mode, "ok": True, "error": ""}
    try:
        res = Driver(tr, pair, hook=pair.hook).run()
        out.update(steps=res.steps, preemptions=res.preemptions, admitted=res.admitted, finished=res.finished,
                   fail_admit=res.alloc_fail_admit)
    except Mismatch as exc:
        out.update(ok=False, error=str(exc))
    except Exception as exc:  # an invariant or assertion inside one of the managers
        where = traceback.extract_tb(exc.__traceback__)[-1]
        out.update(ok=False, error=f"step {pair.step}, {pair.last_op}: {type(exc).__name__}: {exc} "
                                   f"(at {os.path.basename(where.filename)}:{where.lineno})")
    out.update(calls=pair.calls, checkpoints=pair.checkpoints, hits_a=pair.hits_a, hits_b=pair.hits_b,
               chunks=pair.aligned_chunks, align=dict(pair.align_disagree), examples=dict(pair.align_examples),
               deferrals=pair.deferrals, null_padding=(pair.null_padding_calls, pair.null_padding_example),
               seconds=time.perf_counter() - t,
               cached=(a.num_cached_blocks(), b.num_cached_blocks()) if a.kv and b.mgr else None)
    return out


class JunctionVllmLane(VllmLane):
    """vLLM as its scheduler really drives it: the junction from get_computed_blocks is set
    on the request, and chunks are clipped by vLLM's own split (which stops there)."""

    def build(self, tr):
        super().build(tr)
        self.junctions = 0
        lookup = self.mgr.get_computed_blocks

        def lookup_j(req):
            blocks, hit, boundary = lookup(req)
            req.shared_prefix_boundary = boundary
            self.junctions += boundary > 0
            return blocks, hit, boundary

        self.lookup = lookup_j
        split = vllm_scheduler_split(tr, junction=True)
        self.align = lambda req, p, t, start, n: split(req, n, start - req.num_computed_tokens)


def junction_experiment(tr: TraceSpec) -> dict:
    """Hit tokens of hybridkv (driver rule) and of vLLM with and without its junction, each alone."""
    out = {}
    for key, lane in (("hybridkv", HybridLane()), ("vllm", VllmLane()), ("vllm+junction", JunctionVllmLane())):
        res = Driver(tr, lane).run()
        out[key] = dict(hit=res.hit_tokens, query=res.query_tokens, admitted=res.admitted, finished=res.finished,
                        preempt=res.preemptions, cached=lane.num_cached_blocks(),
                        junctions=getattr(lane, "junctions", 0))
    return out


def print_state_checks(checks) -> None:
    print("\nState groups semantics check (step by step: every call's hit tokens, null positions, allocation "
          "outcome, free count; tables, cached positions per group, cached count at checkpoints)")
    hdr = (f"{'trace':5} {'mode':7} {'calls':>7} {'chunks':>6} {'hits hybridkv':>13} {'hits vLLM':>10} "
           f"{'cached (h/v)':>12} {'defer':>5} {'preempt':>7}  result")
    print(hdr)
    print("-" * len(hdr))
    for c in checks:
        res = "agree" if c["ok"] else "DISAGREE: " + c["error"]
        cached = f"{c['cached'][0]}/{c['cached'][1]}" if c.get("cached") else "-"
        print(f"{c['trace']:5} {c['mode']:7} {c['calls']:>7} {c['chunks']:>6} {c['hits_a']:>13} {c['hits_b']:>10} "
              f"{cached:>12} {c['deferrals']:>5} {c.get('preemptions', '-'):>7}  {res}")
    print("alignment rules vs the driver's (vLLM 0.33's plain-path split), prefill chunks that disagree:")
    for c in checks:
        print(f"  {c['trace']} {c['mode']}: " + ", ".join(f"{k} {v}/{c['chunks']}" for k, v in c["align"].items()))
        for k, ex in c["examples"].items():
            print(f"      e.g. {ex}")
    print("allocations whose new blocks differ only by the null positions vLLM's state groups return "
          "(hybridkv returns the real block only; tables agree):")
    for c in checks:
        n, ex = c["null_padding"]
        print(f"  {c['trace']} {c['mode']}: {n} calls" + (f"; first: {ex}" if ex else ""))

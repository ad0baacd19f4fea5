"""State groups beside vLLM (``vs_vllm.py --state``): the Qwen3-Next trace (``_state_trace.py``)
played on hybridkv and on vLLM 0.33's KVCacheManager (MambaSpec, "align" mode) in lock-step.

Each side runs with its own scheduler rules: vLLM's lane stores ``get_computed_blocks``'
third value in ``request.shared_prefix_boundary`` (the junction) and clips chunks with its
``Scheduler._mamba_block_aligned_split`` (called on a stand-in scheduler with the trace's
step budget); ours sets the junction in ``get_computed_blocks`` and clips with
``KVCacheManager.align_num_new_tokens(..., max_num_batched_tokens)``. On top of
``vs_vllm.PairLane``'s checks (hit tokens and null positions of every hit, allocation
success or failure, the new blocks of every allocation, free blocks after every call, table
lengths and null positions, the id relabelling, cached-block counts) this checks at every
lookup that both found the same junction, at every prefill chunk that both rules cut it the
same (else the run stops: the managers would see different calls), and at every call and
checkpoint which table positions hold a *cached* (hashed) block. Chunks where
``_state_trace.vllm_align`` (our transcription of vLLM's rule) differs from vLLM's own are
counted, and so are admissions refused because the hit's state was cached in the same step
(the deferral).

:func:`junction_experiment` plays the trace on each manager alone, with and without its
junction, and compares hit tokens.
"""

from __future__ import annotations

import os
import time
import traceback
from types import SimpleNamespace

from _state_trace import vllm_align
from _traces import Driver, HybridLane, TraceSpec
from _vllm_lanes import Mismatch, PairLane, VllmLane

__all__ = ["StatePairLane", "run_state_check", "junction_experiment", "vllm_scheduler_split", "print_state_checks",
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
    settings (``max_num_scheduled_tokens`` = the step budget): ``split(request, n,
    num_new_local_computed_tokens)``. ``junction=False``: the request's junction is cleared
    first (an experiment: vLLM without it)."""
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
    """PairLane + junctions, both sides' chunk rules and hashed positions (see the module docstring)."""

    def __init__(self, a, b, exact, **kw):
        super().__init__(a, b, exact, **kw)
        self.transcription_disagree = 0  # chunks where _state_trace.vllm_align != vLLM's own split
        self.transcription_example = ""
        self.aligned_chunks = 0
        self.waits = 0  # chunks both rules cut to 0 (the request waits for a step with more budget)
        self.junction_stops = 0  # chunks both cut at the junction
        self.junctions = 0  # lookups with a junction
        self.deferrals = 0

    def build(self, tr):
        super().build(tr)
        self.tr = tr

    def lookup(self, pair):
        out = super().lookup(pair)
        ja, jb = pair.a.shared_prefix_boundary, pair.b.shared_prefix_boundary
        if ja != jb:
            self._fail(f"junction {ja} (hybridkv) vs {jb} (vllm)")
        self.junctions += ja > 0
        return out

    def align(self, pair, num_prompt, num_tokens, start, n):
        got = self.A.align(pair.a, num_prompt, num_tokens, start, n)
        if start >= max(num_prompt, num_tokens - 1):
            return got
        self.last_op = f"align({pair.rid}, prompt {num_prompt}, tokens {num_tokens}, computed {start}, n {n})"
        self.aligned_chunks += 1
        v = self.B.align(pair.b, num_prompt, num_tokens, start, n)
        if v != got:
            self._fail(f"chunk {got} (hybridkv) vs {v} (vllm); junction {pair.a.shared_prefix_boundary}, "
                       f"block {self.tr.block_size}, budget {self.tr.token_budget}")
        bs = self.tr.block_size
        t = vllm_align(pair.b, num_prompt, num_tokens, start, n, bs=bs, max_prefill=self.tr.token_budget)
        if t != v:
            self.transcription_disagree += 1
            self.transcription_example = self.transcription_example or f"{self.last_op}: vLLM {v}, transcription {t}"
        self.waits += got == 0
        j = pair.a.shared_prefix_boundary
        if start < j and 0 < got < n and got == (j - start) // bs * bs:
            self.junction_stops += 1
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
        """PairLane.alloc's checks (new blocks per group, null positions included, as both
        return them), the cached positions of the request, and deferrals counted."""
        out_a = super().alloc(pair, n, hit, blocks)
        if out_a is None:
            ba = blocks[0] if blocks is not None else None
            if hit and ba is not None:
                last = ba.blocks[1][-1] if ba.blocks[1] else None
                if last is not None and any(last.block_id in m.cached_this_step
                                            for m in self.A.kv.coordinator.state_managers):
                    self.deferrals += 1
            return None
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
               chunks=pair.aligned_chunks, waits=pair.waits, junctions=pair.junctions,
               junction_stops=pair.junction_stops, deferrals=pair.deferrals,
               transcription=(pair.transcription_disagree, pair.transcription_example),
               seconds=time.perf_counter() - t,
               cached=(a.num_cached_blocks(), b.num_cached_blocks()) if a.kv and b.mgr else None)
    return out


def junction_experiment(tr: TraceSpec) -> dict:
    """Each manager alone on the trace, with its junction (as both schedulers run) and without
    (``request.shared_prefix_boundary`` kept at 0): hit tokens, admissions, cached blocks."""
    out = {}
    lanes = (("hybridkv", HybridLane()), ("vllm", VllmLane()),
             ("hybridkv, no junction", HybridLane(junction=False)), ("vllm, no junction", VllmLane(junction=False)))
    for key, lane in lanes:
        res = Driver(tr, lane).run()
        out[key] = dict(hit=res.hit_tokens, query=res.query_tokens, admitted=res.admitted, finished=res.finished,
                        preempt=res.preemptions, cached=lane.num_cached_blocks())
    return out


def print_state_checks(checks) -> None:
    print("\nState groups semantics check (step by step, each side with its own scheduler rules: every call's "
          "hit tokens, null positions, junction, allocation outcome and new blocks, free count; every prefill "
          "chunk; tables, cached positions per group, cached count at checkpoints)")
    hdr = (f"{'trace':5} {'mode':7} {'calls':>7} {'chunks':>6} {'waits':>5} {'junct':>5} {'j-stop':>6} "
           f"{'hits hybridkv':>13} {'hits vLLM':>10} {'cached (h/v)':>12} {'defer':>5} {'preempt':>7}  result")
    print(hdr)
    print("-" * len(hdr))
    for c in checks:
        res = "agree" if c["ok"] else "DISAGREE: " + c["error"]
        cached = f"{c['cached'][0]}/{c['cached'][1]}" if c.get("cached") else "-"
        print(f"{c['trace']:5} {c['mode']:7} {c['calls']:>7} {c['chunks']:>6} {c['waits']:>5} {c['junctions']:>5} "
              f"{c['junction_stops']:>6} {c['hits_a']:>13} {c['hits_b']:>10} {cached:>12} {c['deferrals']:>5} "
              f"{c.get('preemptions', '-'):>7}  {res}")
    print("chunks: prefill chunks cut by both rules (equal, else the run stops); waits: cut to 0; junct: lookups "
          "with a junction (equal on both sides); j-stop: chunks ended at the junction")
    bad = [c for c in checks if c["transcription"][0]]
    print("_state_trace.vllm_align vs vLLM's own split: " + ("equal on every chunk" if not bad else "; ".join(
        f"{c['trace']} {c['mode']}: {c['transcription'][0]} chunks, e.g. {c['transcription'][1]}" for c in bad)))

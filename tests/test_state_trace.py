"""The state-group trace of ``benchmarks/vs_vllm.py --state`` (``benchmarks/_state_trace.py``),
played on hybridkv only (no vLLM): our own scheduler rules (``align_num_new_tokens`` with the
step budget, the shared-prefix junction ``get_computed_blocks`` sets), new_step_starts and
deferred admissions on the Qwen3-Next layout, and our rule against the transcription of vLLM's."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.support.tiers import examples, slow_except


from _state_trace import (
    GDN_SHAPES,
    make_state_trace,
    ours_align,
    qwen3next_groups,
    vllm_align,
)
from _traces import Driver, HybridLane

from hybridkv.core.managers.state import StateManager


class AlignCheckingLane(HybridLane):
    """hybridkv with its own rules; records every lookup's hit and junction, every prefill
    chunk the driver schedules (after our align) and every chunk our align cut to 0."""

    def build(self, tr):
        super().build(tr)
        self.tr = tr
        self.chunks: list[tuple[int, int, int, int, int]] = []  # (prompt, tokens, start, n, junction)
        self.lookups: list[tuple[int, int, int]] = []  # (tokens, hit, junction)
        self.asked: list[tuple[int, int, int, int]] = []  # (start, n asked, n given, junction)
        alloc, lookup, align = self.alloc, self.lookup, self.align

        def looked(req):
            out = lookup(req)
            self.lookups.append((req.num_tokens, out[1], req.shared_prefix_boundary))
            return out

        def aligned(req, num_prompt, num_tokens, start, n):
            got = align(req, num_prompt, num_tokens, start, n)
            if start < max(num_prompt, num_tokens - 1):
                self.asked.append((start, n, got, req.shared_prefix_boundary))
            return got

        def checked(req, n, hit=0, blocks=None):
            start = req.num_computed_tokens + hit
            if start < max(req.num_prompt_tokens, req.num_tokens - 1):
                self.chunks.append((req.num_prompt_tokens, req.num_tokens, start, n, req.shared_prefix_boundary))
            return alloc(req, n, hit, blocks)

        self.alloc, self.lookup, self.align = checked, looked, aligned


def _play(name, **kw):
    tr = make_state_trace(name, quick=True)
    lane = AlignCheckingLane(**kw)
    res = Driver(tr, lane).run()
    lane.kv.check_invariants()
    return tr, lane, res


@pytest.mark.parametrize("name", ["q0s", "qns"])
def test_trace_runs_on_hybridkv_with_aligned_chunks(name):
    tr, lane, res = _play(name)
    kv = lane.kv
    assert [type(m) for m in kv.coordinator.state_managers] == [StateManager]  # 3 groups, one striped manager
    assert kv.coordinator.state_managers[0].retention_interval == tr.retention
    assert kv.coordinator.state_managers[0].width == 3
    assert res.finished > 100 and res.hit_tokens > 0 and res.lookups > res.admitted  # refused admissions retried
    bs = tr.block_size
    assert bs <= tr.token_budget
    for prompt, tokens, start, n, junction in lane.chunks:
        end = start + n
        last = (tokens - 1) // bs * bs
        assert n > 0
        # a chunk ends on a boundary or at the prefill's end (the block fits the step budget:
        # a chunk that cannot reach a boundary waits instead)
        assert end % bs == 0 or end >= max(prompt, tokens - 1)
        assert not start < last < end  # never past the prompt's last checkpoint
        assert not start < junction < end or junction % bs  # never past the junction (a block boundary)
    # chunks too short for a boundary were cut to 0 (the request waited), and only those
    waits = [(start, n) for start, n, got, _ in lane.asked if got == 0]
    assert waits and all((start + n) // bs * bs <= start for start, n in waits)


@pytest.mark.parametrize("name", slow_except(["q0s", "qns"], 0))
def test_junctions_on_the_trace(name):
    """Lookups whose full-attention hit went further than every state checkpoint found the
    junction there: a block boundary past the hit, within the tokens asked; chunks stop at it
    and its checkpoint is cached, so later lookups hit past it."""
    tr, lane, res = _play(name)
    bs = tr.block_size
    found = [(tokens, hit, j) for tokens, hit, j in lane.lookups if j]
    assert len(found) > 10
    for tokens, hit, j in lane.lookups:
        assert j == 0 or (hit < j <= tokens - 1 and j % bs == 0 and hit % bs == 0)
    stops = [(start, n, j) for _, _, start, n, j in lane.chunks if start < j == start + n]
    assert stops  # chunks ended at their junction
    # without the junction: none found, fewer hit tokens per queried token
    _, lane0, res0 = _play(name, junction=False)
    assert all(j == 0 for _, _, j in lane0.lookups)
    if name == "q0s":  # retention 0: only the junction keeps the checkpoint at a shared system prompt's end
        assert res.hit_tokens / res.query_tokens > res0.hit_tokens / res0.query_tokens


def test_junction_example():
    """Two chats on one 40-token system prompt (block 16): the second's full-attention hit is
    32 tokens (2 blocks of the prompt), but retention 0 cached no state there (only the first
    request's last checkpoint, at 48): junction 32; its chunk stops at 32 and the checkpoint is
    kept, so the third request hits 32 tokens."""
    from hybridkv.core.config import CacheManagerConfig, KVCacheConfig, KVCacheGroup
    from hybridkv.core.kv_cache_manager import KVCacheManager
    from hybridkv.core.specs import FullAttentionSpec
    from hybridkv.core.state_spec import StateSpec

    attn = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=256, dtype="bfloat16")
    gdn = StateSpec(block_size=16, shapes=((3, 64), (2, 16, 16)), dtypes=("bfloat16",) * 2,
                    page_size_padded=attn.page_size_bytes)
    kv = KVCacheManager(KVCacheConfig(64, (KVCacheGroup(attn, ("a",)), KVCacheGroup(gdn, ("s",)))),
                        CacheManagerConfig(max_model_len=4096, enable_caching=True, prefix_cache_retention_interval=0))
    system = list(range(1000, 1040))

    def run(rid, suffix):
        req = kv.make_request(rid, system + suffix)
        blocks, hit = kv.get_computed_blocks(req)
        start, junction = hit, req.shared_prefix_boundary
        chunks = []
        while start < req.num_tokens:
            n = kv.align_num_new_tokens(req, start, req.num_tokens - start, 256)
            assert kv.allocate_slots(req, n, hit if start == hit else 0, blocks if start == hit else None) is not None
            req.num_computed_tokens = start = start + n
            chunks.append(n)
            kv.new_step_starts()
        kv.free(req)
        return hit, junction, chunks

    assert run("a", list(range(20))) == (0, 0, [48, 12])  # the prompt's last checkpoint: 48
    assert run("b", list(range(50, 60))) == (0, 32, [32, 16, 2])  # attention hits 32, no state there
    assert run("c", list(range(70, 80))) == (32, 0, [16, 2])


def test_retention_zero_caches_fewer_states_than_dense():
    _, l0, r0 = _play("q0s")
    _, ln, rn = _play("qns")
    states = [sum(1 for b in lane.kv.pool.blocks if b.block_hash is not None and b.group_id != 0)
              for lane in (l0, ln)]
    assert states[0] < states[1]


def test_striped_and_per_group_managers_agree_on_the_trace():
    """The trace on hybridkv's two layouts (stripes / one manager per group, as vLLM has):
    the same hits, admissions and preemptions (stripes only change which blocks are evicted
    first under pressure; this pool keeps enough room)."""
    tr = make_state_trace("q0s", quick=True)
    tr.num_blocks = 1500
    a = Driver(tr, HybridLane()).run()
    b = Driver(tr, HybridLane(stripe_groups=False)).run()
    keys = ("steps", "lookups", "hit_tokens", "admitted", "finished", "preemptions", "alloc_fail_admit")
    assert {k: getattr(a, k) for k in keys} == {k: getattr(b, k) for k in keys}


def test_real_page_trace_layout():
    tr = make_state_trace("q0", quick=True)
    lane = HybridLane()
    tr.num_steps = 40
    Driver(tr, lane).run()
    specs = lane.kv.kv_cache_config.specs
    assert tr.groups == qwen3next_groups() and tr.block_size == 544
    assert specs[1].shapes == GDN_SHAPES and specs[1].page_size_bytes == specs[0].page_size_bytes == 1_114_112
    assert specs[1].padding_bytes == 16_384


@settings(max_examples=examples(500), deadline=None)
@given(bs=st.sampled_from([1, 4, 16, 544]), prompt=st.integers(1, 3000), extra=st.integers(0, 40),
       start_frac=st.floats(0, 1), n=st.integers(1, 9000), budget=st.sampled_from([8, 256, 8192]),
       junction_frac=st.one_of(st.none(), st.floats(0, 1)))
def test_alignment_rules(bs, prompt, extra, start_frac, n, budget, junction_frac):
    """Ours (the step budget and the junction) = the transcription of vLLM's split."""
    tokens = prompt + extra
    start = int(start_frac * (tokens - 1))
    n = min(n, tokens - start, budget)
    junction = 0 if junction_frac is None else int(junction_frac * (tokens - 1)) // bs * bs
    req = SimpleNamespace(shared_prefix_boundary=junction)
    ours = ours_align(req, prompt, tokens, start, n, bs=bs, max_prefill=budget)
    assert ours == vllm_align(req, prompt, tokens, start, n, bs=bs, max_prefill=budget)
    assert 0 <= ours <= n


def test_alignment_example():
    """Block 16, budget 256, prompt 78: 5 tokens left in the step -> the request waits (0);
    40 -> 32; the last chunk from 64 runs to the end; a junction at 48 stops a chunk there."""
    for f in (vllm_align, ours_align):
        g = functools.partial(f, bs=16, max_prefill=256)
        assert g(None, 78, 78, 0, 5) == 0 and g(None, 78, 78, 0, 40) == 32 and g(None, 78, 78, 64, 14) == 14
        assert g(SimpleNamespace(shared_prefix_boundary=48), 78, 78, 0, 78) == 48
        assert g(None, 78, 78, 0, 5) == 0
    # a block longer than the step budget: sub-block chunks run (block 544, budget 256)
    assert ours_align(None, 2000, 2000, 0, 256, bs=544, max_prefill=256) == 256


def test_state_retention_script_smoke(capsys):
    import state_retention

    assert state_retention.main(["--block", "16", "--pool", "300", "--users", "6", "--conversations", "12",
                                 "--budget", "256"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[3:7]]
    assert [r[0] for r in rows] == ["None", "0", "4*block", "16*block"]
    rate = {r[0]: float(r[1]) for r in rows}
    ckpts = {r[0]: int(r[4]) for r in rows}
    assert 0 < rate["0"] <= 1 and ckpts["None"] >= ckpts["4*block"] >= ckpts["0"]

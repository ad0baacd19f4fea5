"""The state-group trace of ``benchmarks/vs_vllm.py --state`` (``benchmarks/_state_trace.py``),
played on hybridkv only (no vLLM): the driver's aligned chunks, new_step_starts and
deferred admissions on the Qwen3-Next layout, and the alignment rules it compares."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from _state_trace import (  # noqa: E402
    GDN_SHAPES,
    make_state_trace,
    notes_align_split,
    ours_align,
    qwen3next_groups,
    vllm_align,
)
from _traces import Driver, HybridLane  # noqa: E402

from hybridkv.core.managers.state import StateManager  # noqa: E402


class AlignCheckingLane(HybridLane):
    """hybridkv; records every prefill chunk the driver schedules and checks it was aligned."""

    def build(self, tr):
        super().build(tr)
        self.tr = tr
        self.chunks: list[tuple[int, int, int, int]] = []  # (prompt, tokens, start, n)
        alloc = self.alloc

        def checked(req, n, hit=0, blocks=None):
            start = req.num_computed_tokens + hit
            if start < max(req.num_prompt_tokens, req.num_tokens - 1):
                self.chunks.append((req.num_prompt_tokens, req.num_tokens, start, n))
            return alloc(req, n, hit, blocks)

        self.alloc = checked


def _play(name, **kw):
    tr = make_state_trace(name, quick=True, **kw)
    lane = AlignCheckingLane()
    res = Driver(tr, lane).run()
    lane.kv.check_invariants()
    return tr, lane, res


@pytest.mark.parametrize("name", ["q0s", "qns"])
@pytest.mark.parametrize("align", ["vllm", "hybridkv"])
def test_trace_runs_on_hybridkv_with_aligned_chunks(name, align):
    tr, lane, res = _play(name, align=align)
    kv = lane.kv
    assert [type(m) for m in kv.coordinator.state_managers] == [StateManager]  # 3 groups, one striped manager
    assert kv.coordinator.state_managers[0].retention_interval == tr.retention
    assert res.finished > 100 and res.hit_tokens > 0 and res.lookups > res.admitted  # refused admissions retried
    bs = tr.block_size
    for prompt, tokens, start, n in lane.chunks:
        end = start + n
        last = (tokens - 1) // bs * bs
        assert n > 0
        # a chunk ends on a boundary, at the prefill's end, or (hybridkv only) inside its first block
        assert end % bs == 0 or end >= max(prompt, tokens - 1) or (align == "hybridkv" and end // bs * bs <= start)
        assert not start < last < end  # never past the prompt's last checkpoint
    assert kv.coordinator.state_managers[0].width == 3


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


@settings(max_examples=400, deadline=None)
@given(bs=st.sampled_from([1, 4, 16, 544]), prompt=st.integers(1, 3000), extra=st.integers(0, 40),
       start_frac=st.floats(0, 1), n=st.integers(1, 9000), budget=st.sampled_from([8, 256, 8192]))
def test_alignment_rules(bs, prompt, extra, start_frac, n, budget):
    """Ours = the notes' rule; vLLM's differs only where a chunk would end before its first
    block boundary while the block fits the step budget: vLLM schedules nothing (0)."""
    tokens = prompt + extra
    start = int(start_frac * (tokens - 1))
    n = min(n, tokens - start)
    ours = ours_align(None, prompt, tokens, start, n, bs=bs)
    assert ours == notes_align_split(prompt, tokens, start, n, bs)
    v = vllm_align(None, prompt, tokens, start, n, bs=bs, max_prefill=budget)
    end = start + n
    if end < max(prompt, tokens - 1) and end // bs * bs <= start and bs <= budget:
        assert v == 0 and ours == n
    else:
        assert v == ours


def test_alignment_example():
    """Block 16, budget 256, prompt 78: 5 tokens left in the step -> vLLM waits, ours computes 5."""
    f = functools.partial(vllm_align, bs=16, max_prefill=256)
    assert f(None, 78, 78, 0, 5) == 0 and ours_align(None, 78, 78, 0, 5, bs=16) == 5
    assert f(None, 78, 78, 0, 40) == 32 and f(None, 78, 78, 64, 14) == 14  # 64 = (78 - 1) // 16 * 16


def test_state_retention_script_smoke(capsys):
    import state_retention

    assert state_retention.main(["--block", "16", "--pool", "300", "--users", "6", "--conversations", "12",
                                 "--budget", "256"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[3:7]]
    assert [r[0] for r in rows] == ["None", "0", "4*block", "16*block"]
    rate = {r[0]: float(r[1]) for r in rows}
    ckpts = {r[0]: int(r[4]) for r in rows}
    assert 0 < rate["0"] <= 1 and ckpts["None"] >= ckpts["4*block"] >= ckpts["0"]

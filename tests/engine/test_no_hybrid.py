"""``EngineConfig(hybrid=False)``: every layer's KV kept as full attention, same outputs.

The all-full layout changes only where KV lives (one group of every layer, nothing
freed), never which keys a layer reads, so greedy tokens are identical and logits
equal within float noise, on every tiny model with windows or chunks; and it holds
more KV bytes. The rule that lets a group hold other attention types
(:meth:`KVCacheSpec.covers`) is checked against a brute-force oracle.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.support.tiers import examples, slow_except

from hybridkv.core.specs import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec
from hybridkv.engine.engine import EngineConfig, LLMEngine
from hybridkv.engine.kv_storage import PagedKVStorage
from hybridkv.engine.model_runner import PagedModelRunner
from hybridkv.engine.models import load_model
from hybridkv.errors import InvalidConfigError
from hybridkv.scheduler import SamplingParams

ARCHS = ["gemma3", "mistral", "llama4_dense", "gpt_oss"]
TOL = 1e-5  # same schedule, other layout: the same sums up to float noise
TOL_RESCHEDULED = 1e-4  # a tight pool preempts the all-full layout only: other chunks, as the HF tests' bound
NEW = 10


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(0, 128, (33,), generator=g).tolist()
    return [
        shared + torch.randint(0, 128, (30,), generator=g).tolist(),  # 63 tokens: several windows / chunks
        torch.randint(0, 128, (47,), generator=g).tolist(),
        shared + torch.randint(0, 128, (5,), generator=g).tolist(),  # a prefix hit on the first
        torch.randint(0, 128, (3,), generator=g).tolist(),
    ]


PROMPTS = _prompts()


@pytest.fixture(scope="module")
def models(tiny_models):
    cache: dict = {}

    def get(arch):
        if arch not in cache:
            path, _ = tiny_models(arch)
            cache[arch] = load_model(path)
        return cache[arch]

    return get


def run(model, hybrid: bool, **config):
    """All prompts, the later ones arriving while the first run; outputs and per-step logits."""
    engine = LLMEngine(model, EngineConfig(hybrid=hybrid, **config))
    outputs, logits = {}, {}
    arrivals = {0: [0, 1], 3: [2], 5: [3]}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for i in arrivals.get(step, []):
            engine.add_request(PROMPTS[i], SamplingParams(max_tokens=NEW), request_id=str(i))
        if engine.has_unfinished_requests():
            outputs.update((o.request_id, o) for o in engine.step())
            for rid, row in engine.last_logits.items():
                logits.setdefault(rid, []).append(row.clone())
            engine.scheduler.check_invariants()
        step += 1
    return engine, outputs, {k: torch.stack(v) for k, v in logits.items()}


@pytest.mark.parametrize("arch", slow_except(ARCHS, 0))  # the fast tier: gemma3 in the tight pool
@pytest.mark.parametrize("budget, tight", slow_except([(16, False), (7, True)], 1, multi=True))
def test_no_hybrid_same_tokens_and_logits_more_bytes(arch, budget, tight, models):
    model = models(arch)
    config = dict(block_size=4, max_num_batched_tokens=budget, max_model_len=96)
    pool = {"num_blocks": 400}
    if tight:  # one budget for both: the all-full layout holds the longest request and 6 blocks more
        full_block = LLMEngine(model, EngineConfig(hybrid=False, num_blocks=2, **config)).grouping.bytes_per_block
        pool = {"kv_cache_memory": (19 + 1 + 6) * full_block}
    config.update(pool)
    hybrid, h_out, h_logits = run(model, True, **config)
    full, f_out, f_logits = run(model, False, **config)
    assert {k: o.output_token_ids for k, o in h_out.items()} == {k: o.output_token_ids for k, o in f_out.items()}
    assert all(len(o.output_token_ids) == NEW for o in h_out.values())
    for rid in h_logits:
        assert (h_logits[rid] - f_logits[rid]).abs().max().item() < (TOL_RESCHEDULED if tight else TOL), rid
    hs, fs = hybrid.kv_summary(), full.kv_summary()
    assert fs.groups[0].kind == "full_attention" and len(fs.groups) == 1 and fs.groups[0].num_layers == model.num_layers
    assert fs.kv_bytes_per_request == fs.full_kv_bytes_per_request == hs.full_kv_bytes_per_request
    assert hs.kv_bytes_per_request < fs.kv_bytes_per_request
    assert hs.peak_bytes < fs.peak_bytes  # nothing freed as requests run: more KV held at the peak
    if tight:
        assert fs.num_preemptions > 0  # the all-full layout is tight here: preempted, same outputs
    else:  # request 2 arrives when request 0's shared 33 tokens are computed: 8 blocks hit
        assert hs.prefix_hit_tokens == fs.prefix_hit_tokens == 32
    for o in h_out.values():
        assert 0.0 <= o.time_to_first_token


def test_no_hybrid_refuses_a_group_size(models):
    with pytest.raises(InvalidConfigError, match="group_size"):
        EngineConfig(hybrid=False, group_size=2)
    with pytest.raises(InvalidConfigError, match="bool"):
        EngineConfig(hybrid="no")


# ------------------------------------------------------------------ the covering rule
def _first_key(spec, pos: int) -> int:
    """Oldest key a query at ``pos`` reads, or (the same formula) the oldest key a group of
    ``spec`` keeps once ``pos`` tokens are computed (block size 1: nothing kept extra)."""
    span = spec.attention_span
    if span is None:
        return 0
    if spec.kind == "sliding_window":
        return max(pos - span + 1, 0)
    return pos // span * span


def _spec(kind: str, size: int):
    common = dict(block_size=4, num_kv_heads=1, head_size=8)
    if kind == "full":
        return FullAttentionSpec(**common)
    if kind == "sliding":
        return SlidingWindowSpec(**common, sliding_window=size)
    return ChunkedLocalAttentionSpec(**common, attention_chunk_size=size)


specs = st.builds(_spec, st.sampled_from(["full", "sliding", "chunked"]), st.integers(1, 24))


@settings(max_examples=examples(400), deadline=None)
@given(specs, specs)
def test_covers_matches_a_brute_force_oracle(group, layer):
    """A group covers a layer iff at every point the group keeps every key the layer reads
    (queries at or after the computed count read no older key than the one at it)."""
    oracle = all(_first_key(layer, n) >= _first_key(group, n) for n in range(0, 4 * 24 * 24))
    assert group.covers(layer) == oracle


def test_runner_asks_the_covering_rule(models):
    model = models("gemma3")  # s s f s s f, window 12
    n = model.num_layers
    storage = PagedKVStorage([list(range(n))], 4, 8, model.num_kv_heads, model.head_dim)
    spec = dict(block_size=4, num_kv_heads=model.num_kv_heads, head_size=model.head_dim)
    PagedModelRunner(model, storage, group_specs=[FullAttentionSpec(**spec)])  # full covers all
    with pytest.raises(InvalidConfigError, match="frees keys that layer 2"):
        PagedModelRunner(model, storage, group_specs=[SlidingWindowSpec(**spec, sliding_window=12)])
    sliding = [i for i in range(n) if model.attention_type(i).kind == "sliding"]
    storage = PagedKVStorage([sliding, [2, 5]], 4, 8, model.num_kv_heads, model.head_dim)
    wide = SlidingWindowSpec(**spec, sliding_window=13)  # a wider window covers the 12 ones
    PagedModelRunner(model, storage, group_specs=[wide, FullAttentionSpec(**spec)])
    with pytest.raises(InvalidConfigError, match="2 group specs for 1"):
        PagedModelRunner(model, PagedKVStorage([list(range(n))], 4, 8, model.num_kv_heads, model.head_dim),
                         group_specs=[wide, wide])

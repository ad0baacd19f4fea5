"""ReplicaIndex (hybridkv.router.index): a replica's cache from its KV events, scored with
the core's own hit rules.

THE oracle property: a replica's events, through the wire (to_batch / encode / decode), fed
to an index after every step; for probe prompts ``index.score(p)`` equals the replica's
own hit (``coordinator.find_hit`` over the probe's block hashes, max_length len(p) - 1).
Driven by Hypothesis over a pure core KVCacheManager (the random operations of
tests/core/test_random_operations.py, evictions, preemptions and resets included), once
more with the events' hashes replaced by 64-bit ints (a replica that hashes differently,
as vLLM with int hashes), and by a real tiny engine (gemma3: full + sliding 12;
llama4_dense: full + chunked 20) in a pool small enough to evict. Then a brute-force
oracle over hand-made residency (mixed block sizes, several groups of one kind), vLLM's
golden bytes, and bad events (counted, never raised).
"""

from __future__ import annotations

import hashlib
import random
from math import lcm
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant

msgspec = pytest.importorskip("msgspec")

from hybridkv.core.config import CacheManagerConfig, KVCacheConfig, KVCacheGroup  # noqa: E402
from hybridkv.core.kv_cache_manager import KVCacheManager  # noqa: E402
from hybridkv.router import ReplicaIndex  # noqa: E402
from hybridkv.router.index import GroupInfo, Prompt  # noqa: E402
from hybridkv.protocol.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    encode_batch,
    to_batch,
)

from tests.support.kv_specs import chunked, sliding  # noqa: E402
from tests.support.state_machine import StateMachine  # noqa: E402
from tests.support.manager_machines import (  # noqa: E402
    BS,
    PREFIXES,
    HybridManagerMachine,
    MixedStripeWidthsMachine,
    TailOnlyMachine,
)
from tests.support.tiers import examples, slow_except  # noqa: E402

DATA = Path(__file__).parents[1] / "server" / "data"


def int_hash(h: bytes | int) -> int:
    """A replica's other hash of the same block: 64 bits, as vLLM's int block hashes."""
    data = h if isinstance(h, bytes) else h.to_bytes(8, "big")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def rehashed(events: list) -> list:
    """The same events as a replica hashing with :func:`int_hash` would send them."""
    out = []
    for e in events:
        if isinstance(e, BlockStored):
            parent = None if e.parent_block_hash is None else int_hash(e.parent_block_hash)
            e = msgspec.structs.replace(e, block_hashes=[int_hash(h) for h in e.block_hashes], parent_block_hash=parent)
        elif isinstance(e, BlockRemoved):
            e = msgspec.structs.replace(e, block_hashes=[int_hash(h) for h in e.block_hashes])
        out.append(e)
    return out


def over_the_wire(core_events: list, hash_form: str = "bytes") -> list:
    """Core events as a subscriber decodes them, hashes whole (``"bytes"``) or folded to vLLM's 64-bit ints."""
    return decode_batch(encode_batch(to_batch(core_events, hash_form=hash_form))).events


def engine_hit(kv: KVCacheManager, tokens: list[int], max_length: int | None = None) -> int:
    limit = len(tokens) - 1 if max_length is None else min(len(tokens) - 1, max_length)
    return kv.coordinator.find_hit(kv.make_request("probe", tokens).block_hashes, limit)[1]


def num_cached(kv: KVCacheManager) -> int:
    return sum(len(kv.pool.cached_block_ids(g)) for g in range(kv.coordinator.num_groups))


# ------------------------------------------------------------------ the oracle, pure core
PROBES = [p[:cut] + tail for p in PREFIXES for cut in range(1, len(p) + 1, 2) for tail in ([], [40, 41, 42])]


class IndexOracle:
    """Mixed into a manager machine: events on, fed to two indexes (our hashes; int hashes)."""

    def __init__(self):
        super().__init__()
        cfg = KVCacheConfig(self.NUM_BLOCKS, tuple(KVCacheGroup(s) for s in self.specs))
        self.kv = KVCacheManager(cfg, CacheManagerConfig(max_model_len=64, enable_kv_events=True))
        self.index = ReplicaIndex()
        self.other = ReplicaIndex()

    @invariant()
    def index_scores_the_replicas_own_hit(self):
        core_events = self.kv.take_events()
        self.index.apply(over_the_wire(core_events))
        self.other.apply(over_the_wire(core_events, "int"))  # what serve publishes by default
        for index in (self.index, self.other):
            assert index.num_bad_events == 0
            assert index.num_blocks == num_cached(self.kv)
        live = [r.all_token_ids for r in (*self.waiting.values(), *self.running.values())]
        # an index knows only the groups it heard of: until every group has stored a block
        # (a state group stores only checkpoints) it can only predict more than the replica has
        heard_all = len(self.index.groups) == self.kv.coordinator.num_groups
        for probe in PROBES + live + [t + [44] for t in live]:
            p = Prompt(probe)
            want = engine_hit(self.kv, probe)
            if not heard_all:
                assert self.index.score(p) >= want, probe
                continue
            assert self.index.score(p) == want, probe
            assert self.other.score(p) == want, probe
            if any(s.kind == "full_attention" for s in self.specs):
                assert self.index.score_full_only(p) >= want  # full only never sees less
            cap = len(probe) // 2
            assert self.index.score(probe, max_length=cap) == engine_hit(self.kv, probe, cap)


class SparseOnlyMachine(HybridManagerMachine):
    """No full group: a run's parent is often cached nowhere (chains through evicted blocks)."""

    SPECS = (sliding(5, BS), chunked(5, BS), sliding(3, BS))
    NUM_BLOCKS = 30


class HybridIndexMachine(IndexOracle, HybridManagerMachine):
    pass


class StateIndexMachine(IndexOracle, StateMachine):
    """Full + sliding + state groups, the scheduler's steps and a fake model: a state
    group's hit needs its checkpoint at exactly the hit's length."""


class MixedStripeIndexMachine(IndexOracle, MixedStripeWidthsMachine):
    pass


class SparseOnlyIndexMachine(IndexOracle, SparseOnlyMachine):
    pass


class TailOnlyIndexMachine(IndexOracle, TailOnlyMachine):
    """tail_only groups store runs whose parent sits in their gap: a full group (cached first,
    :attr:`~hybridkv.core.coordinator.KVCacheCoordinator.cache_order`) stored that parent, so
    every run chains and the index still scores the replica's own hit."""


_SETTINGS = settings(max_examples=examples(30), stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestHybridIndex = HybridIndexMachine.TestCase
TestHybridIndex.settings = _SETTINGS
TestMixedStripeIndex = MixedStripeIndexMachine.TestCase
TestMixedStripeIndex.settings = _SETTINGS
TestStateIndex = StateIndexMachine.TestCase
TestStateIndex.settings = _SETTINGS
TestSparseOnlyIndex = SparseOnlyIndexMachine.TestCase
TestSparseOnlyIndex.settings = _SETTINGS
TestTailOnlyIndex = TailOnlyIndexMachine.TestCase
TestTailOnlyIndex.settings = _SETTINGS


# ------------------------------------------------------------------ the oracle, a real tiny engine
@pytest.mark.parametrize("model, kinds, num_blocks", slow_except([("gemma3", {"full_attention", "sliding_window"}, 48),
                                                                  ("llama4_dense", {"full_attention", "chunked_local_attention"}, 110)],
                                                                 0, multi=True))
def test_tiny_engine_events_index_its_hits(tmp_path, model, kinds, num_blocks):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import torch
    from tests.support.hf_tiny import build_tiny

    from hybridkv.engine.engine import EngineConfig, LLMEngine
    from hybridkv.scheduler import SamplingParams

    torch.set_num_threads(1)
    build_tiny(model, tmp_path)
    engine = LLMEngine(tmp_path, EngineConfig(block_size=4, num_blocks=num_blocks, max_model_len=48, max_num_seqs=4,
                                              max_num_batched_tokens=16, enable_kv_events=True))
    kv = engine.kv
    assert {g.spec.kind for g in engine.grouping.groups} == kinds
    index, other = ReplicaIndex(), ReplicaIndex()
    rng = random.Random(model)
    systems = [[rng.randrange(3, 100) for _ in range(rng.randrange(8, 30))] for _ in range(3)]
    prompts: list[list[int]] = []
    removed = 0
    for step in range(60):
        if step < 45 and rng.random() < 0.5:
            prompt = rng.choice(systems)[:rng.randrange(4, 31)] + [rng.randrange(3, 100) for _ in range(rng.randrange(1, 12))]
            prompts.append(prompt)
            engine.add_request(prompt, SamplingParams(max_tokens=rng.randrange(1, 8)))
        engine.step()
        core_events = kv.take_events()
        events = over_the_wire(core_events)
        removed += sum(isinstance(e, BlockRemoved) for e in events)
        index.apply(events)
        other.apply(rehashed(over_the_wire(core_events, "int")))  # vLLM's folded ints, hashed again
        assert index.num_bad_events == other.num_bad_events == 0
        assert index.num_blocks == num_cached(kv)
        for probe in rng.sample(prompts, min(6, len(prompts))) + [s + [7, 8, 9] for s in systems]:
            want = engine_hit(kv, probe)
            assert index.score(probe) == other.score(probe) == want, (step, probe)
    assert removed > 0  # the pool evicted
    assert {i.kind for i in index.groups.values()} == kinds


# ------------------------------------------------------------------ brute force over hand-made residency
def first_needed(kind: str, span: int | None, L: int) -> int:
    if kind == "full_attention":
        return 0
    if kind == "sliding_window":
        return max(0, L - span + 1)
    if kind == "mamba":  # the state checkpoint after exactly L tokens
        return max(0, L - 1)
    return L // span * span


def stored(hashes, tokens, bs, gid, kind, span, first=0, parent=None):
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=list(tokens[first * bs:(first + len(hashes)) * bs]),
                       block_size=bs, lora_id=None, medium="GPU", lora_name=None, group_idx=gid,
                       kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=span)


group_strategy = st.tuples(
    st.sampled_from(["full_attention", "sliding_window", "chunked_local_attention", "mamba"]),
    st.integers(1, 9),
    st.sampled_from([2, 4]),
)


@settings(max_examples=examples(300), deadline=None)
@given(groups=st.lists(group_strategy, min_size=1, max_size=4), data=st.data(),
       num_tokens=st.integers(4, 26), max_length=st.one_of(st.none(), st.integers(0, 26)))
def test_score_is_the_longest_prefix_valid_for_every_group(groups, data, num_tokens, max_length):
    """Any groups (mixed block sizes, several of one kind), any residency: score is the
    longest L valid for every group (whole blocks of each), as a brute force finds it.
    (Every group stores at least one block: an index knows only groups it heard of.)"""
    tokens = list(range(100, 100 + num_tokens))
    index = ReplicaIndex()
    prompt = Prompt(tokens)
    cached = []
    for gid, (kind, span, bs) in enumerate(groups):
        span = None if kind in ("full_attention", "mamba") else span
        hashes = prompt.block_hashes(bs)
        bits = data.draw(st.lists(st.booleans(), min_size=len(hashes), max_size=len(hashes)))
        cached.append(bits)
        if hashes:  # store the whole chain, then evict what is not cached
            index.apply([stored(hashes, tokens, bs, gid, kind, span)])
            index.apply([BlockRemoved(block_hashes=[h for h, b in zip(hashes, bits) if not b], medium="GPU", group_idx=gid)])
    assert index.num_bad_events == 0 and index.num_blocks == sum(map(sum, cached))
    limit = num_tokens - 1 if max_length is None else min(num_tokens - 1, max_length)
    step = lcm(*(bs for _, _, bs in groups))

    def valid(L):
        for (kind, span, bs), bits in zip(groups, cached):
            if not all(bits[first_needed(kind, span, L) // bs:L // bs]):
                return False
        return True

    want = max((L for L in range(0, max(limit, 0) + 1, step) if valid(L)), default=0)
    assert index.score(tokens, max_length) == want
    full_groups = [i for i, g in enumerate(groups) if g[0] == "full_attention"]
    want_full = 0
    if full_groups:
        step_full = lcm(*(groups[i][2] for i in full_groups))
        want_full = max((L for L in range(0, max(limit, 0) + 1, step_full)
                         if all(all(cached[i][:L // groups[i][2]]) for i in full_groups)), default=0)
    assert index.score_full_only(tokens, max_length) == want_full


# ------------------------------------------------------------------ vLLM's bytes
def test_vllm_golden_bytes_index():
    events = decode_batch((DATA / "vllm_hybridkv_step.bin").read_bytes()).events
    index = ReplicaIndex()
    index.apply(events[:3])  # full: blocks 0-1 (tokens 1-8); sliding 12: block 2; chunked 8: blocks 0-2
    assert index.groups == {0: GroupInfo("full_attention", None, 4), 1: GroupInfo("sliding_window", 12, 4),
                            2: GroupInfo("chunked_local_attention", 8, 4)}
    assert index.num_blocks == 6 and index.num_bad_events == 0
    prompt = list(range(1, 14))
    # full reaches 8, but token 8 needs tokens 0-7 of the sliding group (blocks 0-1), gone there
    assert index.score_full_only(prompt) == 8
    assert index.score(prompt) == 0
    index.apply(events[3:4])  # BlockRemoved of a hash never stored
    assert index.num_bad_events == 1
    index.apply(events[4:])  # AllBlocksCleared
    assert index.num_blocks == 0 and index.score_full_only(prompt) == 0 and len(index.groups) == 3

    extras = decode_batch((DATA / "vllm_extras.bin").read_bytes()).events
    index = ReplicaIndex()
    index.apply(extras)  # int hashes whose parent (42) was never seen; removals of unknown blocks
    assert index.num_bad_events == 3 and index.num_blocks == 0


def test_vllm_int_hashes_with_lora_never_match_a_plain_prompt():
    tokens = list(range(1, 10))
    ev = dict(block_hashes=[11, 12], parent_block_hash=None, token_ids=tokens[:8], block_size=4, lora_id=None,
              medium="GPU", lora_name=None, group_idx=None, kv_cache_spec_kind=None)
    index = ReplicaIndex()
    index.apply([BlockStored(**ev)])  # a pre-hybrid vLLM: no group, no kind: group 0, full
    assert index.groups == {0: GroupInfo(None, None, 4)} and index.score(tokens) == 8
    lora = ReplicaIndex()
    lora.apply([BlockStored(**{**ev, "lora_id": 1, "lora_name": "a"})])
    salted = ReplicaIndex()
    salted.apply([BlockStored(**{**ev, "extra_keys": [("salt",), None]})])
    assert lora.num_blocks == salted.num_blocks == 2
    assert lora.score(tokens) == salted.score(tokens) == 0


# ------------------------------------------------------------------ chains, duplicates, bad events
def test_a_run_chains_through_evicted_parents_within_the_chain_capacity():
    tokens = list(range(1, 14))
    hashes = Prompt(tokens).block_hashes(2)  # 6 blocks
    other = list(range(50, 56))
    for capacity, want in ((1 << 16, 12), (1, 0)):
        index = ReplicaIndex(chain_capacity=capacity)
        index.apply([stored(hashes[:4], tokens, 2, 0, "sliding_window", 5)])
        index.apply([BlockRemoved(block_hashes=hashes[:4], medium="GPU", group_idx=0)])
        index.apply([stored(Prompt(other).block_hashes(2), other, 2, 0, "sliding_window", 5)])  # 3 other blocks
        index.apply([stored(hashes[4:], tokens, 2, 0, "sliding_window", 5, first=4, parent=hashes[3])])
        assert index.score(tokens) == want  # sliding 5: blocks 4-5 are all token 12 needs
        assert index.num_bad_events == (capacity == 1)


def test_duplicates_count_and_clear_forgets_groups():
    tokens = list(range(1, 10))
    hashes = Prompt(tokens).block_hashes(4)
    index = ReplicaIndex()
    ev = stored(hashes, tokens, 4, 0, "full_attention", None)
    index.apply([ev, ev])
    index.apply([BlockRemoved(block_hashes=hashes, medium="GPU", group_idx=0)])
    assert index.num_blocks == 2 and index.score(tokens) == 8
    index.apply([BlockRemoved(block_hashes=hashes, medium="GPU", group_idx=0)])
    assert index.num_blocks == 0 and index.score(tokens) == 0 and index.num_bad_events == 0
    index.apply([ev, AllBlocksCleared()])
    assert index.num_blocks == 0 and index.groups
    index.clear()
    assert index.groups == {} and index.score(tokens) == 0


def test_bad_events_are_counted_never_raised():
    tokens = list(range(1, 14))
    hashes = Prompt(tokens).block_hashes(4)
    index = ReplicaIndex()
    good = stored(hashes, tokens, 4, 0, "full_attention", None)
    index.apply([good, stored(hashes, tokens, 4, 1, "sliding_window", 8)])
    assert index.score(tokens) == 12 and index.num_bad_events == 0
    bad = [
        BlockRemoved(block_hashes=[b"nope"], medium="GPU", group_idx=0),  # never stored
        BlockRemoved(block_hashes=[hashes[0]], medium="GPU", group_idx=7),  # unknown group
        stored([b"x"], tokens, 4, 0, "full_attention", None, parent=b"unknown"),  # unknown parent
        msgspec.structs.replace(good, token_ids=tokens[:5]),  # tokens do not fill the blocks
        msgspec.structs.replace(good, token_ids=[-1] * 12, block_hashes=[b"a", b"b", b"c"]),  # not token ids
        msgspec.structs.replace(good, block_size=0),
        "not an event",
        stored([b"m"], tokens, 4, 2, "cross_attention", None),  # a kind the rules do not cover: never scored
        stored([b"c"], tokens, 4, 3, "chunked_local_attention", None),  # chunked without its chunk size
    ]
    for n, e in enumerate(bad, 1):
        index.apply([e])
        assert index.num_bad_events == n, e
    assert index.score(tokens) == 12 and index.num_blocks == 8
    assert not index.groups[2].scored and not index.groups[3].scored
    # the replica came back with another window for group 1: everything before is void
    index.apply([stored(hashes[:1], tokens, 4, 1, "sliding_window", 4)])
    assert index.num_bad_events == len(bad) + 1
    assert index.num_blocks == 1 and index.groups == {1: GroupInfo("sliding_window", 4, 4)}
    assert index.score(tokens) == 4

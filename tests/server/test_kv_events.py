"""KV events on the wire (hybridkv.server.kv_events) and the example subscriber.

Golden bytes (tests/server/data/vllm_*.bin) were written once by vLLM 0.33's own classes
(make_vllm_fixture.py, bench venv); here our decoder reads them and our encoder must
reproduce them byte for byte. Socket tests bind 127.0.0.1 on ephemeral ports and are
bounded by timeouts.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest

msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from tests.support.tiers import examples  # noqa: E402

from hybridkv.core import events as core  # noqa: E402
from hybridkv.errors import InvalidConfigError  # noqa: E402
from hybridkv.server.kv_events import (  # noqa: E402
    VLLM_SPEC_KINDS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventPublisher,
    decode_batch,
    encode_batch,
    to_batch,
    to_wire,
)
from hybridkv.protocol.kv_events import HASH_FORMS, fold_hash  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).parent / "data"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # msgspec resolves the Structs' annotations through it
    spec.loader.exec_module(module)
    return module


FIXTURE = _load("make_vllm_fixture", DATA / "make_vllm_fixture.py")
example = _load("kv_events_subscriber", ROOT / "examples" / "kv_events_subscriber.py")
WIRE = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared}


# ------------------------------------------------------------------ golden bytes from vLLM
@pytest.mark.parametrize("name", sorted(FIXTURE.BATCHES))
def test_vllm_golden_bytes_decode_and_reencode(name):
    ts, rank, events = FIXTURE.BATCHES[name]
    ours = KVEventBatch(ts=ts, events=[WIRE[cls](**kw) for cls, kw in events], data_parallel_rank=rank)
    golden = (DATA / f"vllm_{name}.bin").read_bytes()
    assert decode_batch(golden) == ours
    assert encode_batch(ours) == golden


def test_core_events_map_to_the_golden_step():
    """The core events of a full + sliding 12 + chunked 8 step encode to vLLM's bytes."""
    h = FIXTURE.H
    step = [
        core.BlockStored((h[0], h[1]), (1, 2), None, 4, 0, "full_attention", tuple(range(1, 9)), None),
        core.BlockStored((h[2],), (7,), h[1], 4, 1, "sliding_window", (9, 10, 11, 12), 12),
        core.BlockStored((h[0], h[1], h[2]), (3, 4, 5), None, 4, 2, "chunked_local_attention", tuple(range(1, 13)), 8),
        core.BlockRemoved(h[3], 9, 1, "sliding_window"),
        core.AllBlocksCleared(),
    ]
    ts = FIXTURE.BATCHES["hybridkv_step"][0]
    assert encode_batch(to_batch(step, ts, hash_form="bytes")) == (DATA / "vllm_hybridkv_step.bin").read_bytes()


# ------------------------------------------------------------------ round trips
hashes = st.one_of(st.binary(min_size=1, max_size=32), st.integers(0, 2**64 - 1))
opt = st.none
stored = st.builds(
    BlockStored,
    block_hashes=st.lists(hashes, max_size=4),
    parent_block_hash=opt() | hashes,
    token_ids=st.lists(st.integers(0, 2**40), max_size=16),
    block_size=st.integers(1, 1024),
    lora_id=opt() | st.integers(0, 1000),
    medium=st.sampled_from([None, "GPU", "CPU", "STORAGE"]),
    lora_name=opt() | st.text(max_size=8),
    extra_keys=opt() | st.lists(opt() | st.tuples(st.text(max_size=4), st.integers(0, 9)), max_size=3),
    group_idx=opt() | st.integers(0, 16),
    kv_cache_spec_kind=opt() | st.sampled_from(sorted(VLLM_SPEC_KINDS)),
    kv_cache_spec_sliding_window=opt() | st.integers(1, 1 << 20),
    locality=st.sampled_from([None, "LOCAL", "REMOTE"]),
    ownership=opt() | st.text(max_size=4),
    session_id=opt() | st.text(max_size=8),
    lookahead_token_ids=opt() | st.lists(st.lists(st.integers(0, 99), max_size=2), max_size=3),
)
removed = st.builds(
    BlockRemoved, block_hashes=st.lists(hashes, max_size=3), medium=st.sampled_from([None, "GPU"]),
    group_idx=opt() | st.integers(0, 16), locality=st.sampled_from([None, "LOCAL"]), ownership=opt() | st.text(max_size=3),
)
batches = st.builds(
    KVEventBatch, ts=st.floats(allow_nan=False), events=st.lists(stored | removed | st.just(AllBlocksCleared()), max_size=6),
    data_parallel_rank=opt() | st.integers(0, 64),
)


@settings(max_examples=examples(300), deadline=None)
@given(batches)
def test_wire_round_trip(batch):
    assert decode_batch(encode_batch(batch)) == batch


core_hash = st.binary(min_size=32, max_size=32)
core_stored = st.integers(1, 4).flatmap(lambda n: st.builds(
    core.BlockStored, st.lists(core_hash, min_size=n, max_size=n).map(tuple), st.just(tuple(range(1, n + 1))),
    st.none() | core_hash, st.just(2), st.integers(0, 5), st.sampled_from(["full_attention", "sliding_window", "odd"]),
    st.lists(st.integers(0, 1 << 20), min_size=2 * n, max_size=2 * n).map(tuple), st.none() | st.integers(1, 512),
))
core_removed = st.builds(core.BlockRemoved, core_hash, st.integers(1, 99), st.integers(0, 5), st.just("sliding_window"))


def _vllm_fold(digest: bytes) -> int:
    """vLLM 0.34's ``maybe_convert_block_hash`` (kv_cache_utils.py), restated: the digest as a
    big-endian int, low 64 bits."""
    return int.from_bytes(digest, byteorder="big") & ((1 << 64) - 1)


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(core_stored | core_removed | st.just(core.AllBlocksCleared()), max_size=6),
       st.sampled_from(HASH_FORMS))
def test_core_events_survive_the_wire(events, hash_form):
    got = decode_batch(encode_batch(to_batch(events, ts=1.0, hash_form=hash_form))).events
    h = _vllm_fold if hash_form == "int" else bytes
    assert len(got) == len(events)
    for e, w in zip(events, got):
        assert w == to_wire(e, hash_form=hash_form)
        if isinstance(e, core.BlockStored):
            parent = None if e.parent_hash is None else h(e.parent_hash)
            assert (w.block_hashes, w.parent_block_hash, w.token_ids, w.group_idx) == (
                [h(x) for x in e.block_hashes], parent, list(e.token_ids), e.group_id)
            assert all(type(x) is (int if hash_form == "int" else bytes) for x in w.block_hashes)
            assert hash_form == "bytes" or all(0 <= x < 2**64 for x in w.block_hashes)
            assert w.kv_cache_spec_kind == (e.spec_kind if e.spec_kind != "odd" else "unknown")
            assert w.kv_cache_spec_sliding_window == e.attention_span
        elif isinstance(e, core.BlockRemoved):
            assert (w.block_hashes, w.group_idx) == ([h(e.block_hash)], e.group_id)


def test_fold_is_vllms_on_edge_digests():
    for digest in (bytes(32), b"\xff" * 32, bytes(range(32)), b"\x01" + bytes(31), bytes(31) + b"\x01", b"\x80" * 8):
        assert fold_hash(digest) == _vllm_fold(digest) == int.from_bytes(digest[-8:], "big")
    with pytest.raises(ValueError):
        to_wire(core.AllBlocksCleared(), hash_form="hex")


# ------------------------------------------------------------------ publisher
@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)  # closes any socket a failed test left open (term() would wait for it)


def _collect(sub, want: int, timeout: float = 10.0) -> list:
    """(seq, batch) pairs until ``want`` batches arrived or ``timeout`` passed."""
    got: list = []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        got += sub.poll(200)
    return got


class Lossy:
    """Stands in for the PUB socket and loses the given sequence numbers (a network drop)."""

    def __init__(self, sock, lose: set[int]):
        self.sock, self.lose = sock, lose

    def send_multipart(self, frames):
        if int.from_bytes(frames[1], "big") not in self.lose:
            self.sock.send_multipart(frames)

    def __getattr__(self, name):
        return getattr(self.sock, name)


def _stored(n: int) -> list:
    return [core.BlockStored((bytes([n]) * 32,), (n,), None, 2, 0, "full_attention", (n, n), None)]


def _until_live(pub, sub, timeout: float = 10.0) -> int:
    """Publish probe batches until the subscriber receives one live (its subscription
    has reached the publisher); the probe's sequence number."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pub.publish(_stored(99))
        got = sub.poll(50)
        if got:
            return got[-1][0]
    raise AssertionError("the subscription never reached the publisher")


@pytest.mark.parametrize("buffer_steps, lost", [(100, []), (1, [2])])
def test_replay_fills_a_gap(ctx, buffer_steps, lost):
    """Batch k + 2 is lost on the way; the subscriber sees k + 3, asks the replay from
    k + 2 and gets it (or, with a buffer of 1, learns it is lost)."""
    with KVEventPublisher("tcp://127.0.0.1:0", group_specs=[], replay_endpoint="tcp://127.0.0.1:0",
                          buffer_steps=buffer_steps, topic="kv") as pub:
        sub = example.Subscriber(pub.endpoint, pub.replay_endpoint, topic="kv", ctx=ctx)
        try:
            k = _until_live(pub, sub)
            pub._pub = Lossy(pub._pub, {k + 2})
            for n in range(1, 4):
                pub.publish(_stored(n))
                pub.publish([])  # no batch, no sequence number
            got = _collect(sub, 3 - len(lost))
        finally:
            sub.close()
    assert [seq - k for seq, _ in got] == [s for s in range(1, 4) if s not in lost]
    assert [s - k for s in sub.lost] == lost
    assert [b.events[0].token_ids for _, b in got] == [[n, n] for n in range(1, 4) if n not in lost]


def test_late_subscriber_catches_up_from_the_replay(ctx):
    with KVEventPublisher("tcp://127.0.0.1:0", group_specs=[], replay_endpoint="tcp://127.0.0.1:0") as pub:
        for n in range(4):
            pub.publish(_stored(n))
        sub = example.Subscriber(pub.endpoint, pub.replay_endpoint, ctx=ctx, start_seq=0)
        try:
            got = _collect(sub, 4)
        finally:
            sub.close()
    assert [seq for seq, _ in got] == [0, 1, 2, 3] and sub.lost == []


def test_bad_endpoints_are_config_errors():
    with KVEventPublisher("tcp://127.0.0.1:0", group_specs=[]) as pub:
        for endpoint in ["127.0.0.1:5557", "tcp://127.0.0.1:notaport", pub.endpoint, None]:
            with pytest.raises(InvalidConfigError) as err:
                KVEventPublisher(endpoint, group_specs=[])
            assert "\n" not in str(err.value)
        with pytest.raises(InvalidConfigError):
            KVEventPublisher("tcp://127.0.0.1:0", group_specs=[], replay_endpoint=pub.endpoint)
        with pytest.raises(InvalidConfigError):
            KVEventPublisher("tcp://127.0.0.1:0", group_specs=[], buffer_steps=0)


def test_close_is_idempotent_and_publish_after_close_is_ignored():
    pub = KVEventPublisher("tcp://127.0.0.1:0", group_specs=[])
    pub.publish(_stored(1))
    pub.close()
    pub.close()
    pub.publish(_stored(2))
    assert not pub._thread.is_alive()


# ------------------------------------------------------------------ a real engine
def test_subscriber_sees_every_stored_block_of_a_request(tmp_path, ctx):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.support.hf_tiny import build_tiny

    from hybridkv.engine.engine import EngineConfig, LLMEngine
    from hybridkv.scheduler import SamplingParams

    build_tiny("gemma3", tmp_path)
    engine = LLMEngine(tmp_path, EngineConfig(block_size=4, num_blocks=64, max_model_len=64,
                                              max_num_batched_tokens=8, enable_kv_events=True))
    specs = [g.spec for g in engine.grouping.groups]
    assert {s.kind for s in specs} == {"full_attention", "sliding_window"}
    prompt = list(range(3, 22))  # 19 tokens: prefilled in chunks of 8
    sent: list = []
    with KVEventPublisher("tcp://127.0.0.1:0", group_specs=specs, replay_endpoint="tcp://127.0.0.1:0") as pub:
        # from 0: what was published before the subscription took hold comes from the replay
        sub = example.Subscriber(pub.endpoint, pub.replay_endpoint, ctx=ctx, start_seq=0)
        try:
            engine.add_request(prompt, SamplingParams(max_tokens=6), request_id="a")
            outputs = []
            while engine.has_unfinished_requests():
                outputs += engine.step()
                events = engine.kv.take_events()
                sent.append(events)
                pub.publish(events)
            num_batches = sum(1 for e in sent if e)
            got = _collect(sub, num_batches)
        finally:
            sub.close()
    assert [seq for seq, _ in got] == list(range(num_batches)) and sub.lost == []
    received = [e for _, batch in got for e in batch.events]
    # every event the manager recorded, in order (the example declares fewer of vLLM's fields: compare values)
    assert [msgspec.to_builtins(e) for e in received] == [
        msgspec.to_builtins(to_wire(e)) for events in sent for e in events]

    tokens = list(outputs[0].prompt_token_ids + outputs[0].output_token_ids)
    expected = [fold_hash(h) for h in engine.kv.make_request("check", tokens).block_hashes]  # the default form
    n_full = (len(tokens) - 1) // 4  # the last sampled token is never computed
    by_group: dict[int, list] = {}
    for e in received:
        assert isinstance(e, example.BlockStored)  # nothing evicted or cleared in this pool
        by_group.setdefault(e.group_idx, []).append(e)
    for gid, spec in enumerate(specs):
        window = spec.attention_span
        evs = by_group[gid]
        assert {(e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in evs} == {(spec.kind, window)}
        seen = {}
        for e in evs:
            first = 0 if e.parent_block_hash is None else expected.index(e.parent_block_hash) + 1
            for i, h in enumerate(e.block_hashes):
                assert h == expected[first + i]
                assert e.token_ids[4 * i:4 * i + 4] == tokens[4 * (first + i):4 * (first + i) + 4]
                seen[first + i] = h
        if spec.kind == "full_attention":
            assert sorted(seen) == list(range(n_full))
        else:  # blocks already out of the window when they filled are never cached
            assert set(seen) <= set(range(n_full)) and n_full - 1 in seen

"""Cross-check hybridkv's KV event wire format against vLLM's own classes (bench venv only).

    PYTHONPATH=src /work/.venv-vllm/bin/python benchmarks/kv_events_vllm_check.py

Never run in CI (needs vLLM 0.33, see ../shared/bench/README.md). Checks, printing one
line each:

1. real events: a hybridkv KVCacheManager (full + sliding window + two chunked-local
   groups, striped) runs random requests with eviction and a cache reset; each step's
   batch, encoded by us, is decoded by vLLM's msgspec decoder into vLLM's KVEventBatch,
   compared field by field, and re-encoded by vLLM to the same bytes;
2. vLLM -> us: random vLLM batches (every field, int and bytes hashes) encoded by vLLM
   are decoded by our decoder and re-encoded by us to the same bytes;
3. live, our publisher -> vLLM's decoder over a ZMQ SUB (topic, 8-byte big-endian seq, payload);
4. live, vLLM's ZmqEventPublisher -> our example subscriber (examples/kv_events_subscriber.py),
   whose late start is filled from vLLM's replay ROUTER.
"""

import importlib.util
import random
import sys
import time
from pathlib import Path

import msgspec
import zmq

ROOT = Path(__file__).resolve().parents[1]
import _paths  # noqa: E402,F401  (this checkout's src and tests.support importable)

from hybridkv.core.config import CacheManagerConfig, KVCacheConfig, KVCacheGroup  # noqa: E402
from hybridkv.core.kv_cache_manager import KVCacheManager  # noqa: E402
from hybridkv.core.specs import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec  # noqa: E402
from _vllm_env import import_vllm  # noqa: E402
from hybridkv.server import kv_events as ours  # noqa: E402
from tests.support.processes import free_port  # noqa: E402

t0 = time.perf_counter()
import_vllm("kv_events_vllm_check.py", "vllm.distributed.kv_events")  # or its set-up printed, exit 0
import vllm  # noqa: E402
from vllm.distributed import kv_events as v  # noqa: E402

print(f"vllm {vllm.__version__} ({v.__file__}), msgspec {msgspec.__version__}, pyzmq {zmq.__version__}; "
      f"import {time.perf_counter() - t0:.1f} s")


def spec(cls, **kw):
    return cls(block_size=4, num_kv_heads=1, head_size=8, dtype="float32", **kw)


def real_event_batches(seed: int = 0) -> list[list]:
    """Per step, the core events of a small hybrid manager under random load."""
    specs = (spec(FullAttentionSpec), spec(SlidingWindowSpec, sliding_window=8),
             spec(ChunkedLocalAttentionSpec, attention_chunk_size=8), spec(ChunkedLocalAttentionSpec, attention_chunk_size=8))
    kv = KVCacheManager(KVCacheConfig(40, tuple(KVCacheGroup(s) for s in specs)),
                        CacheManagerConfig(max_model_len=64, enable_kv_events=True))
    rng = random.Random(seed)
    prefixes = [list(range(100, 120)), list(range(200, 216))]
    steps = []
    for i in range(60):
        prompt = rng.choice(prefixes)[: rng.randint(4, 20)] + [rng.randint(0, 9) for _ in range(rng.randint(0, 9))]
        r = kv.make_request(f"r{i}", prompt)
        blocks, n = kv.get_computed_blocks(r)
        if kv.allocate_slots(r, r.num_tokens - n, n, blocks) is not None:
            r.num_computed_tokens = r.num_tokens
            for _ in range(rng.randint(0, 6)):
                r.append_token_ids(rng.randint(0, 9))
                if kv.allocate_slots(r, 1) is None:
                    break
                r.num_computed_tokens += 1
            kv.free(r)
        if i == 40:
            assert kv.reset_prefix_cache()
        steps.append(kv.take_events())
    return [s for s in steps if s]


def same_fields(a, b) -> bool:
    return type(a).__name__ == type(b).__name__ and msgspec.to_builtins(a) == msgspec.to_builtins(b)


def check_real_events() -> None:
    vdec = msgspec.msgpack.Decoder(v.KVEventBatch)
    steps = real_event_batches()
    kinds: dict = {}
    for i, events in enumerate(steps):
        batch = ours.to_batch(events, ts=1700000000.0 + i)
        data = ours.encode_batch(batch)
        got = vdec.decode(data)
        assert type(got) is v.KVEventBatch and all(type(e).__module__ == v.__name__ for e in got.events)
        assert got.ts == batch.ts and got.data_parallel_rank == 0 and len(got.events) == len(batch.events)
        assert all(same_fields(a, b) for a, b in zip(got.events, batch.events))
        assert msgspec.msgpack.encode(got) == data
        for e in got.events:
            kinds[type(e).__name__] = kinds.get(type(e).__name__, 0) + 1
    sample = next(e for s in steps for e in s if type(e).__name__ == "BlockStored" and e.spec_kind == "sliding_window")
    print(f"1. real events: {len(steps)} batches {kinds} -> vLLM KVEventBatch, fields equal, vLLM re-encodes the same bytes")
    e = vdec.decode(ours.encode_batch(ours.to_batch([sample], ts=0.0))).events[0]
    print(f"   e.g. vLLM's {type(e).__module__}.{type(e).__name__}: {len(e.block_hashes)} x {len(e.block_hashes[0])}-byte hashes, "
          f"parent {e.parent_block_hash.hex()[:8] if e.parent_block_hash else None}, token_ids {e.token_ids}, "
          f"block_size {e.block_size}, medium {e.medium}, group_idx {e.group_idx}, "
          f"kind {e.kv_cache_spec_kind}, sliding_window {e.kv_cache_spec_sliding_window}")


def random_vllm_batch(rng: random.Random):
    def h():
        return rng.randint(0, 2**64 - 1) if rng.random() < 0.3 else rng.randbytes(32)

    def maybe(x):
        return x if rng.random() < 0.5 else None

    events = []
    for _ in range(rng.randint(0, 6)):
        k = rng.random()
        n = rng.randint(1, 3)
        if k < 0.6:
            events.append(v.BlockStored(
                block_hashes=[h() for _ in range(n)], parent_block_hash=maybe(h()),
                token_ids=[rng.randint(0, 1 << 20) for _ in range(4 * n)], block_size=4,
                lora_id=maybe(rng.randint(0, 9)), medium=rng.choice([None, "GPU", "CPU"]), lora_name=maybe("lora"),
                extra_keys=maybe([maybe(("lora", rng.randint(0, 9))) for _ in range(n)]), group_idx=maybe(rng.randint(0, 4)),
                kv_cache_spec_kind=maybe(rng.choice(sorted(ours.VLLM_SPEC_KINDS))),
                kv_cache_spec_sliding_window=maybe(rng.randint(1, 4096)), locality=maybe("LOCAL"),
                ownership=maybe("t2"), session_id=maybe("s"), lookahead_token_ids=maybe([[rng.randint(0, 9)] for _ in range(n)])))
        elif k < 0.9:
            events.append(v.BlockRemoved(block_hashes=[h() for _ in range(n)], medium=maybe("GPU"),
                                         group_idx=maybe(rng.randint(0, 4)), locality=maybe("REMOTE"), ownership=maybe("x")))
        else:
            events.append(v.AllBlocksCleared())
    return v.KVEventBatch(ts=rng.random() * 2e9, events=events, data_parallel_rank=maybe(rng.randint(0, 8)))


def check_vllm_to_ours(n: int = 2000) -> None:
    rng = random.Random(1)
    for _ in range(n):
        vb = random_vllm_batch(rng)
        data = msgspec.msgpack.encode(vb)
        got = ours.decode_batch(data)
        assert type(got) is ours.KVEventBatch and got.ts == vb.ts and got.data_parallel_rank == vb.data_parallel_rank
        assert all(same_fields(a, b) for a, b in zip(got.events, vb.events)) and len(got.events) == len(vb.events)
        assert ours.encode_batch(got) == data
    print(f"2. vLLM -> us: {n} random vLLM batches (all fields, int and bytes hashes) decoded by ours, fields equal, "
          f"our re-encoding byte-identical")


def check_live_ours_to_vllm() -> None:
    vdec = msgspec.msgpack.Decoder(v.KVEventBatch)
    steps = real_event_batches(seed=2)[:10]
    ctx = zmq.Context()
    with ours.KVEventPublisher("tcp://127.0.0.1:0", group_specs=[], topic="kv") as pub:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(pub.endpoint)
        time.sleep(0.5)  # slow joiner
        for events in steps:
            pub.publish(events)
        frames = []
        while len(frames) < len(steps) and sub.poll(5000):
            frames.append(sub.recv_multipart())
    sub.close(linger=0)
    ctx.term()
    seqs = [int.from_bytes(f[1], "big") for f in frames]
    assert [f[0] for f in frames] == [b"kv"] * len(steps) and seqs == list(range(len(steps)))
    assert all(len(f[1]) == 8 and len(f) == 3 for f in frames)
    decoded = [vdec.decode(f[2]) for f in frames]
    assert all(same_fields(a, b) for d, s in zip(decoded, steps) for a, b in zip(d.events, map(ours.to_wire, s)))
    print(f"3. live: our KVEventPublisher -> raw SUB: {len(frames)} messages [topic, seq (8 B), payload], "
          f"seqs {seqs[0]}..{seqs[-1]}, decoded by vLLM's decoder, events equal")


def plain(event) -> dict:
    """An event as msgpack sees it (a tuple and a list are both arrays)."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(event))


_NOT_IN_EXAMPLE = ("locality", "ownership", "session_id", "lookahead_token_ids")


def check_live_vllm_to_example() -> None:
    spec_ = importlib.util.spec_from_file_location("kv_events_subscriber", ROOT / "examples" / "kv_events_subscriber.py")
    example = importlib.util.module_from_spec(spec_)
    sys.modules["kv_events_subscriber"] = example
    spec_.loader.exec_module(example)
    port, rport = free_port(), free_port()
    pub = v.ZmqEventPublisher(0, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{rport}", topic="kv")
    batches = [random_vllm_batch(random.Random(i)) for i in range(5)]
    for b in batches:
        pub.publish(b)
    time.sleep(0.5)  # all sent before anyone subscribed: only the replay can deliver them
    ctx = zmq.Context()
    sub = example.Subscriber(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}", topic="kv", ctx=ctx, start_seq=0)
    got = []
    deadline = time.monotonic() + 10
    while len(got) < 5 and time.monotonic() < deadline:
        got += sub.poll(300)
    late = random_vllm_batch(random.Random(99))
    pub.publish(late)  # now live
    while len(got) < 6 and time.monotonic() < deadline:
        got += sub.poll(300)
    sub.close()
    ctx.term()
    pub.shutdown()
    assert [s for s, _ in got] == list(range(6)) and sub.lost == [], ([s for s, _ in got], sub.lost)
    for (_, b), vb in zip(got, batches + [late]):
        want = [{k: x for k, x in plain(e).items() if k not in _NOT_IN_EXAMPLE} for e in vb.events]
        have = [plain(e) for e in b.events]
        assert have == want, [(x, y) for x, y in zip(have, want) if x != y][:1]
    print("4. live: vLLM ZmqEventPublisher -> example subscriber: seqs 0-4 from vLLM's replay ROUTER "
          "(subscribed late), seq 5 live; events equal (the example ignores vLLM's last four BlockStored/BlockRemoved fields)")


if __name__ == "__main__":
    check_real_events()
    check_vllm_to_ours()
    check_live_ours_to_vllm()
    check_live_vllm_to_example()
    print("all checks passed")

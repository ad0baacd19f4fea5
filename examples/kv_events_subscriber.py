"""Subscribe to a server's KV cache events (``hybridkv serve --kv-events ...``) and print them.

Standalone: needs only pyzmq and msgspec (no hybridkv, no vLLM), and reads vLLM's
KV events too (same wire format, vLLM 0.33). On a gap in the sequence numbers it
asks the replay endpoint (if given) for the missed batches; a batch that is no longer
in the publisher's replay buffer is reported as lost (an index fed from these
events should then be rebuilt).

    python examples/kv_events_subscriber.py --endpoint tcp://127.0.0.1:5557 --replay tcp://127.0.0.1:5558

Output, one line per event::

    seq 0 BlockStored group 0 full_attention: 2 blocks, parent None, tokens [1, 2, 3, 4, 5, 6, 7, 8]
    seq 0 BlockStored group 1 sliding_window (512): 2 blocks, parent None, tokens [1, 2, 3, 4, 5, 6, 7, 8]
    seq 5 BlockRemoved group 1: 1 blocks
"""

from __future__ import annotations

import argparse
from typing import Any

import msgspec
import zmq

END_SEQ = -1


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    # vLLM's later fields (locality, ownership, session_id, lookahead_token_ids) are ignored


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class Subscriber:
    """A SUB socket on ``endpoint`` (and a DEALER on ``replay`` when given) that returns
    batches in sequence order, filling gaps from the replay endpoint.

    ``lost`` lists the sequence numbers that neither the stream nor the replay delivered;
    ``restarts`` counts sequence numbers going back (a restarted publisher).
    """

    def __init__(self, endpoint: str, replay: str | None = None, topic: str = "", ctx: zmq.Context | None = None):
        self.ctx = ctx or zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(endpoint)
        self.replay = None
        if replay is not None:
            self.replay = self.ctx.socket(zmq.DEALER)
            self.replay.connect(replay)
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.next_seq: int | None = None  # the sequence number expected next
        self.lost: list[int] = []
        self.restarts = 0

    def poll(self, timeout_ms: int = 1000) -> list[tuple[int, KVEventBatch]]:
        """The next batch (with any replayed ones before it); [] if none came in time."""
        if not self.sub.poll(timeout_ms):
            return []
        _topic, seq_bytes, payload = self.sub.recv_multipart()
        seq = int.from_bytes(seq_bytes, "big")
        out: list[tuple[int, KVEventBatch]] = []
        if self.next_seq is not None and seq > self.next_seq:
            out += self.fetch(self.next_seq, seq, timeout_ms)
            got = {s for s, _ in out}
            self.lost += [s for s in range(self.next_seq, seq) if s not in got]
        elif self.next_seq is not None and seq < self.next_seq:
            self.restarts += 1  # the publisher started over at 0: its old blocks are gone
        out.append((seq, self.decoder.decode(payload)))
        self.next_seq = seq + 1
        return out

    def fetch(self, start: int, stop: int, timeout_ms: int = 1000) -> list[tuple[int, KVEventBatch]]:
        """Batches start..stop-1 still in the publisher's replay buffer."""
        if self.replay is None:
            return []
        self.replay.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while self.replay.poll(timeout_ms):
            _empty, _topic, seq_bytes, payload = self.replay.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == END_SEQ:
                break
            if start <= seq < stop:
                out.append((seq, self.decoder.decode(payload)))
        return out

    def close(self) -> None:
        self.sub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)


def describe(seq: int, event: Any) -> str:
    if isinstance(event, BlockStored):
        span = f" ({event.kv_cache_spec_sliding_window})" if event.kv_cache_spec_sliding_window is not None else ""
        parent = event.parent_block_hash.hex()[:12] if isinstance(event.parent_block_hash, bytes) else event.parent_block_hash
        return (f"seq {seq} BlockStored group {event.group_idx} {event.kv_cache_spec_kind}{span}: "
                f"{len(event.block_hashes)} blocks, parent {parent}, tokens {event.token_ids}")
    if isinstance(event, BlockRemoved):
        return f"seq {seq} BlockRemoved group {event.group_idx}: {len(event.block_hashes)} blocks"
    return f"seq {seq} AllBlocksCleared"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--endpoint", default="tcp://127.0.0.1:5557")
    ap.add_argument("--replay", default=None, help="the publisher's replay endpoint (e.g. tcp://127.0.0.1:5558)")
    ap.add_argument("--topic", default="")
    ap.add_argument("--idle-exit", type=float, default=None, help="stop after this many seconds without a batch")
    args = ap.parse_args(argv)
    sub = Subscriber(args.endpoint, args.replay, args.topic)
    lost = 0
    try:
        while True:
            batches = sub.poll(int(args.idle_exit * 1000) if args.idle_exit else 1000)
            if not batches and args.idle_exit:
                break
            for seq, batch in batches:
                for event in batch.events:
                    print(describe(seq, event), flush=True)
            if len(sub.lost) > lost:
                print(f"lost batches (not in the replay buffer): {sub.lost[lost:]}", flush=True)
                lost = len(sub.lost)
    except KeyboardInterrupt:
        pass
    finally:
        sub.close()


if __name__ == "__main__":
    main()

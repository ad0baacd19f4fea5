"""KV event publisher: each engine step's events as one sequence-numbered batch on a ZMQ PUB
socket, with a replay ROUTER socket. The wire format is :mod:`hybridkv.protocol.kv_events`.

Usage (one engine thread publishes once per step; subscribers connect)::

    pub = KVEventPublisher("tcp://127.0.0.1:5557", group_specs=[g.spec for g in engine.grouping.groups],
                           replay_endpoint="tcp://127.0.0.1:5558")
    pub.publish(engine.kv.take_events())    # after every step, from the engine thread
    pub.close()                             # flushes, joins, closes; idempotent

Differences from vLLM's ``ZmqEventPublisher``: the endpoint is always bound (vLLM
connects to a ``tcp://host:port`` without ``*``); a tcp port 0 binds an ephemeral port,
read back from ``.endpoint``; ``publish`` never blocks: a full queue drops the batch
but still uses up its sequence number, so a subscriber sees the gap (and the replay
cannot fill it: it must resynchronise), where vLLM's ``publish`` would block the engine.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any, Sequence

import msgspec
import zmq

from hybridkv.core import events as core
from hybridkv.errors import InvalidConfigError
from hybridkv.protocol.kv_events import (  # the wire format; names kept here for the publisher's users
    END_SEQ,
    HASH_FORMS,
    MEDIUM_GPU,
    VLLM_SPEC_KINDS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
    KVEventBatch,
    decode_batch,
    encode_batch,
    spec_metadata,
    to_batch,
    to_wire,
)

__all__ = [
    "EventBatch", "KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEventBatch",
    "MEDIUM_GPU", "END_SEQ", "VLLM_SPEC_KINDS", "spec_metadata", "to_wire", "to_batch",
    "encode_batch", "decode_batch", "KVEventPublisher",
]

logger = logging.getLogger(__name__)


# ------------------------------------------------------------ publisher
_SCHEMES = ("tcp://", "ipc://", "inproc://")


class KVEventPublisher:
    """Publishes each step's events as one sequence-numbered batch on a ZMQ PUB socket,
    keeps the last ``buffer_steps`` batches for a replay ROUTER socket.

    ``publish`` (one thread: the engine's) only hands the events to a bounded queue; a
    publisher thread converts, encodes, sends and answers replay requests, and is the
    only user of the sockets after construction. ``hash_form``: the block hashes' form on the
    wire (:data:`~hybridkv.protocol.kv_events.HASH_FORMS`; "int", vLLM's default). ``group_specs``: the engine's
    per-group specs; ``.group_metadata[g]`` is group g's (kind, window / chunk) on the
    wire, which the events carry themselves (the core takes them from the same specs).
    Bad endpoints raise InvalidConfigError here, not in the thread.
    """

    JOIN_TIMEOUT = 5.0

    def __init__(
        self,
        endpoint: str,
        *,
        group_specs: Sequence[Any],
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        topic: str = "",
        hash_form: str = "int",
        max_queue_size: int = 100_000,
        hwm: int = 100_000,
    ):
        for name, value in (("buffer_steps", buffer_steps), ("max_queue_size", max_queue_size), ("hwm", hwm)):
            if type(value) is not int or value < 1:
                raise InvalidConfigError(f"KV events {name} must be an int >= 1, got {value!r}")
        if not isinstance(topic, str):
            raise InvalidConfigError(f"KV events topic must be a str, got {topic!r}")
        if hash_form not in HASH_FORMS:
            raise InvalidConfigError(f"KV events hash form must be one of {HASH_FORMS}, got {hash_form!r}")
        #: "int" (vLLM's default: 64-bit folded hashes) or "bytes" (whole digests) on the wire
        self.hash_form = hash_form
        self.group_metadata = tuple(spec_metadata(s) for s in group_specs)
        self.topic = topic
        self._topic = topic.encode()
        self._ctx = zmq.Context()
        self._pub = self._replay = None
        try:
            self._pub = self._bind(zmq.PUB, endpoint, "endpoint", hwm)
            if replay_endpoint is not None:
                # a full replay plus its end marker fits the queue even when ZMQ sees HWM/2 stale acks (as vLLM)
                self._replay = self._bind(zmq.ROUTER, replay_endpoint, "replay endpoint", 2 * (buffer_steps + 1))
        except InvalidConfigError:
            self._close_sockets()
            raise
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint: str | None = (
            self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay is not None else None
        )
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        #: batches dropped because the queue was full (their sequence numbers are gaps)
        self.num_dropped = 0
        self._closed = False
        self._close_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="hybridkv-kv-events", daemon=True)
        self._thread.start()

    def _bind(self, kind: int, endpoint: str, what: str, hwm: int) -> zmq.Socket:
        if not isinstance(endpoint, str) or not endpoint.startswith(_SCHEMES):
            raise InvalidConfigError(f"KV events {what} must be tcp://host:port, ipc://path or inproc://name, got {endpoint!r}")
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.SNDHWM, hwm)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            raise InvalidConfigError(f"cannot bind KV events {what} {endpoint!r}: {e.strerror}") from None
        return sock

    def publish(self, events: list[core.KVCacheEvent]) -> None:
        """Queue one step's events as the next batch (nothing for an empty list or after close).

        Never blocks: when the queue is full the batch is dropped, its sequence number
        left as a gap."""
        if not events or self._closed:
            return
        seq = self._next_seq
        self._next_seq = seq + 1
        try:
            self._queue.put_nowait((seq, time.time(), events))
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped & (self.num_dropped - 1) == 0:  # 1, 2, 4, 8... times
                logger.warning("KV events queue full: %d batches dropped so far", self.num_dropped)

    def close(self) -> None:
        """Send what was queued, stop the thread, close the sockets. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._queue.put(None, timeout=self.JOIN_TIMEOUT)
        except queue.Full:
            pass
        self._thread.join(self.JOIN_TIMEOUT)
        if self._thread.is_alive():  # the sockets are the thread's: leave them rather than race it
            logger.warning("KV events publisher thread did not stop in %.0f s", self.JOIN_TIMEOUT)
            return
        self._close_sockets()

    def _close_sockets(self) -> None:
        if self._pub is not None:
            self._pub.close(linger=1000)  # let connected subscribers get the last batches
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> "KVEventPublisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ publisher thread
    def _run(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        get = self._queue.get
        replay = self._replay
        while True:
            if replay is not None and replay.poll(0):
                self._serve_replay()
            try:
                item = get(timeout=0.02)
            except queue.Empty:
                continue
            if item is None:
                return
            seq, ts, events = item
            try:
                payload = encode(to_batch(events, ts, hash_form=self.hash_form))
                seq_bytes = seq.to_bytes(8, "big")
                self._pub.send_multipart((self._topic, seq_bytes, payload))
                self._buffer.append((seq, payload))
            except Exception:  # noqa: BLE001 - never let one bad batch stop the thread
                logger.exception("KV events: batch %d not published", seq)

    def _serve_replay(self) -> None:
        """Answer one replay request from the ring buffer (see the module docstring)."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            logger.warning("KV events: malformed replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        send = self._replay.send_multipart
        for seq, payload in self._buffer:
            if seq >= start_seq:
                send((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        send((client, b"", b"", END_SEQ, b""))

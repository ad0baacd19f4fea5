"""hybridkv.router.events: one replica's KV event stream delivered in order, gaps, restarts, bad input.

Publishers are our KVEventPublisher (or a raw PUB socket sending hand-made frames) on
127.0.0.1 ephemeral ports; every wait polls with a deadline.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.support.tiers import examples, slow_except

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

from hybridkv.core import events as core  # noqa: E402
from hybridkv.core.specs import FullAttentionSpec, SlidingWindowSpec  # noqa: E402
from hybridkv.errors import InvalidConfigError  # noqa: E402
from hybridkv.router.events import ReplicaEvents  # noqa: E402
from hybridkv.server.kv_events import END_SEQ, KVEventPublisher, encode_batch, to_batch  # noqa: E402

SPECS = [FullAttentionSpec(block_size=2, num_kv_heads=1, head_size=8),
         SlidingWindowSpec(block_size=2, num_kv_heads=1, head_size=8, sliding_window=4)]
TIMEOUT = 10.0


def _step(n: int) -> list:
    """One step's core events, told apart by their tokens (n, n)."""
    h = n.to_bytes(4, "big") * 8
    return [core.BlockStored((h,), (1,), None, 2, 0, "full_attention", (n, n), None),
            core.BlockStored((h,), (2,), None, 2, 1, "sliding_window", (n, n), 4)]


class Recorder:
    """The callbacks: every batch's tag (its first event's first token) and every reset, in order."""

    def __init__(self, fail_first: int = 0):
        self.log: list = []
        self.fail_first = fail_first
        self.lock = threading.Lock()

    def on_batch(self, events) -> None:
        with self.lock:
            self.log.append(events[0].token_ids[0])
            if self.fail_first > 0:
                self.fail_first -= 1
                raise RuntimeError("callback bug")

    def on_reset(self, reason: str) -> None:
        with self.lock:
            self.log.append(reason)

    def tags(self) -> list:
        with self.lock:
            return list(self.log)


def _wait(pred, timeout: float = TIMEOUT, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _events(pub, rec: Recorder, **kw) -> ReplicaEvents:
    kw.setdefault("replay_timeout", 1.0)
    return ReplicaEvents("r0", pub.endpoint, getattr(pub, "replay_endpoint", None),
                         on_batch=rec.on_batch, on_reset=rec.on_reset, **kw)


def _publisher(**kw) -> KVEventPublisher:
    kw.setdefault("replay_endpoint", "tcp://127.0.0.1:0")
    return KVEventPublisher(kw.pop("endpoint", "tcp://127.0.0.1:0"), group_specs=SPECS, **kw)


def _until_live(pub, rec: Recorder, tag: int = 1000) -> None:
    """Publish probe batches (tags tag, tag + 1, ...) until one is delivered (so all before it are)."""
    deadline = time.monotonic() + TIMEOUT
    first = tag
    while time.monotonic() < deadline:
        pub.publish(_step(tag))
        tag += 1
        try:
            _wait(lambda: any(isinstance(t, int) and first <= t < tag for t in rec.tags()), timeout=0.1)
        except AssertionError:
            continue
        _wait(lambda: tag - 1 in rec.tags(), what="the last probe")  # nothing of ours still on the way
        return
    raise AssertionError("the subscription never reached the publisher")


class Lossy:
    """Stands in for the publisher's PUB socket and loses the given sequence numbers."""

    def __init__(self, sock, lose: set[int]):
        self.sock, self.lose = sock, lose

    def send_multipart(self, frames):
        if int.from_bytes(frames[1], "big") not in self.lose:
            self.sock.send_multipart(frames)

    def __getattr__(self, name):
        return getattr(self.sock, name)


# ------------------------------------------------------------------ in order, late start
def test_batches_arrive_in_order_each_once():
    with _publisher() as pub:
        rec = Recorder()
        with _events(pub, rec) as ev:
            for n in range(30):
                pub.publish(_step(n))
                pub.publish([])  # no batch, no sequence number
            _wait(lambda: len(rec.tags()) >= 30, what="30 batches")
            time.sleep(0.2)  # nothing more (no duplicates) comes
            assert rec.tags() == list(range(30))
            assert (ev.num_batches, ev.last_seq, ev.num_resets, ev.num_bad_messages) == (30, 29, 0, 0)
            assert ev.last_message_time is not None


def test_late_subscriber_catches_up_from_the_replay():
    with _publisher() as pub:
        for n in range(5):
            pub.publish(_step(n))
        _wait(lambda: len(pub._buffer) == 5, what="the publisher to send")
        rec = Recorder()
        with _events(pub, rec) as ev:
            _wait(lambda: len(rec.tags()) >= 5, what="the replay")
            for n in range(5, 10):
                pub.publish(_step(n))
            _wait(lambda: len(rec.tags()) >= 10, what="live batches")
            time.sleep(0.2)
            assert rec.tags() == list(range(10))
            assert ev.num_replayed >= 5 and ev.num_resets == 0


def test_late_subscriber_indexes_what_the_buffer_still_holds():
    """Batches 0-5 are out of a 3-batch buffer: 6-8 are delivered, no reset (nothing was delivered)."""
    with _publisher(buffer_steps=3) as pub:
        for n in range(9):
            pub.publish(_step(n))
        _wait(lambda: pub._buffer and pub._buffer[-1][0] == 8, what="the publisher to send")
        rec = Recorder()
        with _events(pub, rec) as ev:
            _wait(lambda: len(rec.tags()) >= 3, what="the replay")
            time.sleep(0.1)
            assert rec.tags() == [6, 7, 8] and ev.num_resets == 0


# ------------------------------------------------------------------ gaps
def test_a_gap_is_filled_from_the_replay():
    with _publisher() as pub:
        rec = Recorder()
        with _events(pub, rec, idle_replay=None) as ev:
            _until_live(pub, rec)
            seq, probes = ev.last_seq, len(rec.tags())
            pub._pub = Lossy(pub._pub, {seq + 2, seq + 3})
            for n in range(1, 6):
                pub.publish(_step(n))
            _wait(lambda: len(rec.tags()) >= probes + 5, what="the batches after the gap")
            time.sleep(0.1)
            assert rec.tags()[probes:] == [1, 2, 3, 4, 5]
            assert (ev.num_gaps_filled, ev.num_resets) == (1, 0)


@pytest.mark.parametrize("replay", slow_except([True, False], 0), ids=["buffer-too-small", "no-replay-endpoint"])
def test_an_unfillable_gap_resets(replay):
    kw = {"buffer_steps": 1} if replay else {"replay_endpoint": None}
    with _publisher(**kw) as pub:
        rec = Recorder()
        with _events(pub, rec, idle_replay=None) as ev:
            _until_live(pub, rec)
            seq, probes = ev.last_seq, len(rec.tags())
            pub._pub = Lossy(pub._pub, {seq + 2})
            for n in range(1, 5):
                pub.publish(_step(n))
            _wait(lambda: len(rec.tags()) >= probes + 4, what="the batches after the gap")
            time.sleep(0.1)
            assert rec.tags()[probes:] == [1, "gap", 3, 4]
            assert (ev.num_gaps_filled, ev.num_resets) == (0, 1)


def test_a_lost_last_batch_comes_from_the_idle_probe():
    with _publisher() as pub:
        rec = Recorder()
        with _events(pub, rec, idle_replay=0.2) as ev:
            _until_live(pub, rec)
            pub._pub = Lossy(pub._pub, {ev.last_seq + 1})
            pub.publish(_step(1))
            _wait(lambda: rec.tags()[-1:] == [1], what="the idle probe")
            assert ev.num_resets == 0


# ------------------------------------------------------------------ restarts
def _restart(pub: KVEventPublisher) -> KVEventPublisher:
    """The same endpoints, a new publisher (sequence numbers from 0)."""
    endpoint, replay = pub.endpoint, pub.replay_endpoint
    pub.close()
    deadline = time.monotonic() + TIMEOUT
    while True:
        try:
            return _publisher(endpoint=endpoint, replay_endpoint=replay)
        except InvalidConfigError:  # the port is not free yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.mark.parametrize("publish_after", slow_except([True, False], 0), ids=["new-batch", "idle"])
def test_a_restarted_replica_is_reset_and_reindexed(publish_after):
    pub = _publisher()
    rec = Recorder()
    try:
        with _events(pub, rec, idle_replay=0.2) as ev:
            for n in range(4):
                pub.publish(_step(n))
            _wait(lambda: len(rec.tags()) >= 4, what="the first stream")
            pub = _restart(pub)
            if publish_after:
                pub.publish(_step(50))
                _wait(lambda: rec.tags()[-1:] == [50], what="the new stream")
                assert rec.tags() == [0, 1, 2, 3, "restart", 50]
                assert ev.last_seq == 0
            else:  # nothing new: the idle probe finds the replay no longer holds batch 3
                _wait(lambda: rec.tags()[-1:] == ["restart"], what="the restart")
                pub.publish(_step(50))
                _wait(lambda: rec.tags()[-1:] == [50], what="the new stream")
                assert rec.tags() == [0, 1, 2, 3, "restart", 50]
            assert ev.num_resets == 1
    finally:
        pub.close()


def test_a_restart_seen_live_catches_up_the_new_stream_from_0():
    """The new publisher's first batches are lost on the way: they come from its replay."""
    pub = _publisher()
    rec = Recorder()
    try:
        with _events(pub, rec, idle_replay=None) as ev:  # no idle probe: only a live batch reveals the restart
            _until_live(pub, rec, tag=2000)
            for n in range(6):
                pub.publish(_step(n))
            _wait(lambda: rec.tags()[-1:] == [5], what="the first stream")
            before, old_next = rec.tags(), ev.last_seq + 1
            pub = _restart(pub)
            # the new stream reaches the old one's next number unseen: its first live batch has the expected
            # number, and only the check after the reconnection (replay: batch old_next - 1 differs) tells
            time.sleep(0.5)  # let the SUB reconnect (every 100 ms) so that the first live batch is old_next
            pub._pub = Lossy(pub._pub, set(range(old_next)))
            for n in range(old_next):
                pub.publish(_step(100 + n))
            _until_live(pub, rec)
            after = rec.tags()[len(before):]
            assert before[-6:] == [0, 1, 2, 3, 4, 5] and after[0] == "restart"
            assert after[1:old_next + 1] == list(range(100, 100 + old_next))
            assert after[old_next + 1:] == list(range(1000, 1000 + len(after) - old_next - 1))
            assert ev.num_resets == 1
    finally:
        pub.close()


def test_resync_resets_and_replays_from_0():
    with _publisher() as pub:
        rec = Recorder()
        with _events(pub, rec, idle_replay=None) as ev:
            for n in range(3):
                pub.publish(_step(n))
            _until_live(pub, rec)  # the startup catch-up may have come before the batches: now they are in
            n = len(rec.tags())
            assert rec.tags()[:3] == [0, 1, 2]
            ev.resync()
            _wait(lambda: len(rec.tags()) >= 2 * n + 1, what="the replay")
            assert rec.tags()[n:] == ["resync"] + rec.tags()[:n]


# ------------------------------------------------------------------ random streams, no sockets
class Offline(ReplicaEvents):
    POLL_S = 0.001  # close() at once


class ModelReplica:
    """A publisher: batches tagged uniquely, a replay buffer, restarts (a new stream from 0)."""

    def __init__(self, buffer: int):
        self.stream, self.seq, self.tag = 0, 0, 0
        self.buffer: deque = deque(maxlen=buffer)
        self.origin: dict[int, tuple[int, int]] = {}  # tag -> (stream, seq)

    def publish(self) -> list[bytes]:
        self.tag += 1
        payload = encode_batch(to_batch(_step(self.tag), ts=float(self.tag)))
        self.origin[self.tag] = (self.stream, self.seq)
        self.buffer.append((self.seq, payload))
        self.seq += 1
        return [b"", (self.seq - 1).to_bytes(8, "big"), payload]

    def origin_of(self, frames: list[bytes]) -> tuple[int, int]:
        return self.origin[int(msgspec.msgpack.decode(frames[2])[0])]

    def restart(self) -> None:
        self.stream, self.seq = self.stream + 1, 0
        self.buffer.clear()


OPS = ["publish", "publish", "publish", "lose", "live", "live", "live", "probe", "restart", "blip", "timeout"]


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.sampled_from(OPS), max_size=60), st.integers(1, 8))
def test_random_streams_keep_the_guarantee(ops, buffer):
    """Whatever is lost, restarted or replayed: between resets the callbacks see one stream's
    batches, consecutive, each once; at the end (a last batch arrived live) the newest one."""
    replica, live = ModelReplica(buffer), deque()
    rec = Recorder()
    ev = Offline("model", "tcp://127.0.0.1:9", "tcp://127.0.0.1:9", on_batch=rec.on_batch, on_reset=rec.on_reset,
                 idle_replay=None)
    ev.close()  # no thread, no sockets: the test drives the state machine
    ev._stop.clear()
    timeouts, unverified = [], []

    def request(start):
        if timeouts:
            timeouts.pop()
            unverified.append(ev._verify)  # a batch after a reconnect goes in unchecked (the documented limit)
            return None
        return [(s, p) for s, p in replica.buffer if s >= start]

    ev._request = request
    for op in ops + ["publish", "live"] * 2:
        if op == "publish":
            live.append(replica.publish())
        elif op == "lose":
            replica.publish()
        elif op == "live":
            while live:  # (drained: the end state has every live batch in)
                ev._on_message(live.popleft())
                if ops:
                    break
        elif op == "probe" and (not live or replica.buffer
                                and (replica.stream, replica.buffer[0][0]) <= replica.origin_of(live[0])):
            # the idle probe runs after a silence: nothing in flight, or (a race) what is in flight is
            # still in the replay buffer; what it delivers may then come live too (duplicates)
            ev._catch_up(None)
        elif op == "restart":
            replica.restart()
            ev._verify = True  # the SUB reconnects
        elif op == "blip":
            ev._verify = True
        elif op == "timeout":
            timeouts.append(True)
    if ops:
        while live:
            ev._on_message(live.popleft())

    log = rec.tags()
    segments = [[]]
    for t in log:
        if isinstance(t, str):
            segments.append([])
        else:
            segments[-1].append(replica.origin[t])
    for seg in segments:
        assert len(set(seg)) == len(seg)  # each batch once since the last reset (a reset may replay them)
        assert len({stream for stream, _ in seg}) <= 1 or any(unverified)  # one stream
        assert [s for _, s in seg] == list(range(seg[0][1], seg[0][1] + len(seg))) if seg else True  # consecutive
    assert segments[-1] and segments[-1][-1] == (replica.stream, replica.seq - 1)  # the newest
    if not {"restart", "blip"} & set(ops):  # (after a reconnect, a replay that no longer holds our last
        assert "restart" not in log           # batch resets as a restart: it cannot tell)
    if not {"lose", "restart", "timeout"} & set(ops) and replica.tag <= buffer:
        assert ev.num_resets == 0


# ------------------------------------------------------------------ bad input, callbacks, lifecycle
@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def test_bad_frames_are_counted_and_skipped(ctx):
    pub = ctx.socket(zmq.PUB)
    pub.bind("tcp://127.0.0.1:0")
    endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
    payload = lambda n: encode_batch(to_batch(_step(n), ts=1.0))  # noqa: E731
    rec = Recorder()
    with ReplicaEvents("raw", endpoint, on_batch=rec.on_batch, on_reset=rec.on_reset) as ev:
        seq = 0
        while not rec.tags():  # slow joiner: the first batch seen may be any
            pub.send_multipart([b"", seq.to_bytes(8, "big"), payload(seq)])
            seq += 1
            time.sleep(0.02)
        first = ev.last_seq
        pub.send_multipart([b"", (first + 1).to_bytes(8, "big")])  # 2 frames
        pub.send_multipart([b"", b"\x01\x02\x03", payload(1)])  # a 3-byte sequence number
        pub.send_multipart([b"", (first + 1).to_bytes(8, "big"), b"\xc1 not msgpack"])
        bad_event = b"\x93\x01\x91\xa3xyz\x00"  # msgpack [1, ["xyz"], 0]: a batch, but no event
        pub.send_multipart([b"", (first + 2).to_bytes(8, "big"), bad_event])
        pub.send_multipart([b"", (first + 3).to_bytes(8, "big"), payload(77)])
        _wait(lambda: rec.tags()[-1:] == [77], what="the good batch after the bad ones")
        assert ev.num_bad_messages == 4 and ev.num_resets == 0 and ev.last_seq == first + 3


def test_a_replay_that_never_answers_times_out_and_resets(ctx):
    pub = ctx.socket(zmq.PUB)
    pub.bind("tcp://127.0.0.1:0")
    mute = ctx.socket(zmq.ROUTER)  # reads requests, answers nothing
    mute.bind("tcp://127.0.0.1:0")
    payload = lambda n: encode_batch(to_batch(_step(n), ts=1.0))  # noqa: E731
    rec = Recorder()
    with ReplicaEvents("mute", pub.getsockopt_string(zmq.LAST_ENDPOINT), mute.getsockopt_string(zmq.LAST_ENDPOINT),
                       on_batch=rec.on_batch, on_reset=rec.on_reset, replay_timeout=0.2, idle_replay=None) as ev:
        seq = 0
        while not rec.tags():
            pub.send_multipart([b"", seq.to_bytes(8, "big"), payload(seq)])
            seq += 1
            time.sleep(0.05)
        pub.send_multipart([b"", (seq + 5).to_bytes(8, "big"), payload(99)])
        _wait(lambda: rec.tags()[-1:] == [99], what="the batch after the gap")
        assert rec.tags()[-2:] == ["gap", 99] and ev.num_resets == 1
        assert mute.poll(1000)  # it was asked
        # a late answer to the timed-out request is not read as the next one's
        ident = mute.recv_multipart()[0]
        mute.send_multipart([ident, b"", b"", (seq + 1).to_bytes(8, "big"), payload(55)])
        mute.send_multipart([ident, b"", b"", END_SEQ, b""])
        pub.send_multipart([b"", (seq + 8).to_bytes(8, "big"), payload(98)])
        _wait(lambda: rec.tags()[-1:] == [98], what="the next batch")
        assert 55 not in rec.tags()


def test_a_raising_callback_is_counted_and_the_stream_goes_on():
    with _publisher() as pub:
        rec = Recorder(fail_first=2)
        with _events(pub, rec) as ev:
            for n in range(5):
                pub.publish(_step(n))
            _wait(lambda: len(rec.tags()) >= 5, what="5 batches")
            assert rec.tags() == list(range(5))
            assert ev.num_callback_errors == 2 and ev.num_batches == 5 and ev._thread.is_alive()


def test_close_is_idempotent_and_prompt():
    rec = Recorder()
    # nobody listens there: the replay requests wait, close still returns at once
    ev = ReplicaEvents("down", "tcp://127.0.0.1:9", "tcp://127.0.0.1:9", on_batch=rec.on_batch,
                       on_reset=rec.on_reset, replay_timeout=30.0)
    time.sleep(0.1)
    t0 = time.monotonic()
    ev.close()
    ev.close()
    assert time.monotonic() - t0 < 1.0 and not ev._thread.is_alive()
    assert ev.last_message_time is None and rec.tags() == []


def test_bad_configuration_is_a_config_error():
    kw = dict(on_batch=print, on_reset=print)
    for endpoint in ["127.0.0.1:5557", "tcp://127.0.0.1:notaport", None]:
        with pytest.raises(InvalidConfigError):
            ReplicaEvents("x", endpoint, **kw)
    with pytest.raises(InvalidConfigError):
        ReplicaEvents("x", "tcp://127.0.0.1:9", "nope", **kw)
    with pytest.raises(InvalidConfigError):
        ReplicaEvents("x", "tcp://127.0.0.1:9", replay_timeout=0, **kw)

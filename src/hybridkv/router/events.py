"""One replica's KV event stream, in order: what keeps the router's index of that replica in sync.

:class:`ReplicaEvents` is a daemon thread with a ZMQ SUB socket connected to a
replica's publisher (``hybridkv serve --kv-events`` or vLLM: the wire format of
:mod:`hybridkv.protocol.kv_events`) and, when the replica has one, a DEALER on its
replay endpoint. It hands each batch's wire events to ``on_batch(events)``, strictly
in sequence order and each batch once, and calls ``on_reset(reason)`` whenever what
it will deliver next no longer continues what it delivered before: ``"gap"``
(batches went missing and the replay cannot give them back), ``"restart"`` (the
replica's publisher counts from 0 again; the new stream is caught up from its
replay) or ``"resync"`` (the caller asked, :meth:`ReplicaEvents.resync`; delivery
restarts from the replay). When each is raised, and how slow joiners, duplicates,
idle replicas and SUB reconnects are handled: README.md, "Reference tables",
"Replica event streams".

**The guarantee**: between two resets, the callbacks see a contiguous run of the
replica's batches, the newest ones included. An index that starts empty at each
reset, adds a block per BlockStored, removes it per BlockRemoved (and ignores the
removal of a block it never saw, never letting a count go below 0) and clears on
AllBlocksCleared therefore holds a *subset* of what the replica holds: an event it
missed can make it miss a block, never claim one that is gone. That is why a partial
history is fine. A router started after its replicas asks each replay for everything
from 0 at once; if the buffer dropped the oldest batches, it indexes the blocks
stored since (blocks whose parents came earlier stay unknown to the index), and
nothing stale. The same holds after a gap reset. With a replay endpoint every
answer, even an empty one, sets ``last_message_time``, so an idle but alive replica
never looks silent.

Usage (callbacks run in the events thread: guard shared state with a lock)::

    events = ReplicaEvents("r0", "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558",
                           on_batch=lambda evs: index.apply(evs), on_reset=lambda why: index.clear())
    ...
    if time.monotonic() - (events.last_message_time or 0) > 30: ...   # silent replica
    events.close()   # idempotent; joins the thread
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import zmq

from hybridkv.errors import InvalidConfigError
from hybridkv.protocol.kv_events import END_SEQ, decode_batch

__all__ = ["ReplicaEvents"]

logger = logging.getLogger(__name__)

_SCHEMES = ("tcp://", "ipc://", "inproc://")
_ABSENT = object()  # a replay's view of a batch it has no such number for


def _power_of_two(n: int) -> bool:
    return n & (n - 1) == 0


class ReplicaEvents:
    """A thread delivering one replica's KV event batches in order (see the module docstring).

    Public state (written by the thread, safe to read anywhere): ``last_message_time``
    (``time.monotonic()`` of the last frames from the replica, live or replay; None
    before any), ``last_seq`` (last batch delivered), ``num_batches`` (delivered),
    ``num_replayed`` (of which from the replay), ``num_gaps_filled``, ``num_resets``,
    ``num_bad_messages`` (bad frames or undecodable payloads: skipped),
    ``num_callback_errors`` (callback exceptions: logged, the batch counts as delivered).
    """

    JOIN_TIMEOUT = 5.0
    POLL_S = 0.05
    MAX_REPLAYED = 65_536

    def __init__(
        self,
        name: str,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        on_batch: Callable[[list[Any]], object],
        on_reset: Callable[[str], object],
        topic: str = "",
        replay_timeout: float = 2.0,
        idle_replay: float | None = 1.0,
        hwm: int = 100_000,
    ):
        if not (isinstance(replay_timeout, (int, float)) and replay_timeout > 0):
            raise InvalidConfigError(f"replica {name}: replay_timeout must be > 0 seconds, got {replay_timeout!r}")
        if idle_replay is not None and not (isinstance(idle_replay, (int, float)) and idle_replay > 0):
            raise InvalidConfigError(f"replica {name}: idle_replay must be > 0 seconds or None, got {idle_replay!r}")
        self.name = name
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.replay_timeout, self.idle_replay = float(replay_timeout), idle_replay
        self._on_batch, self._on_reset = on_batch, on_reset
        self._topic = topic.encode()
        self.last_message_time: float | None = None
        self.last_seq: int | None = None
        self.num_batches = self.num_replayed = self.num_gaps_filled = self.num_resets = 0
        self.num_bad_messages = self.num_callback_errors = 0
        self._expected = 0  # the sequence number wanted next
        self._fresh = True  # nothing delivered since the last reset: a hole before the next batch is no gap
        self._last_hash: int | None = None  # hash of the last payload delivered (restart check in replays)
        # seq -> hash of the batches delivered from the replay that may still come live, ascending (bounded: a
        # SUB that never receives, e.g. a wrong topic, must not grow it; a duplicate older would read as a restart)
        self._replayed: dict[int, int] = {}
        self._resync = False
        self._verify = False  # the SUB reconnected: check live batches against the replay until one matches
        self._connected = False
        self._stop = threading.Event()
        self._closed = False
        self._close_lock = threading.Lock()
        self._ctx = zmq.Context()
        self._dealer: zmq.Socket | None = None
        try:
            self._sub = self._ctx.socket(zmq.SUB)  # options and monitor first: they apply to later connections
            self._sub.setsockopt(zmq.RCVHWM, hwm)
            self._sub.setsockopt(zmq.SUBSCRIBE, self._topic)
            # (re)connections: the first batch after one may come from a restarted replica (see _on_message)
            self._monitor = self._sub.get_monitor_socket(zmq.EVENT_CONNECTED)
            self._connect(self._sub, endpoint, "endpoint")
            if replay_endpoint is not None:
                self._dealer = self._connect(self._ctx.socket(zmq.DEALER), replay_endpoint, "replay endpoint")
        except InvalidConfigError:
            self._ctx.destroy(linger=0)
            raise
        self._thread = threading.Thread(target=self._run, name=f"hybridkv-events-{name}", daemon=True)
        self._thread.start()

    def _connect(self, sock: zmq.Socket, endpoint: str, what: str) -> zmq.Socket:
        if not isinstance(endpoint, str) or not endpoint.startswith(_SCHEMES):
            raise InvalidConfigError(
                f"replica {self.name}: KV events {what} must be tcp://host:port, ipc:// or inproc://, got {endpoint!r}")
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as e:
            raise InvalidConfigError(
                f"replica {self.name}: cannot connect to KV events {what} {endpoint!r}: {e.strerror}") from None
        return sock

    # ------------------------------------------------------------ caller side
    def resync(self) -> None:
        """Ask the thread to call ``on_reset("resync")`` and deliver again from the replay's start."""
        self._resync = True

    def close(self) -> None:
        """Stop the thread (bounded wait) and close the sockets. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        self._thread.join(self.JOIN_TIMEOUT)
        if self._thread.is_alive():  # stuck in a callback: the sockets are its own, leave them
            logger.warning("replica %s: KV events thread did not stop in %.0f s", self.name, self.JOIN_TIMEOUT)
            return
        self._sub.disable_monitor()
        self._ctx.destroy(linger=0)

    def __enter__(self) -> "ReplicaEvents":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ events thread
    def _run(self) -> None:
        next_probe = 0.0 if self._dealer is not None else float("inf")  # catch up from 0 at once
        while not self._stop.is_set():
            try:
                if self._resync:
                    self._resync = False
                    self._restart("resync")
                    next_probe = 0.0 if self._dealer is not None else next_probe
                while self._monitor.poll(0):  # the SUB connected: from the second time on, maybe to a new stream
                    self._monitor.recv_multipart()
                    self._verify, self._connected = self._connected, True
                if time.monotonic() >= next_probe:
                    self._catch_up(None)
                    next_probe = float("inf") if self.idle_replay is None else time.monotonic() + self.idle_replay
                if self._sub.poll(self.POLL_S * 1000):
                    frames = self._sub.recv_multipart(zmq.NOBLOCK)
                    self.last_message_time = time.monotonic()
                    if self.idle_replay is not None:
                        next_probe = self.last_message_time + self.idle_replay
                    self._on_message(frames)
            except Exception:  # noqa: BLE001 - the thread outlives anything a replica sends
                logger.exception("replica %s: KV events thread error", self.name)
                self._stop.wait(self.POLL_S)

    def _on_message(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            return self._bad(f"{len(frames)} frames")
        seq, payload = int.from_bytes(frames[1], "big"), frames[2]
        if seq < self._expected and self._replayed.get(seq) == hash(payload):
            del self._replayed[seq]
            return  # had it from the replay
        if seq != self._expected or self._verify:
            answered, view = self._catch_up(seq)
            if self._stop.is_set():  # the replay wait was cut short by close(): not a gap
                return
            if seq < self._expected:
                if answered:  # the replay has our last batch: an old one of ours (skipped) or a dead stream's
                    return logger.debug("replica %s: stale batch %d dropped", self.name, seq)
                self._restart("restart")  # nobody to ask: numbers going backwards mean a new stream
            elif view is _ABSENT or (view is not None and view != hash(payload)):
                # the replay (the replica's stream now) has another batch seq, or ends before it: a
                # leftover of a previous stream (the replica restarted); keep checking the next ones
                return logger.debug("replica %s: batch %d of a previous stream dropped", self.name, seq)
            if view is not None or not answered:  # confirmed (or no replay: waiting would hold every batch up)
                self._verify = False
        replayed = self._replayed
        while replayed and (first := next(iter(replayed))) <= seq:  # those before never come live now
            del replayed[first]
        self._take(seq, payload)

    def _catch_up(self, stop: int | None) -> tuple[bool, object]:
        """Deliver what the replay holds from ``_expected`` on (up to ``stop``, excluded), first
        checking that it still holds the last batch delivered (else: a restart, from 0).

        Returns whether the replay answered and its view of batch ``stop``: the payload's
        hash, ``_ABSENT`` (its stream ends before), or None (it cannot tell: it holds
        nothing, or its buffer moved past ``stop``)."""
        if self._dealer is None:
            return False, None
        gap, resets = stop is not None and stop > self._expected and not self._fresh, self.num_resets
        for _ in range(2):  # a second time after finding a restart
            check = self._expected - 1 if self._last_hash is not None else None
            answer = self._request(self._expected if check is None else check)
            if answer is None:
                return False, None
            view = _ABSENT if answer else None
            if check is not None:
                same = bool(answer) and answer[0][0] == check and hash(answer[0][1]) == self._last_hash
                # the buffer moved past our last batch: assume the same stream, unless a live batch went
                # backwards or the SUB reconnected (then a reset, "restart", costs less than a wrong guess)
                moved_on = (bool(answer) and answer[0][0] > check and not self._verify
                            and (stop is None or stop >= self._expected))
                if not (same or moved_on):
                    self._restart("restart")  # the replay lacks what we had: another stream
                    continue
                if same:
                    answer = answer[1:]
            for seq, payload in answer:
                if stop is not None and seq >= stop:
                    view = hash(payload) if seq == stop else None
                    break
                if seq >= self._expected:
                    if len(self._replayed) >= self.MAX_REPLAYED:
                        del self._replayed[next(iter(self._replayed))]
                    self._replayed[seq] = hash(payload)
                    self.num_replayed += 1
                    self._take(seq, payload)
            if gap and self._expected == stop and self.num_resets == resets:
                self.num_gaps_filled += 1
            return True, view
        return False, None

    def _request(self, start: int) -> list[tuple[int, bytes]] | None:
        """The replay's batches from ``start`` on, in order; None if it did not answer in time."""
        dealer = self._dealer
        deadline = time.monotonic() + self.replay_timeout
        out: list[tuple[int, bytes]] = []
        try:
            dealer.send_multipart((b"", start.to_bytes(8, "big")), zmq.NOBLOCK)
            while not self._stop.is_set() and (left := deadline - time.monotonic()) > 0:
                if not dealer.poll(min(left, self.POLL_S) * 1000):
                    continue
                frames = dealer.recv_multipart(zmq.NOBLOCK)
                self.last_message_time = time.monotonic()
                if len(frames) != 4 or len(frames[2]) != 8:
                    self._bad(f"replay answer of {len(frames)} frames")
                elif frames[2] == END_SEQ:
                    return out
                elif frames[1].startswith(self._topic):
                    out.append((int.from_bytes(frames[2], "big"), frames[3]))
        except zmq.ZMQError as e:
            logger.warning("replica %s: replay request failed: %s", self.name, e.strerror)
        if self._stop.is_set():
            return None
        # a late answer must not be read as the next one's: start over with a new socket
        logger.debug("replica %s: no replay answer in %.1f s", self.name, self.replay_timeout)
        dealer.close(linger=0)
        self._dealer = self._ctx.socket(zmq.DEALER)
        self._dealer.connect(self.replay_endpoint)
        return None

    def _take(self, seq: int, payload: bytes) -> None:
        """Deliver batch ``seq`` (reset first if it does not follow the last one)."""
        if seq != self._expected and not self._fresh:
            logger.warning("replica %s: batches %d..%d lost", self.name, self._expected, seq - 1)
            self._reset("gap")
        self._expected, self._fresh, self.last_seq, self._last_hash = seq + 1, False, seq, hash(payload)
        try:
            events = decode_batch(payload).events
        except Exception as e:  # noqa: BLE001 - msgspec.DecodeError / ValidationError, or worse
            return self._bad(f"batch {seq} undecodable ({type(e).__name__}: {e})")
        self.num_batches += 1
        self._call(self._on_batch, events)

    def _restart(self, reason: str) -> None:
        self._reset(reason)
        self._expected, self._last_hash = 0, None
        self._replayed.clear()

    def _reset(self, reason: str) -> None:
        self.num_resets += 1
        self._fresh = True
        logger.info("replica %s: KV index reset (%s)", self.name, reason)
        self._call(self._on_reset, reason)

    def _call(self, callback: Callable[[Any], object], arg: Any) -> None:
        try:
            callback(arg)
        except Exception:  # noqa: BLE001
            self.num_callback_errors += 1
            if _power_of_two(self.num_callback_errors):
                logger.exception("replica %s: KV events callback failed (%d so far)", self.name,
                                 self.num_callback_errors)

    def _bad(self, what: str) -> None:
        self.num_bad_messages += 1
        if _power_of_two(self.num_bad_messages):
            logger.warning("replica %s: bad KV events message skipped: %s (%d so far)", self.name, what,
                           self.num_bad_messages)

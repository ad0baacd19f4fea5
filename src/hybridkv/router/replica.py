"""One replica as the router sees it: where it is, whether it is up, its load and its KV index.

    spec = ReplicaSpec.parse("http://10.0.0.2:8000,tcp://10.0.0.2:5557,tcp://10.0.0.2:5558")
    replica = Replica("r0", spec)
    replica.score(token_ids)        # hit tokens its index predicts (0 while down or stale)

``--replica URL[,EVENTS[,REPLAY]]``: the HTTP base URL, and optionally the ZMQ endpoint of
its KV events and of their replay. The index (:class:`~hybridkv.router.index.ReplicaIndex`)
is written by the replica's events thread and read by the routing decisions, under
``lock``. It is dropped (cleared) when the replica goes down, when its event stream
resets (a restart or a gap the replay could not fill) and when its events fall silent
while it serves (``stale``): a dropped index predicts no hit until events refill it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Sequence
from urllib.parse import urlsplit

from hybridkv.errors import InvalidConfigError
from hybridkv.router.index import Prompt, ReplicaIndex

__all__ = ["Replica", "ReplicaSpec"]

_ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    url: str
    events: str | None = None
    replay: str | None = None

    @classmethod
    def parse(cls, text: str) -> "ReplicaSpec":
        """``URL[,EVENTS[,REPLAY]]`` -> a spec; a malformed one is InvalidConfigError."""
        parts = [p.strip() for p in str(text).split(",")]
        if not 1 <= len(parts) <= 3 or not all(parts):
            raise InvalidConfigError(f"--replica takes URL[,EVENTS[,REPLAY]], got {text!r}")
        url = parts[0].rstrip("/")
        split = urlsplit(url)
        if split.scheme not in ("http", "https") or not split.netloc:
            raise InvalidConfigError(f"a replica URL is http(s)://host:port, got {parts[0]!r}")
        for endpoint in parts[1:]:
            if not endpoint.startswith(_ZMQ_SCHEMES):
                raise InvalidConfigError(f"a KV events endpoint is tcp://host:port (or ipc://, inproc://), got {endpoint!r}")
        return cls(url, *parts[1:])


class Replica:
    """A replica's routing state (see the module docstring)."""

    def __init__(self, name: str, spec: ReplicaSpec) -> None:
        self.name = name
        self.spec = spec
        self.index = ReplicaIndex()
        self.lock = threading.Lock()
        self.up = True  # optimistic until a probe or a request says otherwise
        self.in_flight = 0
        self.stale = False  # events fell silent while it served: index dropped until they return
        self.num_requests = 0
        self.num_failures = 0
        self.num_resets: dict[str, int] = {}
        self.last_event_time: float | None = None
        self.expect_event_by: float | None = None  # a served request should have produced events by then
        self.expect_since = 0.0  # ... events newer than this (when that request was sent)
        self.events = None  # its ReplicaEvents thread, when it publishes events

    @property
    def has_events(self) -> bool:
        return self.spec.events is not None

    # ------------------------------------------------------------ index
    def score(self, token_ids: Sequence[int] | Prompt) -> int:
        if not self.up or self.stale:
            return 0
        with self.lock:
            return self.index.score(token_ids)

    def score_full_only(self, token_ids: Sequence[int] | Prompt) -> int:
        if not self.up or self.stale:
            return 0
        with self.lock:
            return self.index.score_full_only(token_ids)

    def on_events(self, events) -> None:
        """From the events thread: apply one batch."""
        with self.lock:
            self.index.apply(events)
            self.last_event_time = time.monotonic()
            self.stale = False

    def reset_index(self, reason: str, counted: bool = True) -> None:
        """Drop everything the index holds (a restart, an unfillable gap, down, silent); ``counted``:
        in ``num_resets`` (a resync the router asked for was counted under the router's reason)."""
        with self.lock:
            self.index.clear()
            if counted:
                self.num_resets[reason] = self.num_resets.get(reason, 0) + 1

    @property
    def block_size(self) -> int | None:
        """The smallest block size among the groups its events described (None before any)."""
        with self.lock:
            sizes = [g.block_size for g in self.index.groups.values()]
        return min(sizes) if sizes else None

    @property
    def num_blocks(self) -> int:
        with self.lock:
            return self.index.num_blocks

    @property
    def num_bad_events(self) -> int:
        return self.index.num_bad_events

    def __repr__(self) -> str:
        return f"Replica({self.name}, {self.spec.url}, up={self.up}, in_flight={self.in_flight})"

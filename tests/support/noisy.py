"""A well-behaved stream beside a hostile client, measured from the client's side: the live
fair-share test and ``benchmarks/bench_serve.py --noisy-neighbour`` share it.

* :func:`stream_once`: one streamed completion; its TTFT (request sent to first content
  chunk) and the gaps between its content chunks.
* :func:`hostile_stream`: a streamed completion of many prompts; the arrival time of each
  of its chunks (a step's chunks arrive together: the gaps between bursts are the steps of
  the running batch, as the client sees them).
* :class:`Barrage`: threads sending large bodies over raw sockets, one after another,
  until stopped (``sendall`` releases the GIL: the sender costs the machine little); each
  body's answer is read when the server sends one before closing.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

__all__ = ["Barrage", "StreamTimes", "hostile_stream", "ids_body", "pct", "stream_once"]


@dataclass
class StreamTimes:
    ttft: float
    gaps: list[float] = field(default_factory=list)


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``xs``, nearest rank."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


async def stream_once(client, body: dict) -> StreamTimes:
    """Stream ``body`` (a completions request) and time its content chunks."""
    t0 = time.perf_counter()
    times: list[float] = []
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise AssertionError(f"{r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                times.append(time.perf_counter())
    if not times:
        raise AssertionError("the stream sent no chunk")
    return StreamTimes(times[0] - t0, [b - a for a, b in zip(times, times[1:])])


async def hostile_stream(client, body: dict, started=None, times: list[float] | None = None) -> list[float]:
    """Stream ``body`` (many prompts); each chunk's arrival time, appended to ``times`` as it
    comes (kept if the task is cancelled). ``started`` (an asyncio.Event) is set at the first chunk."""
    times = [] if times is None else times
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise AssertionError(f"{r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
                if started is not None:
                    started.set()
    return times


def step_gaps(times: list[float], burst: float = 0.002) -> list[float]:
    """Gaps between bursts of chunk arrivals (chunks less than ``burst`` s apart are one step's)."""
    return [b - a for a, b in zip(times, times[1:]) if b - a > burst]


def ids_body(model: str, size: int) -> bytes:
    """A completions body of about ``size`` bytes of token ids (1..99)."""
    head = json.dumps({"model": model, "max_tokens": 1})[:-1].encode() + b', "prompt": ['
    item = b"17, "
    n = max(1, (size - len(head) - 2) // len(item))
    return head + item * (n - 1) + b"17]}"


class Barrage:
    """``threads`` threads posting ``body`` to ``base_url``'s completions route back to back
    (each at most ``rate`` bodies a second; None: no pause) until :meth:`stop`; ``sent``
    bodies started, ``statuses`` the answers read."""

    def __init__(self, base_url: str, body: bytes, threads: int = 1, chunk: int = 65536,
                 rate: float | None = None) -> None:
        url = urlsplit(base_url)
        self.address = (url.hostname, url.port)
        self.head = (f"POST /v1/completions HTTP/1.1\r\nhost: {url.netloc}\r\ncontent-type: application/json\r\n"
                     f"content-length: {len(body)}\r\n\r\n").encode()
        self.body, self.chunk = body, chunk
        self.interval = 0.0 if rate is None else 1.0 / rate
        self.sent = 0
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def __enter__(self) -> Barrage:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(10)

    def _run(self) -> None:
        due = time.monotonic()
        while not self._stop.is_set():
            self.sent += 1
            status = self._one()
            if status is not None:
                self.statuses.append(status)
            due += self.interval
            self._stop.wait(max(0.0, due - time.monotonic()))

    def _one(self) -> int | None:
        data = memoryview(self.body)  # never copied: the sender costs the machine little
        try:
            with socket.create_connection(self.address, timeout=10) as sock:
                sock.sendall(self.head)
                for i in range(0, len(data), self.chunk):
                    if self._stop.is_set():
                        return None
                    sock.sendall(data[i:i + self.chunk])
                    if select.select([sock], [], [], 0)[0]:  # the server answered before the end
                        break
                head = sock.recv(4096)
        except OSError:  # reset after an early answer: the server closed what it would not read
            return None
        try:
            return int(head.split(b" ", 2)[1])
        except (IndexError, ValueError):
            return None

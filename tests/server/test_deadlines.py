"""Request-read deadlines and the connection cap (:mod:`hybridkv.protocol.connections`).

In-process: uvicorn on 127.0.0.1 (an ephemeral port) in a thread, a tiny ASGI app behind
:func:`limited_protocol`, raw sockets as clients (each with a timeout; every loop bounded;
the server stopped at each test's end). Live (``live``): ``hybridkv serve`` and ``hybridkv
route`` with ``--request-timeout 1``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import select
import socket
import threading
import time

import pytest

uvicorn = pytest.importorskip("uvicorn")

from hybridkv.errors import InvalidConfigError  # noqa: E402
from hybridkv.protocol.connections import ConnectionLimits, limited_protocol  # noqa: E402

TIMEOUT = 0.5  # the request deadline of the in-process tests, seconds
SLACK = 2.0  # how late past a deadline a close may come on a busy machine
GET = b"GET /hello HTTP/1.1\r\nHost: t\r\n\r\n"


class App:
    """``/stream``: 8 chunks 0.15 s apart; ``/early``: 200 without reading the body; anything
    else reads the whole body and answers its length. ``disconnects``: paths whose body read
    ended in ``http.disconnect``."""

    def __init__(self) -> None:
        self.disconnects: list[str] = []

    async def __call__(self, scope, receive, send) -> None:
        path = scope["path"]
        if path == "/stream":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            for i in range(8):
                await send({"type": "http.response.body", "body": f"chunk{i};".encode(), "more_body": True})
                await asyncio.sleep(0.15)
            await send({"type": "http.response.body", "body": b"end"})
            return
        size = 0
        if path != "/early":
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    self.disconnects.append(path)
                    return
                size += len(message.get("body", b""))
                if not message.get("more_body"):
                    break
        body = json.dumps({"bytes": size}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


@contextlib.contextmanager
def running(limits: ConnectionLimits, keep_alive: float = 5.0):
    """(port, app, server): uvicorn in a thread with our protocol; stopped on exit."""
    app = App()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    config = uvicorn.Config(app, http=limited_protocol(limits), lifespan="off", log_level="critical",
                            timeout_keep_alive=keep_alive, timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        assert _wait(lambda: server.started, 10), "the server did not start"
        yield sock.getsockname()[1], app, server
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
        assert not thread.is_alive(), "the server did not stop"


def _wait(predicate, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return bool(predicate())


def _connect(port: int, timeout: float = 5.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.settimeout(timeout)
    return s


def _read_to_close(s: socket.socket, limit: float = TIMEOUT + SLACK) -> bytes:
    """Everything until the server closes (fails past ``limit`` seconds)."""
    s.settimeout(limit)
    out = b""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk
    raise AssertionError(f"still open after {limit} s; got {out!r}")


def _read_response(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One Content-Length response off a kept-alive connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"closed mid-response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    status, headers = _parse_head(head)
    while len(body) < int(headers["content-length"]):
        chunk = s.recv(65536)
        assert chunk, "closed mid-body"
        body += chunk
    return status, headers, body


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    headers = dict((k.strip().lower(), v.strip()) for k, v in (line.split(":", 1) for line in lines[1:]))
    return int(lines[0].split()[1]), headers


def _error(raw: bytes, status: int) -> dict:
    """The one response in ``raw``: ``status``, closing, its JSON error body, exact length."""
    head, body = raw.split(b"\r\n\r\n", 1)
    got, headers = _parse_head(head)
    assert got == status, raw
    assert headers["connection"] == "close" and int(headers["content-length"]) == len(body), raw
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


# ------------------------------------------------------------------ the request deadline
def test_a_silent_connection_gets_408_at_the_deadline():
    with running(ConnectionLimits(request_timeout=TIMEOUT)) as (port, _, _):
        s = _connect(port)
        start = time.monotonic()
        raw = _read_to_close(s)
        elapsed = time.monotonic() - start
        s.close()
    assert _error(raw, 408)["type"] == "invalid_request_error"
    assert TIMEOUT - 0.05 <= elapsed < TIMEOUT + SLACK


def test_slowloris_headers_get_408():
    with running(ConnectionLimits(request_timeout=TIMEOUT)) as (port, _, _):
        s = _connect(port)
        start = time.monotonic()
        header = b"GET /hello HTTP/1.1\r\nHost: t\r\nX-Slow: " + b"a" * 100
        for byte in header:  # one byte per 0.1 s, until the server answers (at most 10 s)
            if select.select([s], [], [], 0.1)[0]:
                break
            s.sendall(bytes([byte]))
        raw = _read_to_close(s)
        elapsed = time.monotonic() - start
        s.close()
    _error(raw, 408)
    assert elapsed < TIMEOUT + SLACK


def test_a_body_shorter_than_its_content_length_gets_408_and_the_app_sees_a_disconnect():
    with running(ConnectionLimits(request_timeout=TIMEOUT)) as (port, app, _):
        s = _connect(port)
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 110\r\n\r\n" + b"x" * 10)
        raw = _read_to_close(s)
        s.close()
        assert _wait(lambda: app.disconnects == ["/echo"], 2), app.disconnects
    _error(raw, 408)


def test_after_an_early_response_a_late_body_closes_without_a_second_response():
    with running(ConnectionLimits(request_timeout=TIMEOUT)) as (port, _, _):
        s = _connect(port)
        s.sendall(b"POST /early HTTP/1.1\r\nHost: t\r\nContent-Length: 110\r\n\r\n" + b"x" * 10)
        raw = _read_to_close(s)
        s.close()
    assert raw.startswith(b"HTTP/1.1 200 ") and raw.count(b"HTTP/1.1") == 1, raw


def test_a_body_dribbled_within_the_deadline_is_served():
    with running(ConnectionLimits(request_timeout=TIMEOUT)) as (port, app, _):
        s = _connect(port)
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\n")
        for byte in b"hello":
            time.sleep(0.03)
            s.sendall(bytes([byte]))
        status, _, body = _read_response(s)
        s.close()
    assert (status, json.loads(body)) == (200, {"bytes": 5}) and app.disconnects == []


def test_the_deadline_restarts_per_request_and_idle_keep_alive_closes():
    keep_alive = 1.5
    with running(ConnectionLimits(request_timeout=TIMEOUT), keep_alive=keep_alive) as (port, _, _):
        s = _connect(port)
        s.sendall(GET)
        assert _read_response(s)[0] == 200
        time.sleep(TIMEOUT + 0.3)  # the connection is older than the deadline; request 2 is not
        s.sendall(GET)
        assert _read_response(s)[0] == 200
        start = time.monotonic()
        rest = _read_to_close(s, keep_alive + SLACK)
        s.close()
    assert rest == b""  # closed quietly by keep-alive, no 408
    assert time.monotonic() - start >= keep_alive - 0.1


def test_a_later_requests_deadline_runs_from_its_first_byte():
    with running(ConnectionLimits(request_timeout=TIMEOUT)) as (port, _, _):
        s = _connect(port)
        s.sendall(GET)
        assert _read_response(s)[0] == 200
        time.sleep(0.3)
        start = time.monotonic()
        s.sendall(b"GET /hello HTTP/1.1\r\n")  # and no more
        raw = _read_to_close(s)
        elapsed = time.monotonic() - start
        s.close()
    _error(raw, 408)
    assert TIMEOUT - 0.05 <= elapsed < TIMEOUT + SLACK


def test_a_stream_longer_than_the_deadline_is_not_cut():
    with running(ConnectionLimits(request_timeout=TIMEOUT)) as (port, _, _):
        s = _connect(port)
        start = time.monotonic()
        s.sendall(b"GET /stream HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        raw = _read_to_close(s, 10)
        s.close()
    assert time.monotonic() - start > TIMEOUT
    assert raw.startswith(b"HTTP/1.1 200 ") and b"chunk7;" in raw and b"end" in raw and b"408" not in raw


# ------------------------------------------------------------------ max_connections
def test_a_connection_past_max_connections_gets_503_at_once():
    with running(ConnectionLimits(request_timeout=10, max_connections=3)) as (port, _, server):
        held = [_connect(port) for _ in range(3)]
        assert _wait(lambda: len(server.server_state.connections) == 3, 5)
        s = _connect(port)
        start = time.monotonic()
        raw = _read_to_close(s, 1.0)
        assert time.monotonic() - start < 1.0
        s.close()
        err = _error(raw, 503)
        assert err["type"] == "server_overloaded" and b"retry-after: 1\r\n" in raw.lower()
        held.pop().close()
        assert _wait(lambda: len(server.server_state.connections) == 2, 5)
        s = _connect(port)
        s.sendall(GET)
        assert _read_response(s)[0] == 200
        for c in [s, *held]:
            c.close()


def test_slowloris_connections_do_not_delay_others():
    with running(ConnectionLimits(request_timeout=10)) as (port, _, server):
        slow = [_connect(port) for _ in range(20)]
        for c in slow:
            c.sendall(b"POST /echo HTTP/1.1\r\nHost: t\r\nX-Slow: a")
        assert _wait(lambda: len(server.server_state.connections) == 20, 5)
        for request in (GET, b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\nhi"):
            start = time.monotonic()
            s = _connect(port, timeout=1.0)
            s.sendall(request)
            assert _read_response(s)[0] == 200
            assert time.monotonic() - start < 1.0
            s.close()
        for c in slow:
            c.close()


# ------------------------------------------------------------------ config
@pytest.mark.parametrize("kw", [dict(request_timeout=0), dict(request_timeout=-1), dict(request_timeout=float("nan")),
                                dict(request_timeout=float("inf")), dict(request_timeout=True),
                                dict(max_connections=0), dict(max_connections=1.5), dict(max_connections=True)])
def test_bad_limits_are_refused(kw):
    with pytest.raises(InvalidConfigError):
        ConnectionLimits(**kw)


def test_limited_protocol_carries_its_limits():
    limits = ConnectionLimits(request_timeout=2.5, max_connections=7)
    assert limited_protocol(limits).limits is limits
    with pytest.raises(InvalidConfigError):
        limited_protocol({"request_timeout": 1})  # type: ignore[arg-type]


# ------------------------------------------------------------------ live
def _lying_content_length(base_url: str, path: str) -> tuple[bytes, float]:
    host, port = base_url.split("//", 1)[1].rsplit(":", 1)
    s = _connect(int(port), timeout=10)
    start = time.monotonic()
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
              "Content-Length: 110\r\n\r\n{}".encode())
    raw = _read_to_close(s, 10)
    s.close()
    return raw, time.monotonic() - start


def _check_live(process, path: str, health: tuple[int, ...]) -> None:
    """A lying Content-Length on ``path`` gets 408 in 1-3 s; ``/health`` answers ``health`` within
    1 s (one of ``health``) meanwhile; the process logs no traceback."""
    import httpx

    result: list = []
    t = threading.Thread(target=lambda: result.append(_lying_content_length(process.base_url, path)), daemon=True)
    t.start()
    with httpx.Client(base_url=process.base_url, timeout=5) as client:
        time.sleep(0.2)  # the lying request is open
        start = time.monotonic()
        assert client.get("/health").status_code in health
        assert time.monotonic() - start < 1.0
    t.join(15)
    assert result, "the lying request got no answer"
    raw, elapsed = result[0]
    _error(raw, 408)
    assert 0.9 <= elapsed < 3.0
    time.sleep(0.3)  # anything the app logs on the disconnect
    assert "Traceback" not in process.stderr and "Exception" not in process.stderr, process.stderr


@pytest.mark.live
def test_serve_times_out_a_lying_content_length(serve):
    server = serve("--request-timeout", "1", "--max-connections", "8")
    _check_live(server, "/v1/completions", (200,))


@pytest.mark.live
def test_route_times_out_a_lying_content_length():
    from tests.support.processes import HybridkvProcess, free_port

    router = HybridkvProcess(["--port", "0", "--replica", f"http://127.0.0.1:{free_port()}", "--health-interval", "0.5",
                              "--request-timeout", "1", "--max-connections", "8"], command="route")
    try:
        _check_live(router, "/v1/completions", (200, 503))  # 503 once a probe finds its replica down
    finally:
        router.kill()


# ------------------------------------------------------------------ shutdown
def test_shutdown_closes_requests_still_arriving_and_lets_complete_ones_finish():
    """uvicorn's shutdown begins: a request whose body is half sent gets 503 and is closed at
    once (its app sees a disconnect), a stream in flight runs to its end, an idle kept-alive
    connection closes; all well inside the request deadline."""
    with running(ConnectionLimits(request_timeout=30)) as (port, app, server):
        half = _connect(port)
        half.sendall(b"POST /half HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n0123456789")
        stream = _connect(port)
        stream.sendall(b"GET /stream HTTP/1.1\r\nHost: t\r\n\r\n")
        idle = _connect(port)
        idle.sendall(GET)
        assert _read_response(idle)[0] == 200
        assert _wait(lambda: len(server.server_state.connections) == 3, 5)
        t0 = time.monotonic()
        server.should_exit = True  # what a signal does: the serve loop begins the shutdown
        err = _error(_read_to_close(half, 3.0), 503)
        assert err["type"] == "server_overloaded" and "shutting down" in err["message"]
        assert time.monotonic() - t0 < 2.0
        assert _wait(lambda: app.disconnects == ["/half"], 3)
        assert _read_to_close(idle, 3.0) == b""
        streamed = _read_to_close(stream, 5.0)
        assert b"chunk7;" in streamed and streamed.endswith(b"0\r\n\r\n")  # the whole chunked body

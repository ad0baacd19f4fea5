"""Per-connection limits for ``hybridkv serve`` and ``hybridkv route``: a request-read
deadline and a cap on open connections, as an h11 protocol for uvicorn.

    uvicorn.Config(app, http=limited_protocol(ConnectionLimits(request_timeout=30, max_connections=1024)))

Contract (uvicorn alone never times out reading a request: its keep-alive timer runs only
between requests and stops at the next request's first byte):

* **request deadline**: a request starts when its connection is made (the first request)
  or with its first byte (a later request on a keep-alive connection; a pipelined one when
  the response before it completes). Its headers and whole body must have arrived (h11's
  ``their_state`` leaves IDLE / SEND_BODY) within ``request_timeout`` seconds. Past it, with
  no response begun, the client gets ``408`` with OpenAI's error body and
  ``Connection: close``; the connection closes either way. An app already awaiting the
  body sees ``http.disconnect`` and its later sends are dropped. A complete request's
  deadline is cancelled: the response (a stream of any length) is never cut by it.
* **keep-alive**: between requests, a connection idle for uvicorn's ``timeout_keep_alive``
  closes (uvicorn's rule, kept; also armed when a body ends after an early response).
* **max_connections**: a connection made while ``max_connections`` are open gets ``503``
  (``Retry-After: 1``, ``Connection: close``) at once and is closed; no app runs.
* **shutdown**: when the server begins to shut down, a request whose body has not all
  arrived can never be admitted: its connection gets ``503`` (no response begun) and is
  closed at once, the app awaiting the body sees ``http.disconnect``. uvicorn's own rule
  for the rest is kept: idle connections close, requests in flight finish (no keep-alive).

Timers are cancelled when the connection is lost; nothing here writes a traceback.

A worked timeline, ``request_timeout=30``, ``timeout_keep_alive=5``::

    t=0    connect                     deadline armed (request 1)
    t=2    headers, Content-Length 100 app starts, awaits the body
    t=3    60 body bytes               (deadline still t=30)
    t=30   deadline                    app sees disconnect; client gets 408, closed

    t=0    connect; t=1 full request   deadline cancelled at t=1; app streams until t=90
    t=90   response complete           keep-alive timer (closes at t=95 if idle)
    t=93   first byte of request 2     keep-alive cancelled, deadline armed for t=123
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from http import HTTPStatus

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from hybridkv.errors import InvalidConfigError
from hybridkv.protocol.errors import error_body

__all__ = ["ConnectionLimits", "LimitedH11Protocol", "limited_protocol"]

log = logging.getLogger("hybridkv.server")


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """``request_timeout``: seconds (finite, > 0) from a request's start until all of it has
    arrived; ``max_connections``: connections open at once (>= 1); see the module docstring."""

    request_timeout: float = 30.0
    max_connections: int = 1024

    def __post_init__(self) -> None:
        t = self.request_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and t > 0):
            raise InvalidConfigError(f"request_timeout must be a finite number > 0, got {t!r}")
        n = self.max_connections
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidConfigError(f"max_connections must be an int >= 1, got {n!r}")


def _raw_response(status: int, message: str, type_: str, *extra: str) -> bytes:
    """A whole HTTP/1.1 error response that closes the connection, OpenAI's body in it."""
    body = json.dumps(error_body(message, type_)).encode()
    head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", "content-type: application/json",
            f"content-length: {len(body)}", "connection: close", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with :class:`ConnectionLimits` (``limits``, set by
    :func:`limited_protocol`)."""

    limits: ConnectionLimits = ConnectionLimits()

    def __init__(self, *args, **kwargs) -> None:
        self._requests = 0  # requests whose headers arrived (each made a new cycle)
        self._deadline = None  # asyncio.TimerHandle of the request being read
        self._deadline_request = -1  # which request (index) the deadline is for
        self._refused = False
        super().__init__(*args, **kwargs)

    # uvicorn makes a new cycle for each request's headers: count them
    @property
    def cycle(self):
        return self.__dict__.get("_cycle")

    @cycle.setter
    def cycle(self, value) -> None:
        if value is not None:
            self._requests += 1
        self.__dict__["_cycle"] = value

    def connection_made(self, transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            self._refused = True
            self.transport = transport
            log.info("503: refused a connection: %d connections open (--max-connections)", len(self.connections))
            transport.write(_raw_response(503, f"the server has {self.limits.max_connections} connections open "
                                               "(--max-connections); retry later", "server_overloaded",
                                          "retry-after: 1"))
            transport.close()
            return
        super().connection_made(transport)
        self._arm(0)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)
        self._sync()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._sync()

    # ------------------------------------------------------------------ the deadline
    def _arm(self, request: int) -> None:
        self._cancel()
        self._deadline_request = request
        self._deadline = self.loop.call_later(self.limits.request_timeout, self._expired)

    def _cancel(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _sync(self) -> None:
        """After h11 has taken in data or a response ended: arm, keep or cancel the deadline."""
        if self.transport is None or self.transport.is_closing():
            self._cancel()
            return
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            request = self._requests - 1  # its headers made the latest cycle
        elif state is h11.IDLE and (self._requests == 0 or self.conn.trailing_data[0]):
            request = self._requests  # the first request, or the next one's first bytes
        else:
            self._cancel()  # complete (DONE, MUST_CLOSE), failed, or idle between requests
            if state is h11.IDLE and self.timeout_keep_alive_task is None:
                self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                    self.timeout_keep_alive_handler)
            return
        if self._deadline is None or self._deadline_request != request:
            self._arm(request)

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        timeout = f"{self.limits.request_timeout:g}"
        log.info("408: a request did not arrive within %s s (--request-timeout)", timeout)
        self._close_unfinished(_raw_response(
            408, f"the request's headers and body did not arrive within {timeout} seconds (--request-timeout)",
            "invalid_request_error"))

    def shutdown(self) -> None:
        """The server begins to shut down (see the module docstring)."""
        cycle = self.cycle
        if (not self._refused and cycle is not None and not cycle.response_complete
                and self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing()):
            log.info("503: closed a connection whose request had not all arrived (shutting down)")
            self._cancel()
            self._close_unfinished(_raw_response(503, "the server is shutting down", "server_overloaded",
                                                 "retry-after: 1"))
            return
        super().shutdown()

    def _close_unfinished(self, response: bytes) -> None:
        """Close a connection whose request has not all arrived: the app awaiting its body
        sees ``http.disconnect``; the client gets ``response`` unless a response has begun."""
        cycle = self.cycle
        if cycle is not None and self.conn.their_state is h11.SEND_BODY and not cycle.response_complete:
            cycle.disconnected = True  # the app awaiting the body sees http.disconnect
            cycle.message_event.set()
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):  # no response begun
            self.transport.write(response)
        self.transport.close()


def limited_protocol(limits: ConnectionLimits) -> type[LimitedH11Protocol]:
    """The protocol class to pass as ``uvicorn.Config(http=...)`` for ``limits``."""
    if not isinstance(limits, ConnectionLimits):
        raise InvalidConfigError(f"limits must be a ConnectionLimits, got {type(limits).__name__}")
    return type("LimitedH11Protocol", (LimitedH11Protocol,), {"limits": limits, "__module__": __name__})

"""Request-size limit and off-loop parsing, shared by ``serve`` and ``route``.

* :class:`BodyLimit` (pure ASGI, outermost): a body larger than ``max_bytes`` is refused
  with 413 in OpenAI's error shape before anything parses it, by its ``Content-Length``
  when it declares one, else once the bytes read pass the limit (chunked uploads). With
  ``max_values``, a body whose commas outside strings pass it (:mod:`.value_count`: more
  values than any request to the server can use, e.g. 1.5M token ids) is refused with 413
  as soon as the bytes read show it, its rest unread and never parsed. A body within the
  limits is read once and replayed to the app.
* :class:`Offload`: a small, bounded pool of worker threads for the CPU work of a request
  (JSON parsing, validation, tokenization), so that a large body never stalls the event
  loop: ``/health`` and the other requests keep being answered meanwhile. At most
  ``workers`` such jobs run at once; the next ones wait without blocking the loop.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from hybridkv.errors import InvalidConfigError
from hybridkv.protocol.errors import error_body
from hybridkv.protocol.value_count import ValueCounter

__all__ = ["BodyLimit", "DEFAULT_MAX_REQUEST_BYTES", "Offload", "check_max_request_bytes", "loads_json"]

#: the default ``--max-request-bytes``: 8 MiB, ~30x a 32k-token prompt as text or as token ids
DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20

T = TypeVar("T")


def check_max_request_bytes(value: object) -> int:
    """``value`` if it is an int >= 1, else InvalidConfigError naming the option."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidConfigError(f"max_request_bytes must be an int >= 1, got {value!r}")
    return value


def too_large_body(max_bytes: int) -> bytes:
    """The 413 response's JSON body."""
    message = f"request body larger than the server's limit of {max_bytes:,} bytes (--max-request-bytes)"
    return json.dumps(error_body(message, "invalid_request_error", None, "request_too_large")).encode()


def too_many_values_body(max_values: int) -> bytes:
    """The 413 response's JSON body for a body holding more than ``max_values`` values."""
    message = (f"request body holds more than {max_values:,} JSON values, more than any request to this server "
               "can use (every prompt of a request at the model's context length in token ids, and a list of "
               "every token id)")
    return json.dumps(error_body(message, "invalid_request_error", None, "request_too_large")).encode()


class BodyLimit:
    """ASGI middleware: 413 for a body over ``max_bytes`` or ``max_values`` (see the module docstring)."""

    def __init__(self, app: Callable, max_bytes: int, max_values: int | None = None) -> None:
        self.app = app
        self.max_bytes = check_max_request_bytes(max_bytes)
        if max_values is not None and (isinstance(max_values, bool) or not isinstance(max_values, int)
                                       or max_values < 1):
            raise InvalidConfigError(f"max_values must be an int >= 1 or None, got {max_values!r}")
        self.max_values = max_values

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(send, too_large_body(self.max_bytes))
            return
        chunks: list[bytes] = []
        size = 0
        values = None if self.max_values is None else ValueCounter()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body: nobody to answer
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._refuse(send, too_large_body(self.max_bytes))
                return
            if values is not None and values.feed(body) >= self.max_values:  # k commas: k + 1 values at least
                await self._refuse(send, too_many_values_body(self.max_values))
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replay: dict | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replayed() -> dict:
            nonlocal replay
            if replay is not None:
                message, replay = replay, None
                return message
            return await receive()  # after the body: the disconnect notice

        await self.app(scope, replayed, send)

    async def _refuse(self, send: Callable, body: bytes) -> None:
        await send({
            "type": "http.response.start",
            "status": 413,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                        (b"connection", b"close")],
        })
        await send({"type": "http.response.body", "body": body})


def _content_length(scope: dict) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def loads_json(raw: bytes) -> Any:
    """``json.loads`` that says why it failed: ValueError (malformed, or nested too deeply)."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("malformed JSON body: nested too deeply") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError("malformed JSON body") from None


class Offload:
    """At most ``workers`` CPU jobs at once on worker threads (see the module docstring)."""

    def __init__(self, workers: int = 2, name: str = "hybridkv-parse") -> None:
        self.workers = workers
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self._slots: asyncio.Semaphore | None = None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a worker thread; its exception propagates."""
        if self._slots is None:  # made on the loop that uses it
            self._slots = asyncio.Semaphore(self.workers)
        async with self._slots:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

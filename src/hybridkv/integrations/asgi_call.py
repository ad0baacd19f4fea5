"""An ASGI app called in-process: its lifespan, and requests whose responses stream out.

Ray Serve's replica deployment (:mod:`hybridkv.integrations.ray_serve`) runs
:func:`hybridkv.server.build_app`'s app this way, so that every route, check, error and
stream is ``serve``'s own, without a socket. Framework-free (the ASGI 3 protocol only)::

    runner = ASGIRunner(app)
    await runner.start()                                    # lifespan startup (the engine thread)
    async for part in runner.request("POST", "/v1/completions", [("content-type", "application/json")], body):
        ...   # first a ResponseStart(status, headers), then the body's bytes, in the chunks the app sent
    await runner.stop()                                     # lifespan shutdown (requests aborted, pool checked)

Leaving the ``async for`` early (the caller's client went away: ``aclose()`` or a
cancellation) tells the app the client disconnected (``http.disconnect``), which aborts the
request's engine work as a dropped HTTP client would; the app's task is then awaited for at
most :data:`DISCONNECT_WAIT` seconds.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, AsyncIterator, Sequence

from hybridkv.errors import EngineFailedError

__all__ = ["ASGIRunner", "ResponseStart", "DISCONNECT_WAIT"]

#: seconds a request's app task may take to finish after its caller left
DISCONNECT_WAIT = 10.0


@dataclass(frozen=True, slots=True)
class ResponseStart:
    status: int
    headers: tuple[tuple[str, str], ...]


class ASGIRunner:
    """One ASGI app, driven in-process (see the module docstring)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.state: dict = {}
        self._lifespan: asyncio.Task | None = None
        self._to_app: asyncio.Queue | None = None
        self._from_app: asyncio.Queue | None = None

    async def start(self) -> None:
        """Run the lifespan's startup; EngineFailedError if the app reports it failed."""
        self._to_app, self._from_app = asyncio.Queue(), asyncio.Queue()
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": self.state}
        self._lifespan = asyncio.create_task(self.app(scope, self._to_app.get, self._from_app.put))
        await self._to_app.put({"type": "lifespan.startup"})
        await self._expect("lifespan.startup.complete")

    async def stop(self) -> None:
        """Run the lifespan's shutdown (idempotent; nothing if never started)."""
        if self._lifespan is None:
            return
        task, self._lifespan = self._lifespan, None
        await self._to_app.put({"type": "lifespan.shutdown"})
        try:
            await self._expect("lifespan.shutdown.complete")
        finally:
            await asyncio.wait({task}, timeout=DISCONNECT_WAIT)

    async def _expect(self, kind: str) -> None:
        message = await self._from_app.get()
        if message.get("type") != kind:
            raise EngineFailedError(f"the app's lifespan answered {message.get('type')!r}: {message.get('message', '')}")

    async def request(self, method: str, path: str, headers: Sequence[tuple[str, str]],
                      body: bytes = b"", query: str = "") -> AsyncIterator[ResponseStart | bytes]:
        """The response to one request: a :class:`ResponseStart`, then its body in chunks."""
        out: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        read = False

        async def receive() -> dict:
            nonlocal read
            if not read:
                read = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": method.upper(), "scheme": "http", "path": path, "raw_path": path.encode(),
            "query_string": query.encode(), "root_path": "", "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
            "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers], "state": dict(self.state),
        }
        task = asyncio.create_task(self.app(scope, receive, out.put))
        task.add_done_callback(lambda _: out.put_nowait(None))
        try:
            while True:
                message = await out.get()
                if message is None:  # the app returned (or raised) without finishing the body
                    if not task.cancelled() and task.exception() is not None:
                        raise EngineFailedError(f"the app failed: {task.exception()!r:.200}")
                    return
                if message["type"] == "http.response.start":
                    yield ResponseStart(message["status"], tuple(
                        (k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", ())))
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body", False):
                        return
        finally:
            gone.set()  # a caller that left early: the app sees its client disconnect
            if not task.done():
                await asyncio.wait({task}, timeout=DISCONNECT_WAIT)

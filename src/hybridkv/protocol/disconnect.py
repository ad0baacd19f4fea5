"""Stop the work of a client that went away: one helper for ``serve`` and ``route``.

    result = await until_done_or_gone(request, serving.completions(body))
    if result is None:          # the client disconnected; the work was cancelled
        return Response(status_code=499)

A non-streaming answer is computed before anything is sent, so nothing on the wire tells
the server that its client left; the ASGI server does (``http.disconnect``), and
:func:`until_done_or_gone` asks it every :data:`POLL_SECONDS` while the work runs. On
``serve`` the cancelled work aborts its engine requests (their blocks are freed before the
next step); on ``route`` it closes the connection to the replica, whose server then aborts
them in turn. Framework-free: ``request`` is anything with an awaitable
``is_disconnected()`` (Starlette's ``Request``).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Awaitable, Protocol

__all__ = ["POLL_SECONDS", "until_done_or_gone"]

#: how often a waiting request asks whether its client is still there (seconds): the
#: longest a departed client's work goes on before it is cancelled
POLL_SECONDS = 0.25


class _Disconnectable(Protocol):
    async def is_disconnected(self) -> bool: ...


async def until_done_or_gone(request: _Disconnectable, work: Awaitable[Any], poll: float = POLL_SECONDS) -> Any:
    """``await work`` (a coroutine or future, which must not return None), run as its own task;
    if ``request``'s client disconnects first, cancel it, wait for its cleanup (its ``finally``
    blocks, an ``except CancelledError``) and return None. An exception of ``work`` propagates.
    If the caller is cancelled, ``work`` is cancelled too (its cleanup then runs on its own).

    Read the request's body before calling: ``is_disconnected()`` consumes ASGI messages."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return None
    finally:
        if not task.done():
            task.cancel()

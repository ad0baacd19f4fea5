"""The event loop's side of :class:`~hybridkv.server.async_llm.AsyncLLM`: a submission and its chunks.

    sub = await front.submit([ids_a, ids_b], [sp, sp])
    async for chunk in sub:         # Chunk(index, text, token_ids, logprobs, final, error, ...)
        ...
    sub.close()                     # the client left: abort what still runs (idempotent)

A :class:`Submission` is one HTTP request: one or more prompts that share one
``asyncio.Queue`` (each :class:`Chunk` carries its prompt's index); ``n`` samples of a
prompt are ``n`` prompts in a row (its prompt is computed once: see
:meth:`~hybridkv.sampling_params.SamplingParams.samples`). Each prompt's stream ends with
one chunk that has ``final`` (its :class:`~hybridkv.engine.llm.CompletionOutput`) or
``error`` (an engine failure); iteration stops once every prompt's has come.
:meth:`Submission.close` hands the submission to the ``abort`` callable it was made with
(the front queues an abort for the engine thread, which frees its blocks before its
next step); chunks that arrive after it are dropped.

Everything here runs on the event loop. The engine thread reaches it only through
``loop.call_soon_threadsafe`` with :func:`deliver` (one call per step, carrying every
chunk of the step) and :func:`settle` (the answer to a command that waits on a future).
It imports neither :mod:`~hybridkv.server.async_llm` nor :mod:`~hybridkv.server.live_requests`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Callable

from hybridkv.engine.llm import CompletionOutput

__all__ = ["Chunk", "Submission", "TokenLogprob", "deliver", "settle"]


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One sampled token's log-probability and the top alternatives ``(token_id, logprob)``."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True, slots=True)
class Chunk:
    """What one prompt of a submission produced in one step. ``final`` is set in its last
    chunk; ``error`` (an engine failure) ends it with no ``final``."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None
    final: CompletionOutput | None = None
    error: BaseException | None = None
    #: the prompt's scores (``SamplingParams.prompt_logprobs``), in the prompt's first chunk
    prompt_logprobs: tuple | None = None


class Submission:
    """The prompts of one HTTP request in the engine; iterate it for their chunks.
    ``abort(sub)`` is called once, by :meth:`close`, while some prompt has not ended;
    ``on_close()`` once, at whichever comes first: :meth:`close`, or the last prompt's end
    reaching the event loop (so a response whose reader never started still calls it)."""

    def __init__(self, abort: Callable[[Submission], None], num_prompts: int,
                 on_close: Callable[[], None] | None = None) -> None:
        self._abort = abort
        self._on_close = on_close
        self.num_delivered_ends = 0  # prompts whose final or error chunk reached the queue
        self.queue: asyncio.Queue[Chunk] = asyncio.Queue()
        self.request_ids: list[str] = []  # set by the engine thread when it adds them
        self.num_prompts = num_prompts
        self.num_finished = 0
        self.closed = False

    @property
    def done(self) -> bool:
        return self.num_finished == self.num_prompts

    def __aiter__(self) -> Submission:
        return self

    async def __anext__(self) -> Chunk:
        if self.done:
            raise StopAsyncIteration
        chunk = await self.queue.get()
        if chunk.final is not None or chunk.error is not None:
            self.num_finished += 1
        return chunk

    def close(self) -> None:
        """Abort what still runs (the client left, or the handler ended early). Idempotent."""
        if not self.closed:
            self.closed = True
            if not self.done:
                self._abort(self)
            self.release()

    def release(self) -> None:
        """Call ``on_close`` unless it was (idempotent)."""
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()


def deliver(items: list[tuple[Submission, Chunk]]) -> None:
    """On the event loop: one step's chunks into their submissions' queues (a closed one's
    dropped); a submission whose every prompt has ended is released (``on_close``)."""
    for sub, chunk in items:
        if chunk.final is not None or chunk.error is not None:
            sub.num_delivered_ends += 1
            if sub.num_delivered_ends == sub.num_prompts:
                sub.release()
        if not sub.closed:
            sub.queue.put_nowait(chunk)


def settle(fut: asyncio.Future, error: BaseException | None, value: Any = None) -> None:
    """On the event loop: a command's answer (``error``, else ``value``) into its future, unless done."""
    if not fut.done():
        if error is None:
            fut.set_result(value)
        else:
            fut.set_exception(error)

"""An asyncio front over one :class:`~hybridkv.engine.llm.LLM`: one engine thread, per-request queues.

    front = AsyncLLM(llm, max_waiting=256)
    front.start()                                   # inside the running event loop
    sub = await front.submit([ids], [SamplingParams(max_tokens=8)])
    async for chunk in sub:                         # Chunk(index, text, token_ids, ..., final)
        ...
    await front.shutdown()                          # every block of the pool free again

The engine thread owns the engine: nothing else touches it. The event loop talks to it
only through commands (add, abort, abort all, stop) in an inbox the thread drains before
every step, and it answers through ``loop.call_soon_threadsafe``: once per step, one
call carries every request's :class:`Chunk` to its submission's ``asyncio.Queue``. The
thread steps while any request is unfinished and sleeps on an event otherwise. Model
compute runs outside the event loop, so streaming and new connections stay responsive.

A submission is one HTTP request: one or more prompts that share a queue (chunks carry
the prompt's index); ``n`` samples of a prompt are ``n`` of them in a row (its prompt is
computed once: see :meth:`~hybridkv.sampling_params.SamplingParams.samples`). Its prompts are added to the engine together or not at all: a bad
one (too long, a pool that can never hold it) fails the whole submission with the
engine's typed error, before any chunk. :meth:`Submission.close` (a client that went
away) aborts whatever of it still runs: the engine frees its blocks before its next step.

Admission is bounded: a submission that would make more than ``max_waiting`` requests
wait (queued in the scheduler, or submitted but not yet taken in by the thread) gets
:class:`~hybridkv.errors.ServiceUnavailableError`, as does every submission after
:meth:`AsyncLLM.close_admission` (SIGTERM).

Text comes from the request's :class:`~hybridkv.engine.llm.TextStream` (incremental
detokenizer, stop strings) in the engine thread; a stop string aborts the request at
once, as :meth:`LLM.stream` does. With ``logprobs`` the chunk carries, per new token,
its log-probability under the model's raw distribution (before temperature, vLLM's
default) and the ``logprobs`` most likely alternatives.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

from hybridkv.engine.llm import LLM, CompletionOutput, TextStream
from hybridkv.errors import EngineFailedError, HybridKVError, InvalidArgumentError, ServiceUnavailableError
from hybridkv.protocol.openai import wire_finish_reason
from hybridkv.sampling_params import SamplingParams

__all__ = ["AsyncLLM", "Chunk", "Submission", "TokenLogprob"]

log = logging.getLogger("hybridkv.server")


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
    """The prompts of one HTTP request in the engine; iterate it for their chunks."""

    def __init__(self, front: "AsyncLLM", num_prompts: int) -> None:
        self._front = front
        self.queue: asyncio.Queue[Chunk] = asyncio.Queue()
        self.request_ids: list[str] = []  # set by the engine thread when it adds them
        self.num_prompts = num_prompts
        self.num_finished = 0
        self.closed = False

    @property
    def done(self) -> bool:
        return self.num_finished == self.num_prompts

    def __aiter__(self) -> "Submission":
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
                self._front._command(("abort", self))


class _Live:
    """The engine thread's record of one running request."""

    __slots__ = ("sub", "index", "text", "num_logprobs", "token_times")

    def __init__(self, sub: Submission, index: int, text: TextStream, num_logprobs: int | None) -> None:
        self.sub, self.index, self.text = sub, index, text
        self.num_logprobs = num_logprobs
        self.token_times: list[float] = []


class AsyncLLM:
    """See the module docstring. ``metrics`` (``on_step(engine)``, ``on_request_finished(rec)``)
    and ``kv_publisher`` (``publish(events)``, ``close()``) are called from the engine thread."""

    def __init__(
        self,
        llm: LLM,
        *,
        max_waiting: int = 256,
        retry_after: int = 1,
        metrics: Any = None,
        kv_publisher: Any = None,
    ) -> None:
        self.llm = llm
        self.engine = llm.engine
        self.max_waiting = max_waiting
        self.retry_after = retry_after
        self.metrics = metrics
        self.kv_publisher = kv_publisher
        self._inbox: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._lock = threading.Lock()  # guards the counters below
        self._pending = 0  # prompts submitted, not yet taken in by the thread
        self._waiting = 0  # the scheduler's waiting queue after the last step
        self._live: dict[str, _Live] = {}
        self._accepting = True
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = 0
        self.num_engine_errors = 0

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the engine thread; call from inside the event loop that will read the chunks."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="hybridkv-engine", daemon=True)
        self._thread.start()

    @property
    def accepting(self) -> bool:
        return self._accepting

    def close_admission(self) -> None:
        """Refuse every new submission from now on (503), e.g. on SIGTERM. Thread- and signal-safe."""
        self._accepting = False

    def abort_all(self) -> None:
        """Abort every request queued or running (their streams end with ``abort``)."""
        self._command(("abort_all",))

    @property
    def num_unfinished(self) -> int:
        """Requests submitted and not yet finished (as the engine thread last saw them)."""
        with self._lock:
            return self._pending + len(self._live)

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no request is unfinished; False if ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.num_unfinished:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def shutdown(self, drain_timeout: float = 0.0) -> tuple[int, int]:
        """Stop admission, let what runs finish for up to ``drain_timeout`` seconds, abort
        the rest, stop the thread. Returns (free blocks, usable blocks) of the pool after,
        having checked the manager's invariants."""
        self.close_admission()
        if drain_timeout > 0:
            await self.wait_idle(drain_timeout)
        self.abort_all()
        await self.wait_idle(10.0)
        if self._thread is not None:
            self._command(("stop",))
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30.0)
            self._thread = None
        if self.kv_publisher is not None:
            self.kv_publisher.close()
        kv = self.engine.kv
        kv.check_invariants()
        usage = kv.pool_usage()
        return usage.free, usage.usable

    # ------------------------------------------------------------ requests
    async def submit(
        self,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        *,
        logprobs: int | None = None,
        request_id: str | None = None,
    ) -> Submission:
        """Queue ``prompts`` (token ids, one ``params`` each) as one submission; returns once
        the engine thread has added them all, or raises its typed error (none added). The
        engine's request ids are ``{request_id}-{i}`` per prompt (a response's id, as vLLM
        names them; unique per submission), or ``req-{n}``."""
        if len(prompts) != len(params) or not prompts:
            raise InvalidArgumentError(f"{len(params)} sampling params for {len(prompts)} prompts")
        if not self._accepting:
            raise ServiceUnavailableError("the server is shutting down", retry_after=self.retry_after)
        with self._lock:
            waiting = self._pending + self._waiting
            if waiting + len(prompts) > self.max_waiting:
                raise ServiceUnavailableError(
                    f"the server's waiting queue is full ({waiting} of {self.max_waiting} requests waiting)",
                    retry_after=self.retry_after,
                )
            self._pending += len(prompts)
        sub = Submission(self, len(prompts))
        added: asyncio.Future = asyncio.get_running_loop().create_future()
        self._command(("add", sub, [list(p) for p in prompts], list(params), logprobs, request_id, added))
        try:
            await asyncio.shield(added)
        except asyncio.CancelledError:
            sub.close()  # the add still happens; the abort queued after it undoes it
            raise
        return sub

    async def peek_prefix_hit(self, token_ids: Sequence[int]) -> int:
        """Tokens of ``token_ids`` the engine's prefix cache would give a new request now
        (asked in the engine thread, between steps; nothing is queued or counted)."""
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._command(("peek", list(token_ids), fut))
        return await fut

    # ------------------------------------------------------------ the thread
    def _command(self, cmd: tuple) -> None:
        self._inbox.append(cmd)
        self._wake.set()

    def _send(self, items: list[tuple[Submission, Chunk]]) -> None:
        """Hand chunks to their queues on the event loop (one call for the whole step)."""
        if items and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(_deliver, items)

    def _resolve(self, fut: asyncio.Future, error: BaseException | None, value: Any = None) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(_settle, fut, error, value)

    def _run(self) -> None:
        while True:
            try:
                if self._once():
                    return
            except Exception as exc:  # a bug outside the model run (the engine rolls those back): fail what runs
                self.num_engine_errors += 1
                log.exception("engine step failed; aborting %d requests", len(self._live))
                self._fail_all(exc)

    def _once(self) -> bool:
        """Take the inbox in, then one step (or sleep until a command comes); True: stop."""
        engine = self.engine
        stop = self._drain_inbox()
        busy = engine.has_unfinished_requests()
        if stop and not busy:
            return True
        if not busy:
            self._publish_and_measure()
            self._wake.wait()
            self._wake.clear()
            return False
        self._dispatch(engine.step_deltas(self._publish_events))
        self._publish_and_measure()
        return False

    def _drain_inbox(self) -> bool:
        stop = False
        while self._inbox:
            cmd = self._inbox.popleft()
            kind = cmd[0]
            if kind == "add":
                self._add(*cmd[1:])
            elif kind == "abort":
                self._abort([rid for rid in cmd[1].request_ids if rid in self._live])
            elif kind == "peek":
                self._peek(*cmd[1:])
            elif kind == "abort_all":
                self._abort(list(self._live))
            elif kind == "stop":
                stop = True
        with self._lock:
            self._waiting = self.engine.scheduler.num_waiting
        return stop

    def _add(self, sub: Submission, prompts, params, logprobs, base: str | None, fut: asyncio.Future) -> None:
        engine, llm = self.engine, self.llm
        added: list[str] = []
        error: BaseException | None = None
        try:
            for index, (ids, sp) in enumerate(zip(prompts, params)):
                self._ids += 1
                rid = f"req-{self._ids}" if base is None else f"{base}-{index}"
                engine.add_request(ids, sp, request_id=rid)
                added.append(rid)
                self._live[rid] = _Live(sub, index, TextStream(index, rid, ids, llm.tokenizer, sp), logprobs)
        except HybridKVError as exc:
            error = exc
        except Exception as exc:  # pragma: no cover - a bug; reported as a 500
            log.exception("adding a request failed")
            error = exc
        if error is not None:
            for rid in added:
                engine.abort_request(rid)
                del self._live[rid]
            added = []
        sub.request_ids = added
        with self._lock:
            self._pending -= len(prompts)
        self._resolve(fut, error)

    def _peek(self, ids: list[int], fut: asyncio.Future) -> None:
        try:
            self._resolve(fut, None, self.engine.kv.peek_prefix_hit(ids))
        except Exception as exc:  # bad ids: the caller's error
            self._resolve(fut, exc)

    def _abort(self, rids: list[str]) -> None:
        items = []
        for rid in rids:
            out = self.engine.abort_request(rid)
            live = self._live.pop(rid)
            text, _ = live.text.feed((), True)
            items.append((live.sub, Chunk(live.index, text, (), None, self.llm.finish(live.text, out, False))))
            self._finished(live, out)
        self._send(items)

    def _fail_all(self, exc: BaseException) -> None:
        items = []
        for rid, live in list(self._live.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:  # pragma: no cover - the engine is already broken
                log.exception("aborting %s after an engine failure failed", rid)
            items.append((live.sub, Chunk(live.index, "", (), error=exc)))
        self._live.clear()
        self._send(items)

    def _dispatch(self, deltas) -> None:
        now = time.perf_counter()
        items = []
        for d in deltas:
            live = self._live.get(d.request_id)
            if live is None:  # pragma: no cover - a request the front did not add
                continue
            try:
                chunk = self._chunk(d, live, now)
            except Exception as exc:  # its text or logprobs: end this request only
                log.exception("request %s: its output could not be made; ending it", d.request_id)
                chunk = self._fail_one(d.request_id, live, exc)
            if chunk is not None:
                items.append((live.sub, chunk))
        self._send(items)

    def _chunk(self, d, live: _Live, now: float) -> Chunk | None:
        """The chunk of one request's delta (None: nothing to send); ends it when it finished."""
        out = d.output
        if out is not None and out.finish_reason == "error":  # the engine found the model failing on it
            del self._live[d.request_id]
            self._finished(live, out)
            return Chunk(live.index, "", (), error=EngineFailedError(out.error or "the model failed"))
        live.token_times.extend([now] * len(d.new_token_ids))
        text, stopped = live.text.feed(d.new_token_ids, d.finished)
        lps = self._logprobs(d.request_id, d.new_token_ids, live.num_logprobs) if live.num_logprobs is not None else None
        if stopped and out is None:  # a stop string: end it now, its blocks back before the next step
            out = self.engine.abort_request(d.request_id)
        final = None
        if out is not None:
            del self._live[d.request_id]
            final = self.llm.finish(live.text, out, stopped)
            self._finished(live, out, final.finish_reason)
        if final is not None or text or d.new_token_ids:
            return Chunk(live.index, text, d.new_token_ids, lps, final, prompt_logprobs=d.prompt_logprobs)
        return None

    def _fail_one(self, rid: str, live: _Live, exc: BaseException) -> Chunk:
        """End one request after its output failed: aborted in the engine if it still runs."""
        self._live.pop(rid, None)
        if rid in self.engine.scheduler.sequences:
            try:
                self.engine.abort_request(rid)
            except Exception:  # pragma: no cover - the engine is already broken
                log.exception("aborting %s failed", rid)
        return Chunk(live.index, "", (), error=exc)

    def _logprobs(self, rid: str, new: tuple[int, ...], k: int) -> tuple[TokenLogprob, ...] | None:
        import torch

        logits = self.engine.last_logits.get(rid)
        if logits is None or not new:
            return None
        lp = torch.log_softmax(logits.float(), dim=-1)  # [vocab]
        top: tuple[tuple[int, float], ...] = ()
        if k:
            values, ids = torch.topk(lp, min(k, lp.shape[0]))
            top = tuple(zip(ids.tolist(), values.tolist()))
        # one sampled token per request per step: the last logits are the last token's
        return tuple(TokenLogprob(t, float(lp[t]), top) for t in new[-1:])

    def _finished(self, live: _Live, out, reason: str | None = None) -> None:
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request %s %s: %d prompt tokens; prefix hit %d when queued, %d at admission, %d at the "
                      "last admission (%d preemptions); %d output tokens", out.request_id, reason or out.finish_reason,
                      len(out.prompt_token_ids), out.arrival_hit_tokens, out.num_cached_tokens, out.last_hit_tokens,
                      out.num_preemptions, len(out.output_token_ids))
        if self.metrics is None:
            return
        from hybridkv.server.metrics import FinishedRecord

        finish = reason or out.finish_reason
        self.metrics.on_request_finished(
            FinishedRecord(
                arrival_time=out.arrival_time,
                first_token_time=out.first_token_time,
                token_times=tuple(live.token_times),
                finished_time=out.finished_time,
                num_prompt_tokens=len(out.prompt_token_ids),
                num_output_tokens=len(out.output_token_ids),
                num_cached_tokens=out.num_cached_tokens,
                finish_reason=wire_finish_reason(finish),
            )
        )

    def _publish_events(self) -> None:
        """The KV events recorded since the last call, published (a step's are all known once
        it is scheduled: it goes out before the model runs, a router sees it a step sooner)."""
        if self.kv_publisher is not None:
            try:
                events = self.engine.kv.take_events()
                if events:
                    self.kv_publisher.publish(events)
            except Exception:  # pragma: no cover - never let telemetry stop the engine
                log.exception("publishing KV events failed")

    def _publish_and_measure(self) -> None:
        self._publish_events()
        if self.metrics is not None:
            try:
                self.metrics.on_step(self.engine)
            except Exception:  # pragma: no cover - never let telemetry stop the engine
                log.exception("updating metrics failed")


def _deliver(items: list[tuple[Submission, Chunk]]) -> None:
    for sub, chunk in items:
        if not sub.closed:
            sub.queue.put_nowait(chunk)


def _settle(fut: asyncio.Future, error: BaseException | None, value: Any = None) -> None:
    if not fut.done():
        if error is None:
            fut.set_result(value)
        else:
            fut.set_exception(error)

"""An asyncio front over one :class:`~hybridkv.engine.llm.LLM`: one engine thread, per-request queues.

    front = AsyncLLM(llm, max_waiting=256)
    front.start()                                   # inside the running event loop
    sub = await front.submit([ids], [SamplingParams(max_tokens=8)])
    async for chunk in sub:                         # Chunk(index, text, token_ids, ..., final)
        ...
    await front.shutdown()                          # every block of the pool free again

The engine thread owns the engine: nothing else touches it. The event loop talks to it
only through commands (add, abort, abort all, peek, stop) in an inbox the thread drains
before every step; it answers through ``loop.call_soon_threadsafe``: once per step, one
call carries every request's :class:`~hybridkv.server.submission.Chunk` to its
submission's queue. The thread steps while any request is unfinished and sleeps on an
event otherwise. Model compute runs outside the event loop, so streaming stays responsive.

A submission (:mod:`hybridkv.server.submission`: its chunks, its ``close``) is one HTTP
request. Its prompts are added to the engine together or not at all: a bad one (too
long, a pool that can never hold it) fails the whole submission with the engine's typed
error, before any chunk. Closing it (a client that went away) aborts whatever of it still
runs: the engine frees its blocks before its next step.

Admission is bounded: a submission that would make more than ``max_waiting`` requests
wait (queued in the scheduler, or submitted but not yet taken in by the thread) gets
:class:`~hybridkv.errors.ServiceUnavailableError`, as does every submission after
:meth:`AsyncLLM.close_admission` (SIGTERM).

Per request the thread keeps a :class:`~hybridkv.server.live_requests.LiveRequest` (text,
logprobs, token times); a stop string aborts the request at once, as :meth:`LLM.stream`
does. A failure outside the model run fails every running request (their streams end
with ``error``); a failure making one request's output ends that request only.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from typing import Any, Callable, Sequence

from hybridkv.engine.llm import LLM, TextStream
from hybridkv.errors import EngineFailedError, HybridKVError, InvalidArgumentError, ServiceUnavailableError
from hybridkv.sampling_params import SamplingParams
from hybridkv.server.live_requests import LiveRequest, report_finished, token_logprobs
from hybridkv.server.submission import Chunk, Submission, deliver, settle

__all__ = ["AsyncLLM"]

log = logging.getLogger("hybridkv.server")


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
        self._live: dict[str, LiveRequest] = {}
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
        self._command(("abort_all", None))

    def abort_for_shutdown(self) -> None:
        """End every request queued or running with ServiceUnavailableError ("the server is
        shutting down": a stream's error event, a whole response's 503). Thread- and signal-safe."""
        self.close_admission()
        self._command(("abort_all", ServiceUnavailableError("the server is shutting down: the request was ended "
                                                            "at the shutdown deadline", retry_after=self.retry_after)))

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
        share_key: str | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> Submission:
        """Queue ``prompts`` (token ids, one ``params`` each) as one submission; returns once
        the engine thread has added them all, or raises its typed error (none added). The
        engine's request ids are ``{request_id}-{i}`` per prompt (a response's id, as vLLM
        names them; unique per submission), or ``req-{n}``. ``share_key``: whose share of the
        running slots they take (the scheduler's, :mod:`hybridkv.scheduler.shares`);
        ``on_close``: called once, when the submission closes or its last prompt ends
        (:class:`~hybridkv.server.submission.Submission`)."""
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
        sub = Submission(self._abort_submission, len(prompts), on_close)
        added: asyncio.Future = asyncio.get_running_loop().create_future()
        self._command(("add", sub, [list(p) for p in prompts], list(params), logprobs, request_id, share_key, added))
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

    def _abort_submission(self, sub: Submission) -> None:
        """What :meth:`Submission.close` calls (on the event loop): abort its requests."""
        self._command(("abort", sub))

    def _send(self, items: list[tuple[Submission, Chunk]]) -> None:
        """Hand chunks to their queues on the event loop (one call for the whole step)."""
        if items and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(deliver, items)

    def _resolve(self, fut: asyncio.Future, error: BaseException | None, value: Any = None) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(settle, fut, error, value)

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
                self._abort(list(self._live), cmd[1])
            elif kind == "stop":
                stop = True
        with self._lock:
            self._waiting = self.engine.scheduler.num_waiting
        return stop

    def _add(self, sub: Submission, prompts, params, logprobs, base: str | None, share_key: str | None,
             fut: asyncio.Future) -> None:
        engine, llm = self.engine, self.llm
        added: list[str] = []
        error: BaseException | None = None
        try:
            for index, (ids, sp) in enumerate(zip(prompts, params)):
                self._ids += 1
                rid = f"req-{self._ids}" if base is None else f"{base}-{index}"
                engine.add_request(ids, sp, request_id=rid, share_key=share_key)
                added.append(rid)
                self._live[rid] = LiveRequest(sub, index, TextStream(index, rid, ids, llm.tokenizer, sp), logprobs)
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

    def _abort(self, rids: list[str], error: BaseException | None = None) -> None:
        """Abort ``rids``: each stream ends with its final (``abort``) chunk, or with ``error``."""
        items = []
        for rid in rids:
            out = self.engine.abort_request(rid)
            live = self._live.pop(rid)
            if error is not None:
                items.append((live.sub, Chunk(live.index, "", (), error=error)))
            else:
                text, _ = live.text.feed((), True)
                items.append((live.sub, Chunk(live.index, text, (), None, self.llm.finish(live.text, out, False))))
            report_finished(self.metrics, live, out)
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

    def _chunk(self, d, live: LiveRequest, now: float) -> Chunk | None:
        """The chunk of one request's delta (None: nothing to send); ends it when it finished."""
        out = d.output
        if out is not None and out.finish_reason == "error":  # the engine found the model failing on it
            del self._live[d.request_id]
            report_finished(self.metrics, live, out)
            return Chunk(live.index, "", (), error=EngineFailedError(out.error or "the model failed"))
        live.token_times.extend([now] * len(d.new_token_ids))
        text, stopped = live.text.feed(d.new_token_ids, d.finished)
        k = live.num_logprobs
        lps = None if k is None else token_logprobs(self.engine, d.request_id, d.new_token_ids, k)
        if stopped and out is None:  # a stop string: end it now, its blocks back before the next step
            out = self.engine.abort_request(d.request_id)
        final = None
        if out is not None:
            del self._live[d.request_id]
            final = self.llm.finish(live.text, out, stopped)
            report_finished(self.metrics, live, out, final.finish_reason)
        if final is not None or text or d.new_token_ids:
            return Chunk(live.index, text, d.new_token_ids, lps, final, prompt_logprobs=d.prompt_logprobs)
        return None

    def _fail_one(self, rid: str, live: LiveRequest, exc: BaseException) -> Chunk:
        """End one request after its output failed: aborted in the engine if it still runs."""
        self._live.pop(rid, None)
        if rid in self.engine.scheduler.sequences:
            try:
                self.engine.abort_request(rid)
            except Exception:  # pragma: no cover - the engine is already broken
                log.exception("aborting %s failed", rid)
        return Chunk(live.index, "", (), error=exc)

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


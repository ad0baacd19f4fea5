"""The router's state and decisions, with no web framework: replicas, policy, health, events.

    router = Router([ReplicaSpec.parse(u) for u in urls], RouterConfig(policy="hybrid"), tokenizer)
    await router.start()                       # health probes, one events thread per replica
    ids = router.prompt_ids(body, chat=False)  # what the replicas will see (None: unknown)
    replica, predicted = await router.choose(ids)
    ...
    await router.stop()

Faults (the issue's rules):

* a replica whose ``/health`` probe fails (connection refused, timeout) is **down**: no new
  request goes to it and its index is dropped; a request that could not connect to it is
  retried on another replica (nothing was generated yet), one that fails mid-response ends
  with a clear error. A probe that answers 200 brings it back (its index refills from its
  events: a restarted replica's stream starts again at sequence 0, which resets the index);
  503 (draining) takes it out of rotation without dropping its index;
* a gap in event sequence numbers is filled from the replay endpoint, or resets the index
  (:mod:`hybridkv.router.events`); undecodable events are counted and skipped;
* events **silent** while it serves: a request it answered should have stored blocks; if no
  event arrives within ``events_timeout`` after the response, the index is dropped
  (``stale``) until events arrive again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

import httpx

from hybridkv.errors import InvalidArgumentError, InvalidConfigError, ServiceUnavailableError
from hybridkv.protocol.limits import DEFAULT_MAX_REQUEST_BYTES, check_max_request_bytes
from hybridkv.router.index import Prompt
from hybridkv.router.balance import DEFAULT_MAX_SHARE_RATIO, DEFAULT_SHARE_WINDOW, Balance
from hybridkv.router.policy import DEFAULT_MAX_IMBALANCE, make_policy
from hybridkv.router.replica import Replica, ReplicaSpec

__all__ = ["Router", "RouterConfig"]

log = logging.getLogger("hybridkv.router")


#: a text prompt longer than this is routed by load alone, untokenized (far beyond any context a
#: replica serves; tokenizing megabytes would cost the router seconds of a worker thread)
MAX_ROUTED_CHARS = 1 << 20


@dataclass(frozen=True, slots=True)
class RouterConfig:
    policy: str = "hybrid"
    max_imbalance: int = DEFAULT_MAX_IMBALANCE
    #: hit-ranking policies pass over a replica whose share of the last ~``share_window`` decisions
    #: exceeds this multiple of the least-served one's (None: no share rule): :mod:`~hybridkv.router.balance`
    max_share_ratio: float | None = DEFAULT_MAX_SHARE_RATIO
    share_window: int = DEFAULT_SHARE_WINDOW
    health_interval: float = 1.0  # seconds between /health probes
    probe_timeout: float = 2.0
    events_timeout: float = 5.0  # seconds after a response by which its events must have arrived
    request_timeout: float = 600.0
    retry_after: int = 1
    #: benchmarks: also ask the chosen replica's manager (``/kv_cache/peek``) at each decision
    #: and report it (``x-hybridkv-resident-hit``), to tell index error from later eviction
    shadow_peek: bool = False
    #: a request body larger than this is refused with 413 before it is parsed (``--max-request-bytes``)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES

    def __post_init__(self) -> None:
        check_max_request_bytes(self.max_request_bytes)
        for name in ("health_interval", "probe_timeout", "events_timeout", "request_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise InvalidConfigError(f"{name} must be a number > 0, got {value!r}")
        make_policy(self.policy, max_imbalance=self.max_imbalance, balance=self.balance, oracle=_no_oracle)  # checks

    @property
    def balance(self) -> Balance:
        return Balance(self.max_share_ratio, self.share_window)


async def _no_oracle(replica, ids):  # pragma: no cover - only for the config check
    return 0


class Router:
    """See the module docstring."""

    def __init__(self, specs: Sequence[ReplicaSpec], config: RouterConfig = RouterConfig(), tokenizer: Any = None,
                 transport: httpx.AsyncBaseTransport | None = None):
        if not specs:
            raise InvalidConfigError("the router needs at least one --replica")
        urls = [s.url for s in specs]
        if len(set(urls)) != len(urls):
            raise InvalidConfigError(f"a replica is given twice: {urls}")
        self.config = config
        self.tokenizer = tokenizer
        self.replicas = [Replica(f"r{i}", s) for i, s in enumerate(specs)]
        self.policy = make_policy(config.policy, max_imbalance=config.max_imbalance, balance=config.balance,
                                  oracle=self._peek)
        self.client: httpx.AsyncClient | None = None
        self._transport = transport  # tests: fake replicas (httpx.MockTransport)
        self._streams: list[Any] = []
        self._tasks: list[asyncio.Task] = []
        self.num_decisions = 0
        self.decision_seconds = 0.0
        #: set by :meth:`stop`: no new request goes out, and those in flight are ending
        self.stopping = False
        #: new requests refused (503) while those in flight finish: :meth:`drain`
        self.draining = False

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self.stopping = False
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(self.config.request_timeout, connect=5.0), limits=limits,
                                        transport=self._transport)
        for r in self.replicas:
            if r.has_events:
                r.events = self._start_events(r)
                self._streams.append(r.events)
        await self.probe_all()
        self._tasks.append(asyncio.create_task(self._health_loop()))

    def _start_events(self, r: Replica):
        from hybridkv.router.events import ReplicaEvents

        return ReplicaEvents(r.name, r.spec.events, r.spec.replay, on_batch=r.on_events,
                             on_reset=lambda reason, r=r: r.reset_index(reason, counted=reason != "resync"))

    def drain(self) -> None:
        """Refuse new requests (503 ``Retry-After``, ``/health`` 503) while those in flight go on:
        the first step of a shutdown with a deadline (:meth:`stop` at the deadline ends the rest)."""
        self.draining = True

    @property
    def refusing(self) -> bool:
        """Whether a new request is refused: draining or stopped."""
        return self.draining or self.stopping

    async def stop(self) -> None:
        """Stop probing and reading events, and close the HTTP client: that closes every connection
        to the replicas, those of requests in flight included (their readers get an
        ``httpx.ReadError`` at once, and the replicas see a disconnect and abort them).
        Calling it again does nothing more."""
        self.stopping = True
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except asyncio.CancelledError:
                pass
        self._tasks.clear()
        if self.client is not None:  # before the event streams: the replicas abort at once
            client, self.client = self.client, None
            await client.aclose()
        for s in self._streams:
            await asyncio.get_running_loop().run_in_executor(None, s.close)
        self._streams.clear()

    # ------------------------------------------------------------ health
    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval)
            try:
                await self.probe_all()
                self.check_silence()
            except Exception:  # pragma: no cover - never let the loop die
                log.exception("health check failed")

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(r) for r in self.replicas))

    async def probe(self, r: Replica) -> None:
        try:
            resp = await self.client.get(f"{r.spec.url}/health", timeout=self.config.probe_timeout)
            ok = resp.status_code == 200
            alive = True
        except httpx.HTTPError:
            ok = alive = False
        if not alive and r.up:
            self.mark_down(r, "down")
        elif ok and not r.up:
            log.info("replica %s (%s) is up", r.name, r.spec.url)
            r.up = True
        elif alive and not ok:
            r.up = False  # draining: out of rotation, index kept

    def mark_down(self, r: Replica, reason: str) -> None:
        """Take ``r`` out of rotation and drop its index; a replica that was up counts one failure
        (``/router/replicas``' ``failures``: how often it went down, and requests it failed)."""
        if not r.up:  # already down (another request's refused connection, a probe): counted, dropped
            return
        log.warning("replica %s (%s) is down (%s)", r.name, r.spec.url, reason)
        r.num_failures += 1
        r.up = False
        self.drop_index(r, "down")

    def drop_index(self, r: Replica, reason: str) -> None:
        """Clear ``r``'s index and ask its events for everything again from the replay: the
        index rebuilds as far as the replica's replay buffer reaches back. One drop counts once
        (``reason``); the events thread's own reset for the resync is not counted again."""
        r.reset_index(reason)
        if r.events is not None:
            r.events.resync()

    def check_silence(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for r in self.replicas:
            due = r.expect_event_by
            if due is None or now <= due:
                continue
            r.expect_event_by = None
            if r.last_event_time is not None and r.last_event_time >= r.expect_since:
                continue  # its events came (before or after the response)
            if r.up and not r.stale:
                log.warning("replica %s: no KV event %.1f s after a response; its index is dropped",
                            r.name, self.config.events_timeout)
                r.stale = True
                self.drop_index(r, "silent")

    # ------------------------------------------------------------ decisions
    def prompt_ids(self, body: Any, chat: bool) -> list[int] | None:
        """The token ids a replica will see for this request body, or None (no tokenizer, a
        body the replica will refuse, several prompts): the decision then ignores hits."""
        from pydantic import ValidationError

        from hybridkv.protocol.openai import (
            ChatCompletionRequest,
            CompletionRequest,
            chat_messages,
            chat_tools,
            completion_prompt_list,
        )
        from hybridkv.tokenizer.prompts import encode_prompt

        if not isinstance(body, dict):
            return None
        try:
            if chat:
                if self.tokenizer is None:
                    return None
                req = ChatCompletionRequest(**body)
                prompt: Any = chat_messages(req)
                tools = chat_tools(req)  # rendered as the replica renders them
                if sum(len(m["content"]) for m in prompt) > MAX_ROUTED_CHARS:
                    return None
            else:
                prompts = completion_prompt_list(CompletionRequest(**body))
                if len(prompts) != 1:
                    return None
                prompt = prompts[0]
                if isinstance(prompt, str) and (self.tokenizer is None or len(prompt) > MAX_ROUTED_CHARS):
                    return None
            ids = encode_prompt(self.tokenizer, prompt, 0, tools if chat else None)
            if not all(type(t) is int and 0 <= t < 1 << 63 for t in ids):
                return None  # the replica refuses it
            return ids
        except (ValidationError, InvalidArgumentError, ValueError, TypeError):
            return None

    def candidates(self, exclude: set[str] = frozenset()) -> list[Replica]:
        return [r for r in self.replicas if r.up and r.name not in exclude]

    async def choose(self, token_ids: Sequence[int] | None, exclude: set[str] = frozenset()) -> tuple[Replica, int]:
        up = self.candidates(exclude)
        if not up:
            raise ServiceUnavailableError("no replica is up", retry_after=self.config.retry_after)
        start = time.perf_counter()
        prompt = Prompt(token_ids) if token_ids else None  # hashed once, per block size, for every replica
        replica, hit = await self.policy.choose(prompt, up)
        self.decision_seconds += time.perf_counter() - start
        self.num_decisions += 1
        return replica, hit

    async def _peek(self, r: Replica, token_ids: Sequence[int]) -> int:
        """The oracle: the replica's own manager's hit for ``token_ids`` (0 if it cannot say)."""
        try:
            ids = list(getattr(token_ids, "token_ids", token_ids))
            resp = await self.client.post(f"{r.spec.url}/kv_cache/peek", json={"prompt": ids},
                                          timeout=self.config.probe_timeout)
            return int(resp.json()["cached_tokens"]) if resp.status_code == 200 else 0
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return 0

    def served(self, r: Replica, prompt_len: int | None, predicted_hit: int, sent_at: float) -> None:
        """A response from ``r``, sent at ``sent_at`` (monotonic), ended. If its prompt held two
        whole blocks past the hit the index predicted, the replica computed and cached at
        least one new block: a BlockStored newer than ``sent_at`` must arrive within
        ``events_timeout`` of now (it may well have come before the response ended)."""
        block_size = r.block_size
        if r.has_events and prompt_len and block_size and prompt_len - predicted_hit >= 2 * block_size:
            if r.expect_event_by is None:
                r.expect_since = sent_at
            r.expect_event_by = time.monotonic() + self.config.events_timeout


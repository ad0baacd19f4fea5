"""``GET /metrics``: the engine's scheduler, KV cache and request latencies for Prometheus.

    metrics = ServerMetrics(engine, "gemma-3-270m")
    # engine thread, after every step:       metrics.on_step(engine)
    # engine thread, per finished request:   metrics.on_request_finished(FinishedRecord.from_output(out, times))
    body, content_type = metrics.render()   # any thread

The catalogue is README's table (Serving, "Metrics"). Names, bucket boundaries and the
``model_name`` label follow vLLM v1 (``vllm/v1/metrics/loggers.py``) where vLLM has the
metric (vLLM's ``engine`` label is left out: one engine); what vLLM lacks is ``hybridkv:``,
blocks per KV cache group. Gauges show the last step (:meth:`ServerMetrics.on_step`); a
request's tokens and latencies count when it ends, aborted ones included, as vLLM counts
them. Blocks used per group and their peak come from the core's accounting
(:mod:`hybridkv.core.usage`); ``free`` is the one shared pool's, the same on every group.

Histograms are plain lists updated with ``bisect`` under one lock; a render copies them
under the lock and builds the Prometheus families outside it, so the engine thread never
waits on prometheus_client (costs: benchmarks/RESULTS.md, "Server metrics").
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING, Iterable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from hybridkv.errors import InvalidArgumentError
from hybridkv.protocol.openai import wire_finish_reason

if TYPE_CHECKING:
    from hybridkv.engine.engine import LLMEngine, RequestOutput

__all__ = ["FinishedRecord", "ServerMetrics", "FINISH_REASONS"]

#: the ``finished_reason`` label values (vLLM's strings)
FINISH_REASONS = ("stop", "length", "abort", "error")

# vLLM's buckets (vllm/v1/metrics/buckets.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


def token_buckets(max_value: int) -> tuple[int, ...]:
    """vLLM's 1-2-5 series up to ``max_value``: ``token_buckets(100)`` = (1, 2, 5, 10, 20, 50, 100)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


@dataclass(frozen=True, slots=True)
class FinishedRecord:
    """One finished request, as the server saw it. Times are ``time.perf_counter()`` seconds;
    ``token_times`` has one entry per output token (when it was handed out)."""

    arrival_time: float
    first_token_time: float | None  # None: no token (aborted before its first)
    token_times: tuple[float, ...]
    finished_time: float
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    finish_reason: str  # "stop", "length", "abort" or "error"

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise InvalidArgumentError(f"finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")

    @classmethod
    def from_output(cls, output: RequestOutput, token_times: Iterable[float]) -> FinishedRecord:
        """The record of an engine :class:`~hybridkv.engine.engine.RequestOutput` (its
        ``"aborted"`` becomes vLLM's ``"abort"``) with the times its tokens went out."""
        reason = wire_finish_reason(output.finish_reason)
        return cls(
            output.arrival_time,
            output.first_token_time,
            tuple(token_times),
            output.finished_time,
            len(output.prompt_token_ids),
            len(output.output_token_ids),
            output.num_cached_tokens,
            reason,
        )


class _Histogram:
    """Bucket counts (not cumulative; the last is +Inf), sum and count: one ``bisect`` an
    observation, no lock of its own (``ServerMetrics`` holds one)."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Iterable[float]):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0

    def copy(self) -> _Histogram:
        new = _Histogram(())
        new.bounds, new.counts, new.total = self.bounds, self.counts.copy(), self.total
        return new

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # le bound: value <= bound
        self.total += value

    def family(self, name: str, doc: str, labels: list[str], values: list[str]) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(name, doc, labels=labels)
        cum = 0
        buckets = []
        for bound, n in zip((*map(floatToGoString, self.bounds), "+Inf"), self.counts):
            cum += n
            buckets.append((bound, cum))
        fam.add_metric(values, buckets, self.total)
        return fam


class _State:
    """Every figure ``/metrics`` shows; ``ServerMetrics`` updates it under its lock and
    renders from a :meth:`copy` (so a render holds the lock for microseconds)."""

    __slots__ = ("running", "waiting", "preempted_waiting", "preemptions", "kv_usage", "prefix_queries",
                 "prefix_hits", "group_used", "group_peak", "free_blocks", "cached_free_blocks", "success",
                 "prompt_tokens", "generation_tokens", "cached_tokens", "ttft", "itl", "e2e", "request_prompt",
                 "request_generation")

    def __init__(self, num_groups: int, free_blocks: int, preemptions: int, max_model_len: int):
        self.running = self.waiting = self.preempted_waiting = 0
        self.preemptions = preemptions
        self.kv_usage = 0.0
        self.prefix_queries = self.prefix_hits = 0
        self.group_used = [0] * num_groups
        self.group_peak = [0] * num_groups
        self.free_blocks = free_blocks
        self.cached_free_blocks = 0
        self.success = dict.fromkeys(FINISH_REASONS, 0)
        self.prompt_tokens = self.generation_tokens = self.cached_tokens = 0
        self.ttft = _Histogram(TTFT_BUCKETS)
        self.itl = _Histogram(ITL_BUCKETS)
        self.e2e = _Histogram(E2E_BUCKETS)
        self.request_prompt = _Histogram(token_buckets(max_model_len))
        self.request_generation = _Histogram(token_buckets(max_model_len))

    def copy(self) -> _State:
        new = object.__new__(_State)
        for name in self.__slots__:
            value = getattr(self, name)
            if isinstance(value, (list, dict, _Histogram)):
                value = value.copy()
            setattr(new, name, value)
        return new


class _Collector:
    """Hands ``ServerMetrics``' figures to a registry (``collect`` runs at render time)."""

    def __init__(self, metrics: ServerMetrics):
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return iter(self._metrics._families())


class ServerMetrics:
    """The server's Prometheus metrics (see the module docstring for the list).

    ``on_step`` and ``on_request_finished`` run in the engine thread; ``render`` in any
    thread. One lock guards the figures: a render sees whole steps and whole requests.
    ``registry``: where to register (default: a private ``CollectorRegistry``).
    """

    def __init__(self, engine: LLMEngine, model_name: str, registry: CollectorRegistry | None = None):
        if not isinstance(model_name, str):
            raise InvalidArgumentError(f"model_name must be a str, got {model_name!r:.60}")
        self.model_name = model_name
        self._lock = threading.Lock()
        groups = engine.grouping.groups
        self._group_labels = [
            (str(i), g.spec.kind, "" if g.spec.attention_span is None else str(g.spec.attention_span))
            for i, g in enumerate(groups)
        ]
        kv = engine.kv
        self._usable_blocks = kv.usable_blocks
        self._config_info = {
            "block_size": str(kv.block_size),
            "num_gpu_blocks": str(self._usable_blocks),
            "enable_prefix_caching": str(bool(kv.enable_caching)),
        }
        self._state = _State(len(groups), kv.pool_usage().free, engine.scheduler.num_preemptions,
                             engine.max_model_len)
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))

    # ------------------------------------------------------------ engine thread
    def on_step(self, engine: LLMEngine) -> None:
        """Read the engine after a step (in the engine thread, which owns it)."""
        sched = engine.scheduler
        kv = engine.kv
        stats = kv.make_prefix_cache_stats()  # get and reset, as vLLM's scheduler
        usage = kv.pool_usage()  # the core's accounting: per-group held blocks and their peaks
        preempted = sum(1 for s in sched.waiting if s.num_preemptions)
        with self._lock:
            st = self._state
            st.running = len(sched.running)
            st.waiting = len(sched.waiting)
            st.preempted_waiting = preempted
            st.preemptions = sched.num_preemptions
            st.kv_usage = kv.usage
            st.prefix_queries += stats.queries
            st.prefix_hits += stats.hits
            st.group_used = list(usage.used_per_group)
            st.group_peak = list(usage.peak_per_group)
            st.free_blocks = usage.free
            st.cached_free_blocks = usage.cached_free

    def finished_counts(self) -> dict[str, int]:
        """Requests finished so far, by ``finished_reason`` (:data:`FINISH_REASONS`)."""
        with self._lock:
            return dict(self._state.success)

    def on_request_finished(self, rec: FinishedRecord) -> None:
        """Count a finished request and observe its latencies."""
        if not isinstance(rec, FinishedRecord):
            raise InvalidArgumentError(f"expected a FinishedRecord, got {rec!r:.60}")
        with self._lock:
            st = self._state
            st.success[rec.finish_reason] += 1
            st.prompt_tokens += rec.num_prompt_tokens
            st.generation_tokens += rec.num_output_tokens
            st.cached_tokens += rec.num_cached_tokens
            if rec.first_token_time is not None:
                st.ttft.observe(rec.first_token_time - rec.arrival_time)
            observe = st.itl.observe
            for a, b in pairwise(rec.token_times):
                observe(b - a)
            st.e2e.observe(rec.finished_time - rec.arrival_time)
            st.request_prompt.observe(rec.num_prompt_tokens)
            st.request_generation.observe(rec.num_output_tokens)

    # --------------------------------------------------------------- any thread
    def render(self) -> tuple[bytes, str]:
        """The text exposition format: (body, content type) for ``GET /metrics``."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def _families(self) -> list[Metric]:
        with self._lock:
            st = self._state.copy()
        name = [self.model_name]
        ml = ["model_name"]
        out: list[Metric] = []

        def gauge(metric: str, doc: str, value: float) -> None:
            out.append(GaugeMetricFamily(metric, doc, labels=ml))
            out[-1].add_metric(name, value)

        def counter(metric: str, doc: str, value: float) -> None:
            out.append(CounterMetricFamily(metric, doc, labels=ml))
            out[-1].add_metric(name, value)

        gauge("vllm:num_requests_running", "Number of requests in model execution batches.", st.running)
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", st.waiting)
        gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", st.kv_usage)
        counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", st.preemptions)
        counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                st.prefix_queries)
        counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", st.prefix_hits)
        counter("vllm:prompt_tokens", "Number of prefill tokens processed.", st.prompt_tokens)
        counter("vllm:generation_tokens", "Number of generation tokens processed.", st.generation_tokens)
        counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens.", st.cached_tokens)
        fam = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                  labels=[*ml, "finished_reason"])
        for reason, n in st.success.items():
            fam.add_metric([*name, reason], n)
        out.append(fam)
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=[*ml, *self._config_info])
        info.add_metric([*name, *self._config_info.values()], 1)
        out.append(info)
        for hist, metric, doc in (
            (st.ttft, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds."),
            (st.itl, "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds."),
            (st.e2e, "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."),
            (st.request_prompt, "vllm:request_prompt_tokens", "Number of prefill tokens processed."),
            (st.request_generation, "vllm:request_generation_tokens", "Number of generation tokens processed."),
        ):
            out.append(hist.family(metric, doc, ml, name))
        gauge("hybridkv:num_requests_preempted", "Waiting requests that were preempted (part of waiting).",
              st.preempted_waiting)
        glabels = [*ml, "group", "kind", "span"]
        fam = GaugeMetricFamily("hybridkv:kv_cache_group_blocks",
                                "Blocks per KV cache group: used (distinct blocks its tables hold), "
                                "free (the shared pool's free blocks, the same for every group).",
                                labels=[*glabels, "state"])
        peak = GaugeMetricFamily("hybridkv:kv_cache_group_peak_blocks",
                                 "Most blocks a KV cache group held after a step's allocation.", labels=glabels)
        for labels, used, top in zip(self._group_labels, st.group_used, st.group_peak):
            fam.add_metric([*name, *labels, "used"], used)
            fam.add_metric([*name, *labels, "free"], st.free_blocks)
            peak.add_metric([*name, *labels], top)
        out += (fam, peak)
        pool = GaugeMetricFamily("hybridkv:kv_cache_blocks",
                                 "The shared pool's usable blocks: used + free; cached_free: free blocks "
                                 "holding a prefix-cache entry.", labels=[*ml, "state"])
        pool.add_metric([*name, "used"], self._usable_blocks - st.free_blocks)
        pool.add_metric([*name, "free"], st.free_blocks)
        pool.add_metric([*name, "cached_free"], st.cached_free_blocks)
        out.append(pool)
        return out

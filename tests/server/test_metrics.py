"""``/metrics``: every figure checked against the engine's own truth, step by step.

A seeded random driver (arrivals with shared prefixes, aborts, pools small enough to
preempt) steps tiny engines by hand and calls ``on_step`` / ``on_request_finished`` as the
server does; after every step the parsed exposition must match: requests running and
waiting, blocks per group (a brute-force count over ``kv.get_block_ids``), free and
cached-free blocks (a pass over the pool), counters never going down; at the end the
histograms' counts match the requests (ITL: ``n - 1`` per request of ``n`` tokens).
"""

from __future__ import annotations

import random
import threading
import time
from bisect import bisect_left

import pytest

pytest.importorskip("prometheus_client")
pytest.importorskip("transformers")

from prometheus_client import CollectorRegistry  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402


from tests.support.hf_tiny import build_tiny  # noqa: E402

from hybridkv.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from hybridkv.engine.models import load_model  # noqa: E402
from hybridkv.errors import InvalidArgumentError  # noqa: E402
from hybridkv.scheduler import SamplingParams  # noqa: E402
from hybridkv.server.metrics import (  # noqa: E402
    E2E_BUCKETS,
    ITL_BUCKETS,
    TTFT_BUCKETS,
    FinishedRecord,
    ServerMetrics,
    _Histogram,
    token_buckets,
)

VOCAB = 128


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_dir):
    """name -> loaded tiny model (gemma3, the server tests' ``tiny_dir``: full + 2 striped
    sliding groups; llama4_dense: full + chunked; mistral: sliding only, no full group)."""
    import torch

    torch.set_num_threads(1)
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            path = tiny_dir if name == "gemma3" else tmp_path_factory.mktemp(name)
            if name != "gemma3":
                build_tiny(name, path)
            cache[name] = load_model(path)
        return cache[name]

    return get


def parse(metrics: ServerMetrics) -> dict:
    """(sample name, frozenset of labels other than model_name) -> value."""
    body, ctype = metrics.render()
    assert ctype.startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            labels = dict(s.labels)
            assert labels.pop("model_name") == metrics.model_name
            out[s.name, frozenset(labels.items())] = s.value
    return out


def one(samples: dict, name: str, **labels) -> float:
    return samples[name, frozenset((k, str(v)) for k, v in labels.items())]


def brute_used(engine: LLMEngine) -> list[int]:
    held = [set() for _ in engine.grouping.groups]
    for seq in engine.scheduler.running:
        for g, ids in enumerate(engine.kv.get_block_ids(seq.request_id)):
            held[g].update(ids)
    return [len(s - {0}) for s in held]


def brute_cached_free(engine: LLMEngine) -> int:
    pool = engine.kv.pool
    return sum(b.width for b in pool.free_queue if b.block_hash is not None)


class Driver:
    """Steps an engine by hand as the server's engine thread does, with its own records."""

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, rng: random.Random):
        self.engine, self.metrics, self.rng = engine, metrics, rng
        self.times: dict[str, list[float]] = {}
        self.records: list[FinishedRecord] = []
        self.prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randrange(4, 30))] for _ in range(3)]

    def add(self) -> None:
        rng = self.rng
        prompt = rng.choice(self.prefixes)[: rng.randrange(0, 30)] + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 20))]
        sp = SamplingParams(max_tokens=rng.randrange(1, 16), ignore_eos=rng.random() < 0.7)
        self.times[self.engine.add_request(prompt, sp)] = []

    def finish(self, output) -> None:
        rec = FinishedRecord.from_output(output, self.times.pop(output.request_id))
        assert rec.num_output_tokens == len(rec.token_times)
        self.records.append(rec)
        self.metrics.on_request_finished(rec)

    def step(self) -> None:
        rng, engine = self.rng, self.engine
        for _ in range(rng.choice((0, 0, 1, 3))):
            self.add()
        if self.times and rng.random() < 0.05:
            self.finish(engine.abort_request(rng.choice(sorted(self.times))))
        if not engine.has_unfinished_requests():
            return
        for d in engine.step_deltas():
            now = time.perf_counter()
            self.times[d.request_id] += [now] * len(d.new_token_ids)
            if d.output is not None:
                self.finish(d.output)
        self.metrics.on_step(engine)


COUNTERS = (
    "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:prompt_tokens_cached_total",
)

CASES = [  # (model, EngineConfig kwargs)
    ("gemma3", dict(num_blocks=60)),  # small: preempts
    ("gemma3", dict(num_blocks=400)),
    ("gemma3", dict(num_blocks=50, hybrid=False)),
    ("gemma3", dict(num_blocks=80, enable_prefix_caching=False)),
    ("llama4_dense", dict(num_blocks=150)),
    ("mistral", dict(num_blocks=40)),
]


# the fast tier runs the first case (gemma3, a pool small enough to preempt) on seed 0; the rest are slow
@pytest.mark.parametrize("seed", [0] + [pytest.param(s, marks=pytest.mark.slow) for s in (1, 2)])
@pytest.mark.parametrize("model,kwargs", [CASES[0]] + [pytest.param(*c, marks=pytest.mark.slow) for c in CASES[1:]],
                         ids=[f"{m}-{'-'.join(f'{k}{v}' for k, v in kw.items())}" for m, kw in CASES])
def test_metrics_match_the_engine_step_by_step(models, model, kwargs, seed):
    rng = random.Random(seed)
    engine = LLMEngine(models(model), EngineConfig(block_size=4, max_model_len=96, max_num_batched_tokens=32,
                                                   max_num_seqs=8, **kwargs))
    metrics = ServerMetrics(engine, f"tiny-{model}")
    drv = Driver(engine, metrics, rng)
    spans = [("" if g.spec.attention_span is None else str(g.spec.attention_span), g.spec.kind)
             for g in engine.grouping.groups]
    usable = engine.kv.usable_blocks
    before = {name: 0.0 for name in COUNTERS}
    peak = [0] * len(spans)
    for _ in range(80):
        drv.step()
        s = parse(metrics)
        sched = engine.scheduler
        assert one(s, "vllm:num_requests_running") == len(sched.running)
        assert one(s, "vllm:num_requests_waiting") == len(sched.waiting)
        assert one(s, "hybridkv:num_requests_preempted") == sum(1 for q in sched.waiting if q.num_preemptions)
        assert one(s, "vllm:num_preemptions_total") == sched.num_preemptions
        assert one(s, "vllm:kv_cache_usage_perc") == pytest.approx(engine.kv.usage)
        used = brute_used(engine)  # the oracle: every live request's tables, counted by hand
        summary = engine.kv_summary().groups
        assert used == [g.blocks_in_use for g in summary]
        free = engine.kv.num_free_blocks
        # the peak is the core's, sampled after each step's allocation (the high-water mark): at
        # least every end-of-step count, and the same figure in kv_summary and the metrics
        peak = [max(p, u) for p, u in zip(peak, used)]
        assert all(g.peak_blocks >= p for g, p in zip(summary, peak))
        for g, ((span, kind), u, top) in enumerate(zip(spans, used, [g.peak_blocks for g in summary])):
            assert one(s, "hybridkv:kv_cache_group_blocks", group=g, kind=kind, span=span, state="used") == u
            assert one(s, "hybridkv:kv_cache_group_blocks", group=g, kind=kind, span=span, state="free") == free
            assert one(s, "hybridkv:kv_cache_group_peak_blocks", group=g, kind=kind, span=span) == top
        assert one(s, "hybridkv:kv_cache_blocks", state="used") == usable - free
        assert one(s, "hybridkv:kv_cache_blocks", state="free") == free
        assert one(s, "hybridkv:kv_cache_blocks", state="cached_free") == brute_cached_free(engine)
        for name in COUNTERS:
            assert one(s, name) >= before[name], name
            before[name] = one(s, name)
        assert one(s, "vllm:prefix_cache_hits_total") <= one(s, "vllm:prefix_cache_queries_total")
    while engine.has_unfinished_requests():  # drain, no new arrivals
        for d in engine.step_deltas():
            drv.times[d.request_id] += [time.perf_counter()] * len(d.new_token_ids)
            if d.output is not None:
                drv.finish(d.output)
        metrics.on_step(engine)
    assert not drv.times
    s = parse(metrics)
    recs = drv.records
    assert len(recs) > 10
    if not kwargs.get("enable_prefix_caching", True):
        assert one(s, "vllm:prefix_cache_queries_total") == 0
    assert one(s, "vllm:prompt_tokens_total") == sum(r.num_prompt_tokens for r in recs)
    assert one(s, "vllm:generation_tokens_total") == sum(r.num_output_tokens for r in recs)
    assert one(s, "vllm:prompt_tokens_cached_total") == sum(r.num_cached_tokens for r in recs)
    for reason in ("stop", "length", "abort"):
        assert one(s, "vllm:request_success_total", finished_reason=reason) == sum(r.finish_reason == reason for r in recs)
    with_token = [r for r in recs if r.first_token_time is not None]
    assert one(s, "vllm:time_to_first_token_seconds_count") == len(with_token)
    assert one(s, "vllm:time_to_first_token_seconds_sum") == pytest.approx(
        sum(r.first_token_time - r.arrival_time for r in with_token))
    assert one(s, "vllm:inter_token_latency_seconds_count") == sum(max(r.num_output_tokens - 1, 0) for r in recs)
    assert one(s, "vllm:inter_token_latency_seconds_sum") == pytest.approx(
        sum(r.token_times[-1] - r.token_times[0] for r in recs if r.token_times))
    assert one(s, "vllm:e2e_request_latency_seconds_count") == len(recs)
    assert one(s, "vllm:request_prompt_tokens_count") == len(recs)
    assert one(s, "vllm:request_generation_tokens_sum") == sum(r.num_output_tokens for r in recs)
    assert one(s, "vllm:e2e_request_latency_seconds_bucket", le="+Inf") == len(recs)
    # all requests gone: nothing held, every group's used blocks back to 0
    assert one(s, "hybridkv:kv_cache_blocks", state="used") == 0
    assert all(v == 0 for (n, labels), v in s.items()
               if n == "hybridkv:kv_cache_group_blocks" and ("state", "used") in labels)


def test_prefix_counters_are_the_lookups_of_admitted_prompts(models):
    """A pool that never runs short: every prompt is looked up once, when admitted; the hits
    are the outputs' cached tokens."""
    engine = LLMEngine(models("gemma3"), EngineConfig(block_size=4, num_blocks=2000, max_model_len=96))
    metrics = ServerMetrics(engine, "m")
    rng = random.Random(5)
    shared = [rng.randrange(VOCAB) for _ in range(24)]
    prompts = [shared[: rng.randrange(30)] + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 9))] for _ in range(12)]
    outs = []
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(max_tokens=3, ignore_eos=True))
        if i % 4 == 3:  # later ones hit what earlier ones cached
            while engine.has_unfinished_requests():
                outs += engine.step()
                metrics.on_step(engine)
    s = parse(metrics)
    assert one(s, "vllm:prefix_cache_queries_total") == sum(map(len, prompts))
    assert one(s, "vllm:prefix_cache_hits_total") == sum(o.num_cached_tokens for o in outs) > 0


def test_histogram_buckets_are_le_bounds():
    rng = random.Random(0)
    for bounds in (TTFT_BUCKETS, ITL_BUCKETS, E2E_BUCKETS, token_buckets(1000)):
        h = _Histogram(bounds)
        values = [rng.choice(bounds) for _ in range(50)] + [rng.uniform(0, 2 * bounds[-1]) for _ in range(200)]
        for v in values:
            h.observe(v)
        fam = h.family("x", "doc", [], [])
        cum = {s.labels["le"]: s.value for s in fam.samples if s.name == "x_bucket"}
        for b in bounds:
            assert cum[str(float(b))] == sum(v <= b for v in values)
        assert cum["+Inf"] == len(values)
        assert bisect_left(bounds, bounds[0]) == 0


def test_token_buckets_are_vllms_1_2_5_series():
    assert token_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert token_buckets(32768)[-1] == 20000
    assert token_buckets(1) == (1,)


def test_finished_record_checks_its_reason_and_maps_the_engines_aborted(models):
    with pytest.raises(InvalidArgumentError):
        FinishedRecord(0.0, None, (), 1.0, 3, 0, 0, "aborted")
    engine = LLMEngine(models("gemma3"), EngineConfig(block_size=4, num_blocks=60))
    rid = engine.add_request([1, 2, 3], SamplingParams(max_tokens=4))
    rec = FinishedRecord.from_output(engine.abort_request(rid), ())
    assert rec.finish_reason == "abort" and rec.first_token_time is None and rec.num_prompt_tokens == 3
    metrics = ServerMetrics(engine, "m")
    metrics.on_request_finished(rec)
    s = parse(metrics)
    assert one(s, "vllm:request_success_total", finished_reason="abort") == 1
    assert one(s, "vllm:time_to_first_token_seconds_count") == 0
    assert one(s, "vllm:inter_token_latency_seconds_count") == 0
    with pytest.raises(InvalidArgumentError):
        metrics.on_request_finished("not a record")


def test_instances_keep_private_registries_or_share_a_given_one(models):
    engine = LLMEngine(models("gemma3"), EngineConfig(block_size=4, num_blocks=60))
    a, b = ServerMetrics(engine, "a"), ServerMetrics(engine, "b")
    assert a.registry is not b.registry
    assert b"model_name=\"b\"" not in a.render()[0]
    reg = CollectorRegistry()
    c = ServerMetrics(engine, "c", registry=reg)
    assert c.registry is reg and b'vllm:num_requests_running{model_name="c"}' in c.render()[0]
    s = parse(a)
    assert one(s, "vllm:cache_config_info", block_size=4, num_gpu_blocks=59, enable_prefix_caching=True) == 1


def test_render_while_the_engine_thread_steps(models):
    """Renders from another thread always parse, see whole steps (used + free = usable) and
    counters that never go down; the stepping thread stops by itself."""
    engine = LLMEngine(models("gemma3"), EngineConfig(block_size=4, num_blocks=120, max_model_len=96))
    metrics = ServerMetrics(engine, "t")
    drv = Driver(engine, metrics, random.Random(7))
    stop = time.monotonic() + 1.5
    errors: list[BaseException] = []

    def engine_thread():
        try:
            for _ in range(400):
                if time.monotonic() > stop:
                    break
                drv.step()
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    t = threading.Thread(target=engine_thread, daemon=True)
    t.start()
    last = 0.0
    renders = 0
    while t.is_alive() and time.monotonic() < stop + 2:
        s = parse(metrics)
        renders += 1
        used = one(s, "hybridkv:kv_cache_blocks", state="used")
        assert used + one(s, "hybridkv:kv_cache_blocks", state="free") == 119
        n = one(s, "vllm:generation_tokens_total")
        assert n >= last
        last = n
    t.join(timeout=5)
    assert not t.is_alive() and not errors and renders > 1

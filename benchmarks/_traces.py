"""Seeded traces and one scheduler-like driver, shared by ``bench_manager.py`` and ``vs_vllm.py``.

A *trace* is a KV cache layout (groups, block size, pool size), a seeded stream of
requests (prompt tokens, the output tokens "sampled" later) and scheduler limits
(most running requests, token budget per step, warm-up and timed steps). The
driver plays it like vLLM's scheduler does, through a *lane* (an adapter around
one KV cache manager), so two managers see the same calls:

per step::

    new_step_starts()
    for each running request, in order:            # decodes and prefill chunks
        n = min(tokens not yet computed, budget)
        allocate_slots(req, n)                      # None -> preempt the last running
    while a slot is free and budget is left:         # admission (FIFO)
        blocks, hit = get_computed_blocks(req)
        allocate_slots(req, n, hit, blocks)         # None -> stop admitting
    for each scheduled request:
        req.num_computed_tokens += n (+ hit)
        if every token is computed: append the next output token (its block hash follows)
        if the request has all its output tokens: free(req)

Only the step loop is timed (``time.perf_counter_ns`` around it); request objects
(whose construction hashes the prompt in both managers) are built before the step
starts, and every token is generated up front by the trace. No manager-specific
code is in the driver: a lane gives bound methods (``lookup``, ``alloc``, ``free``,
``new_step``) and, per request, its ``append`` method.

A lane built with ``sched=True`` is used the way vLLM's scheduler uses its manager
(``vllm/v1/core/sched/scheduler.py``, 0.33), and the driver then also times:

* prompt hashing: the lane's ``make_request`` returns a request without block
  hashes and the step starts by hashing the prompts of the requests that arrived
  (``hash_request``; vLLM does it in ``Request.__init__`` via ``block_hasher``, in
  the engine core, before ``schedule()``). A preempted request keeps its hashes in
  vLLM, so its rebuild here is hashed untimed;
* block ids read: after each running request's ``allocate_slots`` its *new* ids
  (``new_ids(new_blocks)``: vLLM's ``CachedRequestData.new_block_ids``), after each
  admission the request's *whole* table (``table_ids(request_id)``: vLLM's
  ``NewRequestData.block_ids``, from ``kv_cache_manager.get_blocks(id)``).

A request that is preempted restarts from scratch (``num_computed_tokens = 0``)
with its prompt plus the tokens it has generated, like vLLM's scheduler.
"""

from __future__ import annotations

import functools
import gc
import random
import time
from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

__all__ = [
    "GroupDesc",
    "RequestSpec",
    "TraceSpec",
    "Driver",
    "RunResult",
    "HybridLane",
    "run_interleaved",
    "NullLane",
    "TRACES",
    "make_trace",
    "make_fuzz_trace",
    "scout_groups",
    "gemma3_groups",
    "full_groups",
]


# --------------------------------------------------------------------------- specs
@dataclass(frozen=True)
class GroupDesc:
    """One KV cache group: ``kind`` is "full", "chunked" (param = chunk) or "sliding" (param = window)."""

    kind: str
    param: int = 0


def scout_groups() -> tuple[GroupDesc, ...]:
    """Llama-4-Scout: 1 full (NoPE) group + 3 chunked local groups, chunk 8192."""
    return (GroupDesc("full"),) + (GroupDesc("chunked", 8192),) * 3


def gemma3_groups() -> tuple[GroupDesc, ...]:
    """Gemma-3-27B as our planner groups it: 1 full + 6 sliding-window (1024) groups."""
    return (GroupDesc("full"),) + (GroupDesc("sliding", 1024),) * 6


def full_groups() -> tuple[GroupDesc, ...]:
    return (GroupDesc("full"),)


def group_specs(tr: "TraceSpec", full, chunked, sliding, dtype, state=None) -> list:
    """One spec per group of ``tr``, built with a library's spec classes (hybridkv's or
    vLLM's: the same keyword names) and its dtype value. ``state(block_size, shapes,
    page_size_padded)`` builds a state group's spec (kind "state": ``tr.state_shapes``, the
    page padded to the attention page)."""
    common = dict(block_size=tr.block_size, num_kv_heads=tr.num_kv_heads, head_size=tr.head_size, dtype=dtype)
    specs = []
    for g in tr.groups:
        if g.kind == "state":
            page = 2 * tr.block_size * tr.num_kv_heads * tr.head_size * 2  # bf16 K and V
            specs.append(state(block_size=tr.block_size, shapes=tr.state_shapes, page_size_padded=page))
        elif g.kind == "full":
            specs.append(full(**common))
        elif g.kind == "chunked":
            specs.append(chunked(attention_chunk_size=g.param, **common))
        elif g.kind == "sliding":
            specs.append(sliding(sliding_window=g.param, **common))
        else:
            raise ValueError(g.kind)
    return specs


@dataclass(frozen=True)
class RequestSpec:
    rid: str
    prompt: list[int]
    outputs: list[int]  # the tokens sampled after the prompt, in order (>= 1)


@dataclass
class TraceSpec:
    name: str
    description: str
    groups: tuple[GroupDesc, ...]
    num_blocks: int
    max_running: int
    token_budget: int
    warmup_steps: int
    num_steps: int
    requests: Callable[[], Iterator[RequestSpec]]  # a fresh, identical stream per call
    block_size: int = 16
    num_kv_heads: int = 8
    head_size: int = 128
    max_model_len: int = 1 << 22
    #: state groups (GroupDesc kind "state"): per-layer state shapes, bf16
    state_shapes: tuple[tuple[int, ...], ...] = ()
    #: which state checkpoints are cached (``prefix_cache_retention_interval``: None dense, 0, k)
    retention: int | None = None
    #: prefill chunks clipped as a scheduler for state groups does:
    #: ``align(req, num_prompt_tokens, num_tokens, num_computed, n) -> n'`` (0: not this step);
    #: a lane with its own rule (an ``align`` attribute: hybridkv's and vLLM's lanes on state
    #: traces) uses that instead
    align: Callable | None = None

    @property
    def shape(self) -> str:
        kinds: dict[str, int] = {}
        for g in self.groups:
            key = g.kind if g.kind in ("full", "state") else f"{g.kind}({g.param})"
            kinds[key] = kinds.get(key, 0) + 1
        return " + ".join(f"{n}x{k}" for k, n in kinds.items())


# ----------------------------------------------------------------- request streams
def _tokens(rng: random.Random, n: int, vocab: int = 32000) -> list[int]:
    return [x % vocab for x in array("H", rng.randbytes(2 * n))]


def decode_heavy_stream(seed: int, prompt=(1000, 9000), output=(500, 2500)) -> Callable[[], Iterator[RequestSpec]]:
    """Independent requests, long outputs: prompts cross chunk boundaries during decode."""

    def gen() -> Iterator[RequestSpec]:
        rng = random.Random(seed)
        i = 0
        while True:
            yield RequestSpec(f"d{i}", _tokens(rng, rng.randint(*prompt)), _tokens(rng, rng.randint(*output)))
            i += 1

    return gen


def shared_prefix_stream(
    seed: int,
    prefix_lens: tuple[int, ...],
    user=(100, 1000),
    output=(20, 300),
    share: float = 1.0,
    solo_prompt=(500, 6000),
    zipf: float = 1.1,
) -> Callable[[], Iterator[RequestSpec]]:
    """Requests = one of a few system prompts (Zipf-popular) + a user suffix.

    With probability ``1 - share`` a request has no shared prefix (prompt length
    drawn from ``solo_prompt``).
    """

    def gen() -> Iterator[RequestSpec]:
        rng = random.Random(seed)
        prefixes = [_tokens(rng, n) for n in prefix_lens]
        weights = [1.0 / (k + 1) ** zipf for k in range(len(prefixes))]
        i = 0
        while True:
            if rng.random() < share:
                sys_prompt = rng.choices(prefixes, weights)[0]
                prompt = sys_prompt + _tokens(rng, rng.randint(*user))
            else:
                prompt = _tokens(rng, rng.randint(*solo_prompt))
            yield RequestSpec(f"p{i}", prompt, _tokens(rng, rng.randint(*output)))
            i += 1

    return gen


# ------------------------------------------------------------------------ traces
def make_trace(name: str, quick: bool = False) -> TraceSpec:
    """The benchmark traces. ``quick`` shortens the timed part (same seeds, same shapes)."""
    if name == "a":
        return TraceSpec(
            name="a",
            description="decode-heavy, 256 running, Llama-4-Scout (1 full + 3 chunked 8192)",
            groups=scout_groups(),
            num_blocks=440_000,
            max_running=256,
            token_budget=8192,
            warmup_steps=260,
            num_steps=120 if quick else 600,
            requests=decode_heavy_stream(1),
        )
    if name == "b":
        return TraceSpec(
            name="b",
            description="prefix-heavy, 48 running, 16 system prompts of 1.1-3.8 chunks (Zipf), Scout, eviction pressure",
            groups=scout_groups(),
            num_blocks=40_000,
            max_running=48,
            token_budget=8192,
            warmup_steps=30,
            num_steps=100 if quick else 500,
            requests=shared_prefix_stream(
                2, prefix_lens=tuple(9000 + 1450 * k for k in range(16)), output=(10, 80), zipf=0.8
            ),
        )
    if name in ("c", "d"):  # the same mixed requests on the Gemma-3 layout and on one full group
        gemma = name == "c"
        return TraceSpec(
            name=name,
            description=(
                "mixed, 128 running, Gemma-3-27B (1 full + 6 sliding 1024), 60% shared prefixes"
                if gemma
                else "mixed, 128 running, one full-attention group, 60% shared prefixes"
            ),
            groups=gemma3_groups() if gemma else full_groups(),
            num_blocks=110_000 if gemma else 60_000,
            max_running=128,
            token_budget=8192,
            warmup_steps=80,
            num_steps=120 if quick else 600,
            requests=shared_prefix_stream(
                3, prefix_lens=(2000, 3000, 4000, 6000), user=(50, 800), output=(100, 1200), share=0.6
            ),
        )
    raise KeyError(name)


TRACES = ("a", "b", "c", "d")


def make_fuzz_trace(seed: int, contiguous: bool = True) -> TraceSpec:
    """A tiny random config and workload for differential testing: small blocks,
    chunk sizes and windows that are not multiples of the block, a pool of a few
    dozen blocks (eviction and preemption all the time), prompts over a 3-token
    vocabulary built from a few shared stems (so prefixes collide by accident too).

    ``contiguous``: groups of one spec are adjacent (as a planner lays them out),
    so both managers hand out new blocks in the same group order.
    """
    rng = random.Random(seed)
    bs = rng.choice((1, 2, 2, 4, 4, 8))
    kinds = []
    for _ in range(rng.randint(1, 4)):
        k = rng.choice(("full", "full", "chunked", "sliding"))
        if k == "full":
            kinds.append(GroupDesc("full"))
        elif k == "chunked":
            kinds.append(GroupDesc("chunked", rng.choice((bs, 2 * bs, 3 * bs, 4 * bs, bs + 1, 3 * bs - 1, 5, 6, 7, 12))))
        else:
            kinds.append(GroupDesc("sliding", rng.choice((2, 3, 4, 5, bs, bs + 1, 2 * bs, 2 * bs + 1, 7, 9, 16))))
    if rng.random() < 0.5:
        kinds = kinds[:1] * len(kinds) if rng.random() < 0.3 else kinds
    if contiguous:
        order: dict = {}
        for g in kinds:
            order.setdefault(g, []).append(g)
        kinds = [g for gs in order.values() for g in gs]
    vocab = rng.choice((2, 3, 4))
    stems = [[rng.randrange(vocab) for _ in range(rng.randint(1, 12 * bs))] for _ in range(rng.randint(1, 4))]
    plen = (1, rng.choice((4, 8, 16)) * bs)
    olen = (1, rng.choice((2, 6, 20, 40)))

    def gen() -> Iterator[RequestSpec]:
        r = random.Random(seed * 7919 + 1)
        i = 0
        while True:
            stem = r.choice(stems) if r.random() < 0.8 else []
            prompt = stem + [r.randrange(vocab) for _ in range(r.randint(*plen))]
            yield RequestSpec(f"f{i}", prompt, [r.randrange(vocab) for _ in range(r.randint(*olen))])
            i += 1

    num_blocks = rng.randint(8, 80) * len(kinds)
    tr = TraceSpec(
        name=f"fuzz{seed}",
        description="",
        groups=tuple(kinds),
        num_blocks=num_blocks,
        max_running=rng.randint(1, 6),
        token_budget=rng.choice((1, 3, 8, 16, 64, 1000)),
        warmup_steps=0,
        num_steps=rng.randint(40, 160),
        requests=gen,
        block_size=bs,
        num_kv_heads=1,
        head_size=8,
    )
    tr.description = f"{tr.shape}; bs {bs}; {num_blocks} blocks; running {tr.max_running}; budget {tr.token_budget}"
    return tr


# ------------------------------------------------------------------------ driver
class ReqState:
    __slots__ = ("spec", "req", "append", "computed", "total", "out_idx", "tokens", "rebuilt")

    def __init__(self, spec: RequestSpec):
        self.spec = spec
        self.req = None
        self.append = None
        self.computed = 0
        self.total = len(spec.prompt)
        self.out_idx = 0
        self.tokens = spec.prompt  # tokens a (re)built request starts with
        self.rebuilt = False  # preempted: rebuilt from its tokens (vLLM would keep its hashes)


@dataclass
class RunResult:
    trace: str
    lane: str
    steps: int = 0
    step_ns: list[int] = field(default_factory=list)  # timed steps only
    req_steps: int = 0  # (request, step) pairs scheduled in timed steps
    lookups: int = 0
    hit_tokens: int = 0  # all steps
    query_tokens: int = 0
    timed_hit_tokens: int = 0
    preemptions: int = 0
    admitted: int = 0
    finished: int = 0
    alloc_fail_admit: int = 0
    build_ns: int = 0  # request construction (prompt hashing), not in step_ns
    hash_ns: int = 0  # sched lanes: prompt hashing in timed steps (part of step_ns)
    init_ns: int = 0  # manager construction

    @property
    def us_per_step(self) -> float:
        return sum(self.step_ns) / max(1, len(self.step_ns)) / 1e3

    @property
    def us_per_req_step(self) -> float:
        return sum(self.step_ns) / max(1, self.req_steps) / 1e3


class Driver:
    """Plays a trace on one lane. ``hook(step)`` (check mode) runs before each step, untimed."""

    def __init__(self, trace: TraceSpec, lane, hook: Callable[[int], None] | None = None, freeze_gc: bool = False):
        self.trace = trace
        self.lane = lane
        self.hook = hook
        # like vLLM's engine core (freeze_gc_heap after start-up): the pool's blocks
        # are long-lived, so the cyclic GC should not rescan them during the run
        self.freeze_gc = freeze_gc

    def start(self, steps: int | None = None) -> RunResult:
        """Build the lane's manager; ``advance`` then plays the steps. Returns the (live) result."""
        t = time.perf_counter_ns()
        self.lane.build(self.trace)
        self.result = RunResult(self.trace.name, self.lane.name, init_ns=time.perf_counter_ns() - t)
        self._gen = self._steps(self.result, steps)
        return self.result

    def advance(self, n: int) -> bool:
        """Play up to n more steps; False once the trace is done."""
        for _ in range(n):
            if next(self._gen, None) is None:
                return False
        return True

    def run(self, steps: int | None = None) -> RunResult:
        res = self.start(steps)
        if self.freeze_gc:
            gc.collect()
            gc.freeze()
        try:
            while self.advance(1 << 30):
                pass
            return res
        finally:
            if self.freeze_gc:
                gc.unfreeze()

    def _steps(self, res: "RunResult", steps: int | None):
        """One step per ``yield``: untimed top-up and request building, then the timed scheduling
        step (decodes, preemption, admission, token advance). The timed part is one inlined loop
        on purpose: every lane pays the same, minimal driver overhead inside the timer."""
        tr = self.trace
        lane = self.lane
        stream = tr.requests()
        waiting: deque[ReqState] = deque()
        running: list[ReqState] = []
        total_steps = tr.warmup_steps + tr.num_steps if steps is None else steps
        perf = time.perf_counter_ns
        make = lane.make_request
        budget0 = tr.token_budget
        max_running = tr.max_running
        sched_mode = getattr(lane, "sched", False)
        hash_request = lane.hash_request if sched_mode else None
        new_ids = lane.new_ids if sched_mode else None
        table_ids = lane.table_ids if sched_mode else None
        arrived: list = []
        align = tr.align
        if align is not None:
            align = getattr(lane, "align", None) or align
        for step in range(total_steps):
            timed = step >= tr.warmup_steps
            # ---- untimed: top up the queue, build the request objects that may be admitted
            free_slots = max_running - len(running)
            while len(waiting) < free_slots + 1:
                waiting.append(ReqState(next(stream)))
            arrived.clear()
            t = perf()
            for k in range(min(free_slots, len(waiting))):
                st = waiting[k]
                if st.req is None:
                    st.req, st.append = make(st.spec.rid, st.tokens)
                    if sched_mode:
                        if st.rebuilt:
                            hash_request(st.req)
                        else:
                            arrived.append(st.req)
            res.build_ns += perf() - t
            if self.hook is not None:
                self.hook(step)
            # ---- timed: one scheduling step
            lookup = lane.lookup
            alloc = lane.alloc
            free = lane.free
            t0 = perf()
            if sched_mode:
                for req in arrived:
                    hash_request(req)
                if timed:
                    res.hash_ns += perf() - t0
            lane.new_step()
            budget = budget0
            sched: list = []
            preempted = False
            i = 0
            while i < len(running):
                st = running[i]
                n = st.total - st.computed
                if n > budget:
                    n = budget
                if align is not None and n > 0:
                    n = align(st.req, len(st.tokens), st.total, st.computed, n)
                if n <= 0:
                    i += 1
                    continue
                while (new := alloc(st.req, n)) is None:
                    victim = running.pop()
                    free(victim.req)
                    victim.req = victim.append = None
                    victim.computed = 0
                    victim.tokens = victim.spec.prompt + victim.spec.outputs[: victim.out_idx]
                    victim.rebuilt = True
                    waiting.appendleft(victim)
                    res.preemptions += 1
                    preempted = True
                    if victim is st:
                        break
                else:
                    if sched_mode:
                        new_ids(new)
                    budget -= n
                    sched.append((st, n))
                    i += 1
            if not preempted:
                while waiting and len(running) < max_running and budget > 0:
                    st = waiting[0]
                    req = st.req
                    r = lookup(req)
                    hit = r[1]
                    res.lookups += 1
                    res.hit_tokens += hit
                    res.query_tokens += st.total
                    if timed:
                        res.timed_hit_tokens += hit
                    n = st.total - hit
                    if n > budget:
                        n = budget
                    if align is not None:
                        n = align(req, len(st.tokens), st.total, hit, n)
                        if n <= 0:  # vLLM's scheduler: stop admitting this step
                            break
                    if alloc(req, n, hit, r[0]) is None:
                        res.alloc_fail_admit += 1
                        break
                    if sched_mode:
                        table_ids(req.request_id)
                    waiting.popleft()
                    running.append(st)
                    res.admitted += 1
                    budget -= n
                    sched.append((st, n + hit))
            done = False
            for st, n in sched:
                st.req.num_computed_tokens += n
                st.computed += n
                if st.computed == st.total:
                    out = st.spec.outputs
                    st.append(out[st.out_idx])
                    st.out_idx += 1
                    st.total += 1
                    if st.out_idx == len(out):
                        free(st.req)
                        st.out_idx = -1
                        done = True
            if done:
                running = [s for s in running if s.out_idx >= 0]
            t1 = perf()
            if done:
                res.finished += sum(1 for s, _ in sched if s.out_idx < 0)
            if timed:
                res.step_ns.append(t1 - t0)
                res.req_steps += len(sched)
            res.steps += 1
            yield res
        lane.close(running)


def run_interleaved(trace_lanes, slice_steps: int = 10) -> list[RunResult]:
    """Play several (trace, lane) pairs side by side: ``slice_steps`` steps of each in
    turn, the order flipping every slice (A B B A A B ...), so load changes on a
    shared machine hit every lane alike. Managers are built first, then the GC heap
    is frozen (as vLLM's engine core does after start-up)."""
    drivers = [Driver(tr, lane) for tr, lane in trace_lanes]
    results = [d.start() for d in drivers]
    gc.collect()
    gc.freeze()
    try:
        live = list(range(len(drivers)))
        flip = False
        while live:
            order = live[::-1] if flip else live
            flip = not flip
            for k in list(order):
                if not drivers[k].advance(slice_steps):
                    live.remove(k)
    finally:
        gc.unfreeze()
    return results


# ------------------------------------------------------------------------- lanes
def _noop() -> None:
    return None


class HybridLane:
    """hybridkv's KVCacheManager (system python3 or any python with src/ on the path)."""

    def __init__(self, uncached_first: bool = True, hash_algo: str = "sha256", name: str | None = None,
                 stripe_groups: bool = True, read_ids: bool = False, sched: bool = False, junction: bool = True):
        self.uncached_first = uncached_first
        self.junction = junction  # state traces: False drops the shared-prefix junction (an experiment)
        self.hash_algo = hash_algo
        self.stripe_groups = stripe_groups
        self.read_ids = read_ids  # read every group's block ids after each allocation (as the scheduler does)
        self.sched = sched  # used as vLLM's scheduler uses a manager (see the module docstring)
        self.name = name or ("hybridkv" if uncached_first else "hybridkv(lru)") + ("+sched" if sched else "")
        self.kv = None

    def build(self, tr: TraceSpec) -> None:
        from hybridkv.core.config import CacheManagerConfig, KVCacheConfig, KVCacheGroup
        from hybridkv.core.kv_cache_manager import KVCacheManager
        from hybridkv.core.specs import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec
        from hybridkv.core.state_spec import StateSpec

        def state(**kw):
            return StateSpec(dtypes=("bfloat16",) * len(kw["shapes"]), **kw)

        specs = group_specs(tr, FullAttentionSpec, ChunkedLocalAttentionSpec, SlidingWindowSpec, "bfloat16", state)
        groups = tuple(KVCacheGroup(spec, (f"layers.{i}",)) for i, spec in enumerate(specs))
        cfg = KVCacheConfig(num_blocks=tr.num_blocks, groups=groups)
        self.kv = kv = KVCacheManager(
            cfg,
            CacheManagerConfig(max_model_len=tr.max_model_len, enable_caching=True, hash_algo=self.hash_algo,
                               stripe_groups=self.stripe_groups, prefix_cache_retention_interval=tr.retention),
            uncached_first=self.uncached_first,
        )
        self.lookup = kv.get_computed_blocks
        self.alloc = kv.allocate_slots
        if self.read_ids:
            allocate, ids = kv.allocate_slots, kv.get_block_ids

            def alloc(req, n, hit=0, blocks=None):
                out = allocate(req, n, hit, blocks)
                if out is not None:
                    ids(req.request_id)
                return out

            self.alloc = alloc
        self.free = kv.free
        # state checkpoints cached in a step may be hit only from the next one (vLLM's hook too)
        self.new_step = kv.new_step_starts if kv.coordinator.state_managers else _noop
        if tr.align is not None and kv.coordinator.state_managers:
            # our own chunk rule, as our scheduler asks it: the step budget, and the junction
            # get_computed_blocks set on the request (request.shared_prefix_boundary)
            align_new, budget = kv.align_num_new_tokens, tr.token_budget
            self.align = lambda req, num_prompt, num_tokens, start, n: align_new(req, start, n, budget)
            if not self.junction:
                lookup = self.lookup

                def lookup_no_junction(req):
                    out = lookup(req)
                    req.shared_prefix_boundary = 0
                    return out

                self.lookup = lookup_no_junction
        if self.sched:
            from hybridkv.core.kv_cache_manager import KVCacheBlocks
            from hybridkv.core.request import Request

            self._Request = Request
            self.hash_request = kv.hasher.extend  # the prompt's block hashes (Request.__init__ does this)
            # allocate_slots' result: the new ids per group (None when none, as vLLM's scheduler asks)
            self.new_ids = functools.partial(KVCacheBlocks.get_block_ids, allow_none=True)
            # the whole table: the manager's id lists (live; hybridkv's scheduler hands them to the
            # runner as they are, where vLLM builds new lists from its block objects)
            self.table_ids = kv.get_block_ids

    def make_request(self, rid: str, tokens: list[int]):
        if self.sched:  # hashed by the driver, timed (hash_request)
            r = self._Request(rid, tokens)
            r._hasher = self.kv.hasher  # later appends hash as usual
        else:
            r = self.kv.make_request(rid, tokens)
        return r, r.append_token_ids

    # --- inspection (check mode)
    def num_free_blocks(self) -> int:
        return self.kv.num_free_blocks

    def block_ids(self, rid: str) -> list[list[int]]:
        return [list(g) for g in self.kv.get_block_ids(rid)]

    def num_cached_blocks(self) -> int:
        return self.kv.pool.num_cached_blocks

    def close(self, running) -> None:
        pass


class _NullReq:
    __slots__ = ("num_computed_tokens",)

    def __init__(self):
        self.num_computed_tokens = 0


class NullLane:
    """No manager at all: measures the driver's own cost per scheduled request."""

    name = "null"
    _empty = ((), 0)

    def build(self, tr: TraceSpec) -> None:
        self.lookup = lambda req: self._empty
        self.alloc = lambda req, n, hit=0, blocks=None: True
        self.free = lambda req: None
        self.new_step = _noop

    def make_request(self, rid, tokens):
        return _NullReq(), lambda tok: None

    def close(self, running) -> None:
        pass


def driver_overhead_ns(trace: TraceSpec) -> float:
    """ns of driver work per scheduled (request, step), from a run on the null lane."""
    res = Driver(trace, NullLane()).run()
    return sum(res.step_ns) / max(1, res.req_steps)


def median(xs):
    s = sorted(xs)
    n = len(s)
    if not n:
        return float("nan")
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2

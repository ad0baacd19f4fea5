"""``bench_route``'s workload through the router's policies, simulated: no processes, no noise but what a seed gives.

    python3 benchmarks/sim_route.py [--num-blocks 256,512,768,1024] [--seeds 5]
                                    [--policies full-only,hybrid,oracle,least-loaded]
                                    [--max-imbalance 8] [--max-share-ratio 1.5] [--jitter 0.5]

Each replica is the core's KV cache manager and scheduler (the tiny test Gemma 3's layout:
sliding window 12 and full groups, block 4) stepping a fake runner; the router is the real
one's pieces: a :class:`~hybridkv.router.replica.Replica` per replica whose index applies
the replica's KV events (as wire structs, at the end of each step plus ``--event-delay-ms``),
and :func:`~hybridkv.router.policy.make_policy`'s policies (the oracle asks the manager at
the decision). Time is an event queue: a step lasts ``--step-ms`` plus ``--token-us`` per
token it computes, times a uniform jitter of +-``--jitter``; a request reaches its replica
``--transit-ms`` (the same jitter) after the decision and waits for its next step; a client
sends its next turn when the last one finishes, racing the router's release of it
(``--release-ms``). So it answers, in seconds and the same every time for one
seed, what ``bench_route``'s live runs answer in minutes with +-1 % of noise between rounds:
which hits a policy obtains on this workload, and whether a rule helps across seeds (the
seed moves the step times, hence the order in which requests meet).

What it leaves out: the live transit's variance (a 2-core machine shared by 3 replicas, the
router and the clients), the model's real step times, HTTP; a step's blocks are cached and
freed when it starts, and the oracle asks the managers at once (live, its peek waits for a
replica step, which is what it loses there): compare its hybrid / oracle ratios with each
other, not with the live ones. Take its verdicts to the live
benchmark; it is where to look first, not the last word.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
import random
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import _paths  # noqa: F401,I001  (this checkout's src and tests.support importable)
from bench_route import make_workload
from tests.support.tiny_server import make_tiny_dir

from hybridkv.core.kv_cache_manager import KVCacheManager
from hybridkv.core.usage import usable_blocks
from hybridkv.protocol.kv_events import to_wire
from hybridkv.router.balance import DEFAULT_MAX_SHARE_RATIO, DEFAULT_SHARE_WINDOW, Balance
from hybridkv.router.policy import DEFAULT_MAX_IMBALANCE, make_policy
from hybridkv.router.replica import Replica, ReplicaSpec
from hybridkv.sampling_params import SamplingParams
from hybridkv.scheduler.fake_runner import FakeRunner
from hybridkv.scheduler.scheduler import Scheduler


@dataclass(frozen=True)
class Timing:
    step_ms: float = 12.0
    token_us: float = 30.0
    transit_ms: float = 5.0
    event_delay_ms: float = 1.0
    jitter: float = 0.5
    #: after a request's last token, the router's in-flight count and the client's next send
    #: each happen within this many ms (either first: the live router often counts a finished
    #: request while the client already sends the next)
    release_ms: float = 2.0


@dataclass
class SimRun:
    policy: str
    seed: int
    moves: int = 0
    ttft: list[float] = field(default_factory=list)
    per_replica: list[int] = field(default_factory=list)
    requests: dict = field(default_factory=dict)  # (conv, turn) -> (replica, predicted, obtained, prompt tokens)

    @property
    def predicted(self) -> int:
        return sum(v[1] for v in self.requests.values())

    @property
    def obtained(self) -> int:
        return sum(v[2] for v in self.requests.values())

    @property
    def false(self) -> int:
        """Predicted hit tokens not obtained (false residency)."""
        return sum(max(0, v[1] - v[2]) for v in self.requests.values())

    @property
    def prompt(self) -> int:
        return sum(v[3] for v in self.requests.values())


class SimReplica:
    """A fresh KV cache manager and scheduler (as ``serve`` builds them from ``engine``'s
    layout and config) and the router's view of them."""

    def __init__(self, name: str, engine) -> None:
        cfg, max_len = engine.config, engine.max_model_len
        self.kv = KVCacheManager(engine.kv_cache_config, cfg.cache_manager_config(max_len))
        self.sched = Scheduler(self.kv, cfg.scheduler_config(max_len))
        self.runner = FakeRunner()
        self.router_view = Replica(name, ReplicaSpec("http://127.0.0.1:1"))
        self.busy = False


def simulate(policy_name: str, seed: int, work, ids_of, engine, replicas: int, max_tokens: int,
             max_imbalance: int, balance: Balance | None, timing: Timing, explain: bool = False) -> SimRun:
    """One policy over ``work`` on fresh replicas, timing seed ``seed``."""
    rng = random.Random(seed)
    reps = [SimReplica(f"r{i}", engine) for i in range(replicas)]
    views = [r.router_view for r in reps]
    by_view = {id(r.router_view): r for r in reps}

    async def oracle(view, ids):
        return by_view[id(view)].kv.peek_prefix_hit(ids)

    policy = make_policy(policy_name, max_imbalance=max_imbalance, balance=balance, oracle=oracle)
    run = SimRun(policy_name, seed, per_replica=[0] * replicas)
    heap: list = []
    tie = itertools.count()

    def at(t: float, kind: str, *data) -> None:
        heapq.heappush(heap, (t, next(tie), kind, data))

    def jit() -> float:
        return 1.0 + rng.uniform(-timing.jitter, timing.jitter)

    pos = [0] * len(work.schedules)
    pending: dict[str, tuple] = {}  # request id -> (client, conv, sent, predicted, replica index, ids, turn)
    home: dict[int, int] = {}
    admitted: set[str] = set()
    first_token: dict[str, float] = {}
    rid_counter = itertools.count()

    def send(t: float, client: int) -> None:
        sched = work.schedules[client]
        if pos[client] >= len(sched):
            return
        conv, turn, messages = sched[pos[client]]
        pos[client] += 1
        ids = ids_of(messages)
        if explain:
            before = [(v.score(ids), v.score_full_only(ids), r.kv.peek_prefix_hit(ids), v.in_flight,
                       round(policy.shares.share(v.name), 2) if getattr(policy, "shares", None) else None)
                      for v, r in zip(views, reps)]
        view, hit = loop.run_until_complete(policy.choose(ids, views))  # the decision takes no simulated time
        i = views.index(view)
        moved = home.get(conv, i) != i
        if explain and moved:
            print(f"    t={t:7.3f} conv {conv} turn {turn} ({len(ids)} tokens) moved r{home[conv]} -> r{i}: "
                  f"(hybrid, full-only, peek, in flight, share) {before}")
        view.in_flight += 1
        rid = f"q{next(rid_counter)}"
        pending[rid] = (client, conv, t, hit, i, ids, turn)
        run.moves += moved
        home[conv] = i
        run.per_replica[i] += 1
        at(t + timing.transit_ms * 1e-3 * jit(), "arrive", rid)

    def start_step(t: float, r: SimReplica) -> None:
        if r.busy or not r.sched.has_unfinished_requests():
            return
        waiting = {s.request_id for s in r.sched.waiting}
        output, finished = r.sched.step(r.runner)
        tokens = 0
        for sr in output.scheduled:
            tokens += len(sr.token_ids)
            if sr.request_id in waiting and sr.request_id not in admitted:
                admitted.add(sr.request_id)
                client, conv, sent, hit, i, ids, turn = pending[sr.request_id]
                run.requests[conv, turn] = (i, hit, sr.num_computed_tokens, len(ids))
        dur = (timing.step_ms + timing.token_us * 1e-3 * tokens) * 1e-3 * jit()
        r.busy = True
        events = [to_wire(e) for e in r.kv.take_events()]
        at(t + dur, "step_done", r, [s.request_id for s in finished],
           [sr.request_id for sr in output.scheduled if sr.sample])
        if events:
            at(t + dur + timing.event_delay_ms * 1e-3, "events", r, events)

    for c in range(len(work.schedules)):
        at(0.0, "send", c)
    loop = asyncio.new_event_loop()  # runs the policies' coroutines (the oracle gathers)
    try:
        while heap:
            t, _, kind, data = heapq.heappop(heap)
            if kind == "send":
                send(t, data[0])
            elif kind == "arrive":
                rid = data[0]
                client, conv, sent, hit, i, ids, turn = pending[rid]
                r = reps[i]
                r.sched.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
                start_step(t, r)
            elif kind == "release":
                data[0].router_view.in_flight -= 1
            elif kind == "events":
                data[0].router_view.on_events(data[1])
            else:  # step_done
                r, finished, sampled = data
                r.busy = False
                for rid in sampled:
                    if rid not in first_token:
                        first_token[rid] = t
                        run.ttft.append(t - pending[rid][2])
                for rid in finished:
                    at(t + timing.release_ms * 1e-3 * rng.random(), "release", r)
                    at(t + timing.release_ms * 1e-3 * rng.random(), "send", pending[rid][0])
                start_step(t, r)
    finally:
        loop.close()
    for r in reps:  # every request served, every block back in the free queue, the books consistent
        r.sched.check_invariants()
        if r.sched.has_unfinished_requests() or r.kv.num_free_blocks != usable_blocks(r.kv.kv_cache_config.num_blocks):
            raise RuntimeError(f"{r.router_view.name}: requests or blocks left after the workload")
    if len(run.requests) != work.num_requests:
        raise RuntimeError(f"{len(run.requests)} of {work.num_requests} requests admitted")
    return run


@dataclass(frozen=True)
class SimSetup:
    """What stays fixed across a sweep: the workload's shape, the replicas and the router's rules."""

    replicas: int = 3
    systems: int = 3
    conversations: int = 48
    turns: int = 5
    clients: int = 6
    open: int = 4
    max_tokens: int = 8
    max_imbalance: int = DEFAULT_MAX_IMBALANCE
    balance: Balance | None = Balance()
    timing: Timing = Timing()
    max_model_len: int = 512


def sweep(setup: SimSetup, num_blocks: list[int], seeds: int, policies: list[str], *,
          explain: str | None = None) -> dict[int, dict[str, list[SimRun]]]:
    """Every policy at every pool size for timing seeds ``0 .. seeds - 1`` (the workload is
    ``bench_route``'s seed 0): ``{num_blocks: {policy: [run per seed]}}``."""
    from hybridkv.engine.llm import LLM
    from hybridkv.tokenizer.prompts import encode_prompt
    from tests.support.tiny_server import engine_config

    work = make_workload(0, setup.systems, setup.conversations, setup.turns, setup.clients, setup.open)
    out: dict[int, dict[str, list[SimRun]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_tiny_dir(Path(tmp)))
        tokenizer = LLM(model_dir, engine_config(num_blocks=64, max_model_len=setup.max_model_len)).tokenizer
        cache: dict[int, list[int]] = {}

        def ids_of(messages):  # the token ids the router and the replica see (one chat template)
            key = id(messages)
            if key not in cache:
                cache[key] = list(encode_prompt(tokenizer, messages, 0))
            return cache[key]

        for nb in num_blocks:  # one model load per pool size: its layout; each run builds fresh managers
            engine = LLM(model_dir, engine_config(num_blocks=nb, max_model_len=setup.max_model_len,
                                                  enable_kv_events=True, queued_prefix="refresh")).engine
            out[nb] = {p: [simulate(p, seed, work, ids_of, engine, setup.replicas, setup.max_tokens,
                                    setup.max_imbalance, setup.balance, setup.timing, explain=explain == p)
                           for seed in range(seeds)] for p in policies}
    return out


def report(results: dict[int, dict[str, list[SimRun]]]) -> None:
    for nb, by_policy in results.items():
        seeds = len(next(iter(by_policy.values())))
        print(f"\n{nb} blocks per replica, {seeds} timing seeds: mean over the seeds (requests per replica: seed 0)")
        print(f"  {'policy':13} {'hit tokens':>10} {'% prompt':>8} {'false':>6} {'moves':>6} {'TTFT ms':>8}  per seed")
        for p, rs in by_policy.items():
            mean = statistics.mean
            print(f"  {p:13} {mean(r.obtained for r in rs):10.0f} {100 * mean(r.obtained / r.prompt for r in rs):7.1f}% "
                  f"{mean(r.false for r in rs):6.0f} {mean(r.moves for r in rs):6.1f} "
                  f"{1e3 * mean(statistics.mean(r.ttft) for r in rs):8.1f}  {', '.join(str(r.obtained) for r in rs)} "
                  f"{rs[0].per_replica}")
        if "hybrid" in by_policy and "full-only" in by_policy:
            d = [h.obtained - f.obtained for h, f in zip(by_policy["hybrid"], by_policy["full-only"])]
            print(f"  hybrid - full-only per seed: {d} (below in {sum(x < 0 for x in d)} of {len(d)})")
        if "hybrid" in by_policy and "oracle" in by_policy:
            q = [h.obtained / o.obtained for h, o in zip(by_policy["hybrid"], by_policy["oracle"]) if o.obtained]
            print(f"  hybrid / oracle per seed: {', '.join(f'{x:.3f}' for x in q)}")


def main(argv: list[str] | None = None) -> int:
    d, t = SimSetup(), Timing()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-blocks", default="256,512,768,1024", metavar="N[,N...]")
    ap.add_argument("--seeds", type=int, default=5, help="timing seeds per pool size (the workload stays seed 0)")
    ap.add_argument("--policies", default="full-only,hybrid,oracle,least-loaded")
    ap.add_argument("--replicas", type=int, default=d.replicas)
    ap.add_argument("--systems", type=int, default=d.systems)
    ap.add_argument("--conversations", type=int, default=d.conversations)
    ap.add_argument("--turns", type=int, default=d.turns)
    ap.add_argument("--clients", type=int, default=d.clients)
    ap.add_argument("--open", type=int, default=d.open)
    ap.add_argument("--max-tokens", type=int, default=d.max_tokens)
    ap.add_argument("--max-imbalance", type=int, default=d.max_imbalance)
    ap.add_argument("--max-share-ratio", type=float, default=DEFAULT_MAX_SHARE_RATIO, help="0: no share rule")
    ap.add_argument("--share-window", type=int, default=DEFAULT_SHARE_WINDOW)
    ap.add_argument("--step-ms", type=float, default=t.step_ms)
    ap.add_argument("--token-us", type=float, default=t.token_us)
    ap.add_argument("--transit-ms", type=float, default=t.transit_ms)
    ap.add_argument("--event-delay-ms", type=float, default=t.event_delay_ms)
    ap.add_argument("--jitter", type=float, default=t.jitter)
    ap.add_argument("--release-ms", type=float, default=t.release_ms)
    ap.add_argument("--explain-moves", default=None, metavar="POLICY",
                    help="print each decision of POLICY that moved a chat (hits, in flight, shares)")
    args = ap.parse_args(argv)
    setup = SimSetup(
        replicas=args.replicas, systems=args.systems, conversations=args.conversations, turns=args.turns,
        clients=args.clients, open=args.open, max_tokens=args.max_tokens, max_imbalance=args.max_imbalance,
        balance=Balance(args.max_share_ratio, args.share_window) if args.max_share_ratio else None,
        timing=Timing(args.step_ms, args.token_us, args.transit_ms, args.event_delay_ms, args.jitter, args.release_ms),
    )
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    report(sweep(setup, [int(x) for x in args.num_blocks.split(",")], args.seeds, policies,
                 explain=args.explain_moves))
    return 0


if __name__ == "__main__":
    sys.exit(main())

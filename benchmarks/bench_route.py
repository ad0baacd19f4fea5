"""``hybridkv route``: what each routing policy gets out of N replicas' prefix caches.

    python3 benchmarks/bench_route.py [--quick] [--model NAME|DIR] [--replicas 3] [--rounds 2]
                                      [--policies round-robin,least-loaded,full-only,hybrid,oracle]
                                      [--clients 6] [--open 4] [--conversations 48] [--turns 5]
                                      [--num-blocks N[,N...]] [--max-imbalance 8] [--max-share-ratio 1.5] [--decompose]
                                      [--systems 3] [--no-route-cost]

One seeded workload goes through ``hybridkv route`` with each policy in turn:

* (a) ``round-robin``, (b) ``least-loaded``: no cache knowledge;
* (c) ``full-only``: the KV-event index scoring only the full-attention group (what
  today's routers do for hybrid models);
* (d) ``hybrid``: the index scoring every group under its own rule (the core's);
* (e) ``oracle``: the router asks each replica's manager (``POST /kv_cache/peek``).

Per policy run, everything is fresh: ``--replicas`` ``hybridkv serve`` processes (KV events +
replay on, a pool of ``--num-blocks`` blocks so the workload's working set is a few times
the pool: blocks are evicted) and one ``hybridkv route --policy P`` in front of them; every
policy starts from empty caches. A round runs the five policies one after the other, in an
order rotated by one each round, and the per-round ratios (hybrid / oracle, hybrid - full-only)
are taken within a round (side by side), then the median over ``--rounds``.

Workload (the same requests, seeded, for every policy): ``--systems`` system prompts;
``--conversations`` chats, each on one system prompt, of ``--turns`` turns; turn ``t``'s
messages are the system prompt, the ``t - 1`` earlier user messages each followed by a
*scripted* assistant reply, and a new user message (scripted replies, not the model's: the
prompts, hence the hits, do not depend on which replica sampled what). ``--clients``
concurrent clients each own a share of the conversations and keep ``--open`` of them open,
sending one turn of each in rotation (a finished chat is replaced by the client's next), so
a conversation comes back after the other clients' and its siblings' traffic has pushed
on the pool: its sliding-window blocks (freed while its last turn ran, so early in the LRU)
are evicted before its full-attention chain. A full-only index still sees the chain and
predicts a long hit the replica cannot give (false residency); the hybrid index does not.

Requests: streaming ``POST /v1/chat/completions`` (greedy, ``--max-tokens`` new tokens,
``ignore_eos``, ``stream_options.include_usage``); TTFT = request sent to the first chunk
with a choice (the server sends the role with the first token, not before); the final
usage chunk gives ``prompt_tokens`` and ``prompt_tokens_details.cached_tokens`` (the hit
the replica obtained); the router's headers give the replica and the predicted hit.
Printed per policy (all rounds pooled): hit tokens obtained (and % of prompt tokens),
predicted, false residency = sum(max(0, predicted - obtained)) (and % of predicted), mean
TTFT, requests/s and output tokens/s, requests per replica and how often a chat moved to
another replica; then the targets: hybrid obtains at least full-only's hit tokens
in every round and >= 0.93x the oracle's (median of the rounds), with a mean TTFT at most
1.1x least-loaded's; with ``--decompose`` the index's error at the decision <= 1 % of the
predicted hit tokens, and what was lost after the decision beside it. Last, the router's own
cost (``benchmarks/route_cost.py``): µs per routing decision at 8 replicas x 100k indexed
blocks each.

Where predicted hit tokens went: the replicas log each finished request's hits (``serve
--log-level debug``: when queued, at the first and last admission; joined to the response
by its id, which names the engine request), so the predicted hit tokens not obtained split
into those lost before the replica queued the request and those lost while queued.
``--decompose``: the hybrid and full-only routers also ask the chosen replica's manager at
each decision (``route --shadow-peek``), which splits the first part into what the replica
no longer held at the decision (the index's error) and what it evicted while the request
was in transit. The peek delays the request by one of the replica's steps, so it also
adds to what is lost in transit: take false residency from runs without it.

``--num-blocks 256,1024``: the whole benchmark at each pool size in turn, then the targets
side by side. The pool size sets the regime: a small pool (the working set several times
the pool) evicts sliding-window blocks that a full-only index still counts, and also
evicts, within the tens of milliseconds a request spends between the router and the
replica's scheduler on this 2-core machine, hits that even the oracle saw.

``benchmarks/sim_route.py`` runs this workload through the same policies and index in a
simulation (the core's managers as replicas, time as an event queue): seconds per sweep,
the same result for one seed, the place to try a routing rule before this benchmark.

``--max-share-ratio`` (default ``route``'s, 1.5): the balance rule (``router/balance.py``): a
replica whose share of the last ~64 decisions exceeds 1.5x the least-served replica's is
passed over for hits (0: no rule).

``--max-imbalance`` (default ``route``'s, 8): a hit may put at most this many more in-flight
requests on a replica than on the least loaded. With 6 clients over 3 replicas (2 each on
average) 8 practically never binds here: the share rule keeps the balance. Earlier runs
used 2 (the default before the share rule existed, when larger values piled the chats of
one system prompt onto one replica): with 6 clients the in-flight counts swing by 2 within a few
steps, so that rule moved established chats away from their cache (``sim_route.py
--explain-moves hybrid`` shows each such move); 0 is least-loaded with hits as tie-break
only.

Default: the tiny random Gemma 3 of the tests (4 sliding-window-12 layers + 2 full, 128-id
character tokenizer; built in a temp dir), block 4, 3 replicas of 256 blocks, 6 clients x 4
open chats, 48 chats of 5 turns, 2 rounds (a few minutes on 2 cores). ``--quick``: 24 chats
of 4 turns, 1 round, 5 policies (about a minute). ``--model DIR_OR_NAME`` serves a real
model (gemma-3-270m works, but 3 replicas take ~5 GB RAM each; give ``--num-blocks`` and
``--block-size`` to suit it). Every replica runs ``OMP_NUM_THREADS=--threads`` (default 1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
import _paths  # noqa: E402,F401  (this checkout's src and tests.support importable)
from tests.support.tiny_server import make_tiny_dir  # noqa: E402
from tests.support.processes import HybridkvProcess, free_port  # noqa: E402

from hybridkv.router.balance import DEFAULT_MAX_SHARE_RATIO  # noqa: E402
from hybridkv.router.policy import DEFAULT_MAX_IMBALANCE  # noqa: E402

POLICIES = ("round-robin", "least-loaded", "full-only", "hybrid", "oracle")
READY_TIMEOUT = 300.0
STOP_TIMEOUT = 30.0
WORDS = ("alpha beta gamma delta omega kappa sigma theta lambda zeta river stone cloud light north paper "
         "garden silver window orange market engine castle winter summer yellow forest").split()


# --------------------------------------------------------------------------- processes
def start_process(command: str, args: list[str], threads: int) -> HybridkvProcess:
    """``python -m hybridkv COMMAND ...``, not waited for (the test suite's harness)."""
    return HybridkvProcess(args, command=command, wait=False, threads=threads, error=SystemExit,
                           ready_timeout=READY_TIMEOUT, stop_timeout=STOP_TIMEOUT)


@dataclass(frozen=True)
class Setup:
    model: str
    replicas: int
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_model_len: int
    max_imbalance: int
    threads: int
    decompose: bool = False
    queued_prefix: str = "refresh"
    max_share_ratio: float = DEFAULT_MAX_SHARE_RATIO
    kv_store: str = "all"

    def start_replica(self) -> tuple[HybridkvProcess, str]:
        http, pub, replay = free_port(), free_port(), free_port()  # known before it binds: the router starts alongside
        p = start_process("serve", [self.model, "--port", str(http), "--served-model-name", "bench", "--block-size",
                           str(self.block_size), "--num-blocks", str(self.num_blocks), "--max-num-seqs",
                           str(self.max_num_seqs), "--max-model-len", str(self.max_model_len),
                           "--kv-events", f"tcp://127.0.0.1:{pub}", "--kv-events-replay", f"tcp://127.0.0.1:{replay}",
                           "--queued-prefix", self.queued_prefix, "--kv-store", self.kv_store,
                           "--log-level", "debug"],  # each finished request's hits, joined to its response
                 self.threads)
        return p, f"http://127.0.0.1:{http},tcp://127.0.0.1:{pub},tcp://127.0.0.1:{replay}"


class Cluster:
    """Fresh replicas and a router with ``policy`` in front of them, all started at once (the
    router marks a replica up when its ``/health`` answers; its event streams connect when
    the replica binds); ready when every replica printed its ready line and the router
    counts all of them up."""

    def __init__(self, setup: Setup, policy: str) -> None:
        self.procs: list[HybridkvProcess] = []
        try:
            started = [setup.start_replica() for _ in range(setup.replicas)]
            self.procs += [p for p, _ in started]
            specs = [spec for _, spec in started]
            self.router = start_process("route", ["--model", setup.model, "--port", "0", "--policy", policy,
                                         "--max-imbalance", str(setup.max_imbalance), "--health-interval", "0.25",
                                         "--max-share-ratio", str(setup.max_share_ratio),
                                         "--log-level", "info",
                                         *(["--shadow-peek"] if setup.decompose and policy in ("hybrid", "full-only")
                                           else []),
                                         *sum((["--replica", s] for s in specs), [])], setup.threads)
            self.procs.append(self.router)
            for p in self.procs:
                p.wait_ready()
            deadline = time.monotonic() + 30
            while not all(r["up"] for r in self.replica_state()["replicas"]):
                if time.monotonic() > deadline:
                    raise SystemExit(f"the router does not see every replica up: {self.replica_state()}")
                time.sleep(0.1)
        except BaseException:
            self.stop()
            raise

    def replica_state(self) -> dict:
        import httpx

        return httpx.get(f"{self.router.base_url}/router/replicas", timeout=10).json()

    def stop(self) -> list[int | None]:
        for p in self.procs:
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        return [p.stop() for p in self.procs]


# ----------------------------------------------------------------------------- workload
def _words(rng: random.Random, lo: int, hi: int) -> str:
    n = rng.randint(lo, hi)
    out: list[str] = []
    while sum(map(len, out)) + len(out) < n:
        out.append(rng.choice(WORDS))
    return " ".join(out)[:n]


@dataclass(frozen=True)
class Workload:
    """``schedules[c]``: client c's requests in order, each the chat's messages so far."""

    schedules: list[list[tuple[int, int, list[dict]]]]  # (conversation, turn, messages)

    @property
    def num_requests(self) -> int:
        return sum(map(len, self.schedules))


def make_workload(seed: int, systems: int, conversations: int, turns: int, clients: int, open_: int,
                  system_chars: int = 96) -> Workload:
    rng = random.Random(seed)
    sys_prompts = [f"You are assistant number {i}. " + _words(rng, system_chars - 28, system_chars - 28)
                   for i in range(systems)]
    convs = []
    for k in range(conversations):
        system = sys_prompts[k % systems]
        users = [_words(rng, 12, 28) for _ in range(turns)]
        replies = [_words(rng, 6, 16) for _ in range(turns)]
        msgs = []
        for t in range(turns):
            m = [{"role": "system", "content": system}]
            for u, a in zip(users[:t], replies[:t]):
                m += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
            m.append({"role": "user", "content": users[t]})
            msgs.append(m)
        convs.append(msgs)
    order = list(range(conversations))
    rng.shuffle(order)
    schedules = []
    for c in range(clients):
        queue = order[c::clients]
        opened = [[k, 0] for k in queue[:open_]]
        queue = queue[open_:]
        sched = []
        while opened:
            for slot in list(opened):
                k, t = slot
                sched.append((k, t, convs[k][t]))
                slot[1] += 1
                if slot[1] == turns:
                    i = opened.index(slot)
                    if queue:
                        opened[i] = [queue.pop(0), 0]
                    else:
                        opened.pop(i)
        schedules.append(sched)
    return Workload(schedules)


# ------------------------------------------------------------------------------- driving
@dataclass
class Rec:
    conv: int
    turn: int
    replica: str
    predicted: int
    obtained: int
    prompt_tokens: int
    output_tokens: int
    ttft: float
    end: float
    resident: int | None = None  # the replica's own hit at the decision (--decompose)
    response_id: str = ""
    queued: int | None = None  # the replica's hit when it queued the request (its debug log)
    last: int | None = None  # ... at its last admission
    preemptions: int | None = None


@dataclass
class PolicyRun:
    policy: str
    round: int
    wall: float = 0.0
    recs: list[Rec] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    state: dict = field(default_factory=dict)
    log: list[str] = field(default_factory=list)  # the router's warnings and index resets during the run

    def total(self, name: str) -> int:
        return sum(getattr(r, name) for r in self.recs)

    @property
    def false_residency(self) -> int:
        return sum(max(0, r.predicted - r.obtained) for r in self.recs)

    @property
    def index_false_residency(self) -> int | None:
        """Predicted hit tokens the replica did not hold even at the decision (the index's own error)."""
        if not self.recs or any(r.resident is None for r in self.recs):
            return None
        return sum(max(0, r.predicted - r.resident) for r in self.recs)

    @property
    def lost_after_decision(self) -> int | None:
        """Predicted hit tokens the replica held at the decision but did not give (transit, queue)."""
        if not self.recs or any(r.resident is None for r in self.recs):
            return None
        return sum(max(0, min(r.predicted, r.resident) - r.obtained) for r in self.recs)


async def _one(client, messages: list[dict], max_tokens: int) -> tuple[str, int, dict | None, float, int | None, str]:
    body = {"model": "bench", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first = None
    usage = None
    rid = ""
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:300]!r}")
        replica = r.headers.get("x-hybridkv-replica", "?")
        predicted = int(r.headers.get("x-hybridkv-predicted-hit", 0))
        resident = r.headers.get("x-hybridkv-resident-hit")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                raise RuntimeError(f"stream error: {obj['error']}")
            rid = rid or obj.get("id", "")
            if obj.get("choices") and first is None:
                first = time.perf_counter()
            if obj.get("usage"):
                usage = obj["usage"]
    if usage is None or first is None:
        raise RuntimeError("no usage / no token in the stream")
    return replica, predicted, usage, first - sent, None if resident is None else int(resident), rid


async def _drive(base_url: str, work: Workload, max_tokens: int, run: PolicyRun) -> None:
    import httpx

    n = len(work.schedules)
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(300.0), limits=limits) as client:

        async def worker(sched) -> None:
            for k, t, messages in sched:
                try:
                    replica, predicted, usage, ttft, resident, rid = await _one(client, messages, max_tokens)
                except (RuntimeError, httpx.HTTPError) as exc:
                    run.errors.append(f"conv {k} turn {t}: {exc}")
                    continue
                details = usage.get("prompt_tokens_details") or {}
                run.recs.append(Rec(k, t, replica, predicted, int(details.get("cached_tokens") or 0),
                                    usage["prompt_tokens"], usage["completion_tokens"], ttft, time.perf_counter(),
                                    resident, rid))

        start = time.perf_counter()
        await asyncio.gather(*(worker(s) for s in work.schedules))
        run.wall = time.perf_counter() - start


_FINISHED = re.compile(r"request (\S+)-0 \w+: \d+ prompt tokens; prefix hit (\d+) when queued, (\d+) at admission, "
                       r"(\d+) at the last admission \((\d+) preemptions\)")


def _join_replica_logs(run: PolicyRun, logs: list[list[str]]) -> None:
    """Each request's hits on the replica's side (its ``--log-level debug`` line at finish),
    joined by the response id (the engine names a request after it)."""
    found = {}
    for lines in logs:
        for line in lines:
            m = _FINISHED.search(line)
            if m:
                found[m.group(1)] = tuple(int(x) for x in m.groups()[1:])
    for r in run.recs:
        if r.response_id in found:
            r.queued, _, r.last, r.preemptions = found[r.response_id]


def run_policy(setup: Setup, policy: str, work: Workload, max_tokens: int, rnd: int) -> PolicyRun:
    t0 = time.perf_counter()
    cluster = Cluster(setup, policy)
    ready = time.perf_counter() - t0
    run = PolicyRun(policy, rnd)
    try:
        before = cluster.replica_state()
        log_from = len(cluster.router.lines)
        asyncio.run(_drive(cluster.router.base_url, work, max_tokens, run))
        run.state = cluster.replica_state()
    finally:
        cluster.stop()
    _join_replica_logs(run, [p.lines for p in cluster.procs[:-1]])
    for b, a in zip(before["replicas"], run.state["replicas"]):  # index drops during the workload only
        delta = {k: n - b["index_resets"].get(k, 0) for k, n in a["index_resets"].items()}
        a["index_resets"] = {k: n for k, n in delta.items() if n}
    run.log = [line.rstrip() for line in cluster.router.lines[log_from:]  # "down (down)": the start-up probes
               if ("WARNING" in line or "ERROR" in line or "reset" in line) and "is down (down)" not in line]
    print(f"  round {rnd + 1} {policy:12} {len(run.recs)} requests in {run.wall:5.1f} s (cluster ready in "
          f"{ready:.1f} s), obtained {run.total('obtained')}, predicted {run.total('predicted')}, "
          f"false {run.false_residency}" + (f", {len(run.errors)} errors: {run.errors[:2]}" if run.errors else ""),
          flush=True)
    for line in run.log[:6]:
        print(f"    router | {line}")
    return run


# -------------------------------------------------------------------------------- report
def _pct(a: float, b: float) -> str:
    return f"{100 * a / b:5.1f}%" if b else "    -"


def decomposition(runs: dict[str, list[PolicyRun]]) -> None:
    """Where each policy's predicted hit tokens went. Per request, the chain predicted ->
    held by the replica at the decision (its manager, asked right after, with --decompose;
    the prediction for the oracle) -> held when the replica queued it (its debug line) ->
    obtained at its first admission; each step's loss counts what the next one no longer
    holds of the previous. Without --decompose, "lost before queued" includes the index's
    own error."""
    rows = []
    for policy, rs in runs.items():
        recs = [r for run in rs for r in run.recs if r.predicted]
        if not recs or any(r.queued is None for r in recs):
            continue
        peeked = policy == "oracle" or all(r.resident is not None for r in recs)
        index = transit = queue = lost = 0
        for r in recs:
            held = r.predicted if r.resident is None else min(r.predicted, r.resident)
            at_queue = min(held, r.queued)
            index += r.predicted - held
            transit += held - at_queue
            queue += at_queue - min(at_queue, r.obtained)
            lost += at_queue > r.obtained
        pred = sum(r.predicted for r in recs)
        pre = sum(1 for r in recs if r.preemptions)
        held_col = f"{index:>7} ({_pct(index, pred)})" if peeked else f"{'-':>7} {'':7}"
        rows.append(f"{policy:12} {pred:>9} {held_col} {transit:>7} ({_pct(transit, pred)}) "
                    f"{queue:>7} ({_pct(queue, pred)})  {lost:>4} of {len(recs)} requests lost hits while queued; "
                    f"{pre} preempted")
    if rows:
        print(f"\nwhere predicted hit tokens went\n{'policy':12} {'predicted':>9} {'not held at decision':>17} "
              f"{'lost before queued':>17} {'lost while queued':>17}")
        print("\n".join(rows))


def summary(verdicts: dict[int, dict]) -> None:
    """The targets at each pool size, side by side."""
    def pct(v):
        return "-" if v is None else f"{100 * v:.1f}%"

    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    print(f"\n{'blocks':>6} {'hybrid/oracle':>13} {'hybrid - full-only per round':>30} {'TTFT vs least-loaded':>20} "
          f"{'index error':>11} {'lost after decision':>19} {'hybrid false':>12}")
    for n, v in verdicts.items():
        print(f"{n:>6} {num(v.get('hybrid_over_oracle'), '.3f'):>13} "
              f"{str(v.get('hybrid_minus_full_only_rounds', '-')):>30} {num(v.get('hybrid_ttft_over_least_loaded'), '.2f'):>20} "
              f"{pct(v.get('hybrid_index_false_residency')):>11} {pct(v.get('hybrid_lost_after_decision')):>19} "
              f"{pct(v.get('hybrid_false_residency')):>12}")
    checks = {"hybrid >= full-only every round": [min(v["hybrid_minus_full_only_rounds"]) >= 0 for v in verdicts.values()
                                                  if "hybrid_minus_full_only_rounds" in v],
              "hybrid >= 0.93x oracle": [v["hybrid_over_oracle"] >= 0.93 for v in verdicts.values()
                                         if "hybrid_over_oracle" in v],
              "mean TTFT <= 1.1x least-loaded": [v["hybrid_ttft_over_least_loaded"] <= 1.1 for v in verdicts.values()
                                                  if "hybrid_ttft_over_least_loaded" in v],
              "index error <= 1%": [v["hybrid_index_false_residency"] <= 0.01 for v in verdicts.values()
                                    if "hybrid_index_false_residency" in v]}
    print("targets over the sweep: " + "; ".join(f"{k}: {sum(ok)}/{len(ok)} pool sizes" for k, ok in checks.items() if ok))


def moves(recs: list[Rec]) -> int:
    """Turns that went to another replica than their chat's previous turn."""
    last: dict[int, str] = {}
    n = 0
    for r in sorted(recs, key=lambda r: (r.conv, r.turn)):
        n += r.conv in last and last[r.conv] != r.replica
        last[r.conv] = r.replica
    return n


def report(runs: dict[str, list[PolicyRun]], rounds: int, decompose: bool = False) -> dict:
    print(f"\n{'policy':12} {'requests':>8} {'prompt tok':>10} {'hit obtained':>19} {'hit predicted':>13} "
          f"{'false residency':>19} {'mean TTFT':>10} {'req/s':>7} {'out tok/s':>9}  replicas (requests)")
    for policy, rs in runs.items():
        recs = [r for run in rs for r in run.recs]
        prompt = sum(r.prompt_tokens for r in recs)
        obtained = sum(r.obtained for r in recs)
        predicted = sum(r.predicted for r in recs)
        false = sum(run.false_residency for run in rs)
        wall = sum(run.wall for run in rs)
        ttft = statistics.fmean(r.ttft for r in recs) if recs else float("nan")
        out = sum(r.output_tokens for r in recs)
        spread: dict[str, int] = {}
        for r in recs:
            spread[r.replica] = spread.get(r.replica, 0) + 1
        moved = sum(moves(run.recs) for run in rs)
        print(f"{policy:12} {len(recs):>8} {prompt:>10} {obtained:>11} ({_pct(obtained, prompt)}) {predicted:>13} "
              f"{false:>11} ({_pct(false, predicted)}) {ttft * 1e3:>7.1f} ms {len(recs) / wall:>7.2f} {out / wall:>9.1f}"
              f"  {' '.join(f'{k}:{v}' for k, v in sorted(spread.items()))}; {moved} chat moves")
    decomposition(runs)
    verdict: dict = {}
    if "hybrid" in runs:
        hyb = runs["hybrid"]
        if "oracle" in runs:
            ratios = [h.total("obtained") / o.total("obtained") if o.total("obtained") else float("nan")
                      for h, o in zip(hyb, runs["oracle"])]
            verdict["hybrid_over_oracle"] = statistics.median(ratios)
            print(f"hybrid / oracle obtained hit tokens: median {verdict['hybrid_over_oracle']:.3f} over {rounds} "
                  f"rounds {[round(x, 3) for x in ratios]} (target >= 0.93: "
                  f"{'met' if verdict['hybrid_over_oracle'] >= 0.93 else 'MISSED'})")
        if "full-only" in runs:
            diffs = [h.total("obtained") - f.total("obtained") for h, f in zip(hyb, runs["full-only"])]
            ratios = [h.total("obtained") / f.total("obtained") if f.total("obtained") else float("nan")
                      for h, f in zip(hyb, runs["full-only"])]
            verdict["hybrid_minus_full_only"] = statistics.median(diffs)
            verdict["hybrid_minus_full_only_rounds"] = diffs
            print(f"hybrid - full-only obtained hit tokens: median {statistics.median(diffs):+.0f} "
                  f"({statistics.median(ratios):.3f}x) per round {diffs} (target >= 0 in every round: "
                  f"{'met' if min(diffs) >= 0 else 'MISSED' if max(diffs) < 0 else 'met in some rounds'})")
        if "least-loaded" in runs:
            def mean_ttft(rs):
                ttfts = [r.ttft for run in rs for r in run.recs]
                return statistics.fmean(ttfts) if ttfts else float("nan")
            ratio = mean_ttft(hyb) / mean_ttft(runs["least-loaded"])
            if decompose:  # the peek waits for a replica step before every hybrid decision
                print(f"hybrid mean TTFT / least-loaded's: {ratio:.2f} (not a verdict with --decompose: the peek "
                      f"delays each hybrid request; take the TTFT from a run without it)")
            else:
                verdict["hybrid_ttft_over_least_loaded"] = ratio
                print(f"hybrid mean TTFT / least-loaded's: {ratio:.2f} (target <= 1.10: "
                      f"{'met' if ratio <= 1.1 else 'MISSED'})")
        pred = sum(r.total("predicted") for r in hyb)
        false = sum(r.false_residency for r in hyb)
        verdict["hybrid_false_residency"] = false / pred if pred else 0.0
        floor = ""
        if "oracle" in runs:
            o_pred = sum(r.total("predicted") for r in runs["oracle"])
            o_false = sum(r.false_residency for r in runs["oracle"])
            verdict["oracle_false_residency"] = o_false / o_pred if o_pred else 0.0
            floor = (f"; the oracle's, exact when asked, is {_pct(o_false, o_pred).strip()}: hits evicted between "
                     f"the decision and the replica scheduling the request")
        print(f"hybrid false residency: {false} of {pred} predicted hit tokens = {_pct(false, pred).strip()} "
              f"(target < 1%: {'met' if verdict['hybrid_false_residency'] < 0.01 else 'MISSED'}){floor}")
        for name in ("hybrid", "full-only"):
            idx = [r.index_false_residency for r in runs.get(name, [])]
            if idx and all(x is not None for x in idx):
                p_ = sum(r.total("predicted") for r in runs[name])
                verdict[f"{name}_index_false_residency"] = sum(idx) / p_ if p_ else 0.0
                after = sum(run.lost_after_decision for run in runs[name])
                verdict[f"{name}_lost_after_decision"] = after / p_ if p_ else 0.0
                print(f"{name} index error (--decompose: predicted but not held by the replica at the decision): "
                      f"{sum(idx)} of {p_} = {_pct(sum(idx), p_).strip()}"
                      + (f" (target <= 1%: {'met' if sum(idx) <= 0.01 * p_ else 'MISSED'})" if name == "hybrid" else "")
                      + f"; lost after the decision (transit, queue): {after} = {_pct(after, p_).strip()}")
    return verdict


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer chats and turns, 1 round (about a minute)")
    ap.add_argument("--model", default=None, help="model name, .gguf or directory (default: the tiny test Gemma 3)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=None, help="default 2 (--quick 1)")
    ap.add_argument("--systems", type=int, default=3, help="system prompts (default 3)")
    ap.add_argument("--conversations", type=int, default=None, help="chats (default 48; --quick 24)")
    ap.add_argument("--turns", type=int, default=None, help="turns per chat (default 5; --quick 4)")
    ap.add_argument("--clients", type=int, default=6, help="concurrent clients (default 6)")
    ap.add_argument("--open", type=int, default=4, help="chats each client keeps open, in rotation (default 4)")
    ap.add_argument("--max-tokens", type=int, default=8, help="new tokens per request (default 8)")
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--num-blocks", default="256", metavar="N[,N...]",
                    help="KV cache blocks per replica; several (comma-separated): the whole benchmark at each pool "
                         "size in turn, then the targets side by side (default 256)")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-imbalance", type=int, default=DEFAULT_MAX_IMBALANCE, help="default route's (%(default)s)")
    ap.add_argument("--max-share-ratio", type=float, default=DEFAULT_MAX_SHARE_RATIO,
                    help="route --max-share-ratio: the balance rule (a replica's share of recent decisions over the "
                         f"least-served one's; 0: none; default {DEFAULT_MAX_SHARE_RATIO:g}, route's)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per replica (default 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-store", choices=("all", "tail"), default="all", help="the replicas' --kv-store (default all)")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write every request's record here")
    ap.add_argument("--decompose", action="store_true",
                    help="hybrid / full-only routers also ask the chosen replica's manager at each decision "
                         "(route --shadow-peek): what is lost before queueing split into index error and transit "
                         "(the peek delays each request by a replica step: more is lost in transit)")
    ap.add_argument("--queued-prefix", choices=("none", "refresh", "pin"), default="refresh",
                    help="the replicas' serve --queued-prefix (default refresh, serve's own)")
    ap.add_argument("--no-route-cost", action="store_true", help="skip the µs-per-decision figure")
    ap.add_argument("--route-cost-blocks", type=int, default=100_000)
    args = ap.parse_args(argv)

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in policies:
        if p not in POLICIES:
            ap.error(f"unknown policy {p!r}")
    rounds = args.rounds or (1 if args.quick else 2)
    conversations = args.conversations or (24 if args.quick else 48)
    turns = args.turns or (4 if args.quick else 5)
    try:
        sizes = [int(x) for x in args.num_blocks.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 2:
        ap.error(f"--num-blocks takes block counts >= 2 separated by commas, got {args.num_blocks!r}")
    work = make_workload(args.seed, args.systems, conversations, turns, args.clients, args.open)
    verdicts: dict[int, dict] = {}
    by_size: dict[int, dict[str, list[PolicyRun]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-route-") as tmp:
        model = args.model or str(make_tiny_dir(Path(tmp)))
        for num_blocks in sizes:
            setup = Setup(model, args.replicas, args.block_size, num_blocks, args.max_num_seqs, args.max_model_len,
                          args.max_imbalance, args.threads, args.decompose, args.queued_prefix, args.max_share_ratio,
                          args.kv_store)
            print(f"\nmodel {model if args.model else 'tiny gemma3 (sliding window 12 + full)'}; {args.replicas} "
                  f"replicas, block {args.block_size}, {num_blocks} blocks each, max_num_seqs {args.max_num_seqs}; "
                  f"{args.systems} system prompts, {conversations} chats x {turns} turns = {work.num_requests} requests, "
                  f"{args.clients} clients x {args.open} open chats, {args.max_tokens} new tokens; "
                  f"--max-imbalance {args.max_imbalance}, --max-share-ratio {args.max_share_ratio:g}, --kv-store {args.kv_store}; {rounds} round(s), policies rotated each round", flush=True)
            runs: dict[str, list[PolicyRun]] = {p: [] for p in policies}
            t0 = time.perf_counter()
            for rnd in range(rounds):
                order = policies[rnd % len(policies):] + policies[:rnd % len(policies)]
                for p in order:
                    runs[p].append(run_policy(setup, p, work, args.max_tokens, rnd))
            print(f"all runs: {time.perf_counter() - t0:.0f} s")
            verdicts[num_blocks] = report(runs, rounds, args.decompose)
            by_size[num_blocks] = runs
    if len(sizes) > 1:
        summary(verdicts)
    if args.json:
        Path(args.json).write_text(json.dumps({n: {p: [{"round": run.round, "wall": run.wall, "state": run.state,
                                                        "recs": [r.__dict__ for r in run.recs]} for run in rs]
                                                   for p, rs in runs.items()} for n, runs in by_size.items()}))
    runs = {p: [run for runs in by_size.values() for run in runs[p]] for p in policies}
    bad = {p: sum(r["bad_events"] for run in rs for r in run.state.get("replicas", [])) for p, rs in runs.items()}
    resets = {f"{p} round {run.round + 1}": {r["name"]: r["index_resets"] for r in run.state.get("replicas", [])
                                             if r["index_resets"]}
              for p, rs in runs.items() for run in rs}
    resets = {k: v for k, v in resets.items() if v}
    errors = sum(len(run.errors) for rs in runs.values() for run in rs)
    print(f"failed requests: {errors}; router bad events: {bad}; index drops during the workload: {resets or 'none'}")
    if not args.no_route_cost:
        from route_cost import measure

        r = measure(8, args.route_cost_blocks, 2048, "gemma3", repeats=50 if args.quick else 200)
        print(f"router cost: {r['decision_us']:.0f} µs per routing decision (hash the 2048-token prompt "
              f"{r['hash_us']:.0f} + score on {r['replicas']} replicas {r['score_us']:.0f}; full-only score "
              f"{r['score_full_only_us']:.0f}) at {r['replicas']} replicas x {r['blocks_per_replica']} indexed blocks "
              f"each (gemma3 layout, block 16; benchmarks/route_cost.py)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

"""hybridkv's Scheduler side by side with vLLM 0.33.0's own v1 ``Scheduler``, decision by decision.

Both schedulers run on CPU in one process, on the same seeded traces
(``hybridkv.scheduler.workloads``), with the same fake model: every request that
finishes its known tokens in a step samples ``fake_token(request_id, index)``, so a
recomputed request produces what it would have produced undisturbed. vLLM's
``Scheduler`` is built from a minimal ``VllmConfig`` (CPU device, no model: a stub
``model_config`` with the few fields the scheduler reads, synchronous scheduling,
FCFS, prefix caching on) and vLLM's own ``KVCacheConfig``; it is fed
``ModelRunnerOutput``s. Nothing of vLLM is patched.

Per step the decisions are compared: the requests scheduled, in order, each with its
token count and computed tokens before the step (prefix hits included), the
preempted ids and the ids finished since the last step. Four workload/layout runs
(Scout-like full + 3 chunked-local groups, Gemma-3-like full + 5 sliding-window
groups; long documents behind shared system prompts, multi-turn chat), each with a
pool tight enough to preempt, each under both admission policies:

* ``full_prompt`` (hybridkv's default) against vLLM's default
  (``scheduler_reserve_full_isl=True``);
* ``first_chunk`` against vLLM with ``scheduler_reserve_full_isl=False``.

hybridkv runs with one manager per group (``stripe_groups=False``, as vLLM has), so
eviction picks the same blocks and hits match; a second hybridkv lane with its
default stripes is shown beside it (under pressure it may keep other hits).
Prints the first divergence of each lane (none expected) and the totals: steps,
preemptions, prefix-hit tokens at admission.

The per-request caps of the gate are printed per run. hybridkv's is its spec's exact
bound (``KVCacheSpec.max_num_blocks``); vLLM's ``max_admission_blocks_per_request``
rounds differently in some layouts (one block more for a sliding window when
``W - 1 + budget`` is 1 more than a multiple of the block; fewer than a request can
really hold for a chunk that is not a multiple of the block). The layouts here are
ones where the two agree (as for Scout and Gemma 3 at the default budget 2048); where
they differ, a gate decision on that one block may differ too.

Set-up (benchmark-only environment; never a dependency of hybridkv, never in CI)::

    python3 -m venv .venv-vllm
    .venv-vllm/bin/pip install torch==2.13.0
    .venv-vllm/bin/pip install --no-deps -r ../shared/bench/vllm-anchor-requirements.txt

Run (from the repository root; importing vLLM takes ~15-30 s, the runs ~1 min)::

    PYTHONPATH=src .venv-vllm/bin/python benchmarks/vs_vllm_scheduler.py
"""

from __future__ import annotations

import argparse
import sys
import time
import types
from dataclasses import dataclass, field

import _paths  # noqa: E402,F401  (this checkout's src and tests.support importable)
from _vllm_env import import_vllm  # noqa: E402


from hybridkv.core.config import CacheManagerConfig, KVCacheConfig, KVCacheGroup  # noqa: E402
from hybridkv.core.kv_cache_manager import KVCacheManager  # noqa: E402
from hybridkv.core.specs import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec  # noqa: E402
from hybridkv.errors import PoolTooSmallError  # noqa: E402
from hybridkv.scheduler import FakeRunner, SamplingParams, Scheduler, SchedulerConfig, fake_token  # noqa: E402
from hybridkv.scheduler.workloads import TraceRequest, make_workload  # noqa: E402


VLLM_FLAG = {"full_prompt": True, "first_chunk": False}  # admission -> scheduler_reserve_full_isl


@dataclass(frozen=True)
class Run:
    """One workload on one layout with a tight pool."""

    name: str
    groups: tuple[tuple[str, int], ...]  # (kind, window / chunk)
    workload: str
    num_requests: int
    seed: int
    num_blocks: int
    budget: int = 512
    max_num_seqs: int = 32
    max_model_len: int = 4096
    block_size: int = 16
    scale: int = 256  # the workload's document scale (chunk / window)


SCOUT = (("full", 0),) + (("chunked", 256),) * 3
GEMMA = (("full", 0),) + (("sliding", 512),) * 5
RUNS = (
    Run("scout/long-doc", SCOUT, "long-doc", 48, 0, num_blocks=600),
    Run("scout/chat", SCOUT, "chat", 48, 1, num_blocks=900),
    Run("gemma/long-doc", GEMMA, "long-doc", 48, 0, num_blocks=1100),
    Run("gemma/chat", GEMMA, "chat", 48, 1, num_blocks=1100),
)


@dataclass
class Lane:
    """What one scheduler did with one trace: a record per step and totals."""

    name: str
    records: list = field(default_factory=list)  # per step: (scheduled, preempted, finished)
    preemptions: int = 0
    hit_tokens: int = 0
    finished: int = 0
    seconds: float = 0.0

    @property
    def steps(self) -> int:
        return len(self.records)


def _record(lane: Lane, scheduled: list, preempted, finished, running_before: set) -> None:
    lane.records.append((tuple(scheduled), tuple(sorted(preempted)), tuple(sorted(finished))))
    lane.preemptions += len(preempted)
    lane.hit_tokens += sum(computed for rid, _, computed in scheduled if rid not in running_before)


# ------------------------------------------------------------------------ hybridkv
def hybrid_specs(run: Run) -> list:
    common = dict(block_size=run.block_size, num_kv_heads=8, head_size=128, dtype="bfloat16")
    out = []
    for kind, param in run.groups:
        if kind == "full":
            out.append(FullAttentionSpec(**common))
        elif kind == "chunked":
            out.append(ChunkedLocalAttentionSpec(attention_chunk_size=param, **common))
        else:
            out.append(SlidingWindowSpec(sliding_window=param, **common))
    return out


def make_hybrid(run: Run, admission: str, stripes: bool) -> Scheduler:
    cfg = KVCacheConfig(run.num_blocks, tuple(KVCacheGroup(s) for s in hybrid_specs(run)))
    kv = KVCacheManager(cfg, CacheManagerConfig(max_model_len=run.max_model_len, stripe_groups=stripes))
    return Scheduler(kv, SchedulerConfig(max_num_batched_tokens=run.budget, max_num_seqs=run.max_num_seqs,
                                         max_model_len=run.max_model_len, admission=admission))


def run_hybrid(run: Run, trace: list[TraceRequest], admission: str, stripes: bool) -> Lane:
    sched = make_hybrid(run, admission, stripes)
    runner = FakeRunner()
    lane = Lane("hybridkv" + (" (stripes)" if stripes else ""))
    pending = sorted(trace, key=lambda r: r.arrival_step)
    nxt = 0
    started = time.perf_counter()
    while nxt < len(pending) or sched.has_unfinished_requests():
        step = len(lane.records)
        while nxt < len(pending) and pending[nxt].arrival_step <= step:
            tr = pending[nxt]
            sched.add_request(tr.request_id, list(tr.prompt_token_ids), SamplingParams(max_tokens=tr.output_len))
            nxt += 1
        running_before = {s.request_id for s in sched.running}
        out = sched.schedule()
        scheduled = [(r.request_id, len(r.token_ids), r.num_computed_tokens) for r in out.scheduled]
        _record(lane, scheduled, out.preempted_request_ids, out.finished_request_ids, running_before)
        sampled = runner.execute(out) if out.scheduled else {}
        lane.finished += len(sched.update_from_output(out, sampled))
        if step > 200_000:
            raise RuntimeError("hybridkv did not finish")
    lane.seconds = time.perf_counter() - started
    return lane


# ---------------------------------------------------------------------------- vLLM
def _import_vllm():
    import_vllm("vs_vllm_scheduler.py", "vllm.v1.core.sched.scheduler", "")


def make_vllm(run: Run, admission: str):
    """vLLM's v1 Scheduler with a minimal config: CPU, no model, synchronous, FCFS."""
    import torch
    from vllm.config import CacheConfig, DeviceConfig, VllmConfig
    from vllm.config import SchedulerConfig as VSchedulerConfig
    from vllm.v1.core.sched.scheduler import Scheduler as VScheduler
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec as VChunked,
        FullAttentionSpec as VFull,
        KVCacheConfig as VKVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec as VSliding,
    )

    sc = VSchedulerConfig(
        max_num_batched_tokens=run.budget, max_num_seqs=run.max_num_seqs, max_model_len=run.max_model_len,
        async_scheduling=False, is_encoder_decoder=False, scheduler_reserve_full_isl=VLLM_FLAG[admission],
    )
    cc = CacheConfig(block_size=run.block_size, enable_prefix_caching=True)
    cc.num_gpu_blocks = run.num_blocks
    vc = VllmConfig(scheduler_config=sc, cache_config=cc, device_config=DeviceConfig(device="cpu"))
    # the fields of ModelConfig the scheduler reads (a real one would load and inspect a model)
    model = types.SimpleNamespace(
        uses_mrope=False, is_encoder_decoder=False, max_model_len=run.max_model_len, runner_type="generate",
        is_diffusion=False, supports_multimodal_inputs=False, return_sampling_mask=False, multimodal_config=None,
        is_multimodal_model=False, hf_config=None, enable_return_routed_experts=False,
    )
    object.__setattr__(vc, "model_config", model)
    assert vc.max_in_flight_tokens == run.budget  # one batch in flight: the caps use the budget
    common = dict(block_size=run.block_size, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    groups = []
    for i, (kind, param) in enumerate(run.groups):
        if kind == "full":
            spec = VFull(**common)
        elif kind == "chunked":
            spec = VChunked(attention_chunk_size=param, **common)
        else:
            spec = VSliding(sliding_window=param, **common)
        groups.append(KVCacheGroupSpec([f"layers.{i}"], spec))
    kvc = VKVCacheConfig(num_blocks=run.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    return VScheduler(vc, kvc, structured_output_manager=_AcceptAll(), block_size=run.block_size)


class _AcceptAll:
    """Stands in for the structured-output manager (no grammars here)."""

    def accept_tokens(self, request, token_ids) -> bool:
        return True


def run_vllm(run: Run, trace: list[TraceRequest], admission: str) -> Lane:
    from vllm.sampling_params import SamplingParams as VSamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request as VRequest

    sched = make_vllm(run, admission)
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(run.block_size, hash_fn)
    lane = Lane("vLLM 0.33")
    pending = sorted(trace, key=lambda r: r.arrival_step)
    nxt = 0
    started = time.perf_counter()
    while nxt < len(pending) or sched.get_num_unfinished_requests():
        step = len(lane.records)
        while nxt < len(pending) and pending[nxt].arrival_step <= step:
            tr = pending[nxt]
            sp = VSamplingParams(max_tokens=tr.output_len, ignore_eos=True)
            sched.add_request(VRequest(tr.request_id, list(tr.prompt_token_ids), sp, None, block_hasher=hasher))
            nxt += 1
        running_before = {r.request_id for r in sched.running}
        out = sched.schedule()
        scheduled, ids, tokens = [], [], []
        for rid, n in out.num_scheduled_tokens.items():
            req = sched.requests[rid]
            scheduled.append((rid, n, req.num_computed_tokens - n))  # progress already advanced by n
            ids.append(rid)
            done = req.num_computed_tokens >= req.num_tokens
            tokens.append([fake_token(rid, req.num_output_tokens)] if done else [])
        _record(lane, scheduled, out.preempted_req_ids, out.finished_req_ids, running_before)
        result = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                   sampled_token_ids=tokens)
        before = sched.get_num_unfinished_requests()
        sched.update_from_output(out, result)
        lane.finished += before - sched.get_num_unfinished_requests()
        if step > 200_000:
            raise RuntimeError("vLLM did not finish")
    lane.seconds = time.perf_counter() - started
    return lane


def vllm_caps(run: Run) -> list:
    """vLLM's per-request admission cap of each group (None: uncapped)."""
    sched = make_vllm(run, "full_prompt")
    return [m.max_admission_blocks_per_request for m in sched.kv_cache_manager.coordinator.single_type_managers]


# --------------------------------------------------------------------------- driver
def make_trace(run: Run) -> tuple[list[TraceRequest], int]:
    """The run's trace, without requests hybridkv would refuse up front (they would
    wait forever in vLLM); returns (trace, number dropped)."""
    trace = make_workload(run.workload, num_requests=run.num_requests, max_model_len=run.max_model_len,
                          chunk=run.scale, seed=run.seed)
    probe = make_hybrid(run, "full_prompt", stripes=False)
    kept = []
    for tr in trace:
        try:
            probe.add_request(tr.request_id, list(tr.prompt_token_ids), SamplingParams(max_tokens=tr.output_len))
            kept.append(tr)
        except PoolTooSmallError:
            pass
    return kept, len(trace) - len(kept)


def first_divergence(a: Lane, b: Lane):
    """(step, a's record, b's record) of the first step they differ, or None."""
    for step in range(max(a.steps, b.steps)):
        ra = a.records[step] if step < a.steps else None
        rb = b.records[step] if step < b.steps else None
        if ra != rb:
            return step, ra, rb
    return None


def describe(record) -> str:
    if record is None:
        return "(finished)"
    scheduled, preempted, finished = record
    text = " ".join(f"{rid}:{n}@{c}" for rid, n, c in scheduled) or "-"
    if preempted:
        text += f" | preempted {list(preempted)}"
    if finished:
        text += f" | finished {list(finished)}"
    return text if len(text) < 400 else text[:400] + " ..."


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default="", help="comma-separated run names (default: all four)")
    args = ap.parse_args(argv)
    _import_vllm()
    runs = [r for r in RUNS if not args.runs or r.name in args.runs.split(",")]
    rows = []
    identical = 0
    total = 0
    for run in runs:
        trace, dropped = make_trace(run)
        ours_caps = [s.max_num_blocks(run.max_model_len, run.budget) for s in hybrid_specs(run)]
        print(f"\n== {run.name}: groups {'+'.join(k if k == 'full' else f'{k}({p})' for k, p in run.groups)}, "
              f"block {run.block_size}, {run.num_blocks} blocks, budget {run.budget}, max_num_seqs "
              f"{run.max_num_seqs}, max_model_len {run.max_model_len}; {len(trace)} requests"
              + (f" ({dropped} dropped: never fit)" if dropped else ""))
        print(f"   per-request caps: hybridkv {ours_caps}, vLLM {vllm_caps(run)} (vLLM None: uncapped)")
        lanes = {}
        for admission in ("full_prompt", "first_chunk"):
            vllm = run_vllm(run, trace, admission)
            ours = run_hybrid(run, trace, admission, stripes=False)
            striped = run_hybrid(run, trace, admission, stripes=True)
            flag = f"reserve_full_isl={VLLM_FLAG[admission]}"
            print(f"-- admission={admission} vs vLLM {flag}")
            for lane in (vllm, ours, striped):
                div = None if lane is vllm else first_divergence(lane, vllm)
                verdict = "" if lane is vllm else ("identical at every step" if div is None
                                                     else f"first divergence at step {div[0]}")
                print(f"   {lane.name:<20} steps {lane.steps:>5}  preemptions {lane.preemptions:>3}  "
                      f"hit tokens {lane.hit_tokens:>7}  finished {lane.finished:>3}  "
                      f"({lane.seconds:.1f} s)  {verdict}")
                if div is not None:
                    print(f"      hybridkv: {describe(div[1])}\n      vLLM:     {describe(div[2])}")
            div = first_divergence(ours, vllm)
            total += 1
            identical += div is None
            rows.append((run.name, admission, vllm, ours, div))
            lanes[admission] = (vllm, ours)
        cross = first_divergence(lanes["first_chunk"][1], lanes["full_prompt"][0])
        print(f"   (the policies matter: hybridkv first_chunk vs vLLM's default first differ at step "
              f"{cross[0] if cross else '-'})")
    print(f"\n{identical}/{total} runs identical to vLLM at every step (hybridkv with stripe_groups=False).")
    print("\nsummary (vLLM / hybridkv):")
    print(f"{'run':<16} {'admission':<12} {'steps':>13} {'preemptions':>12} {'hit tokens':>17}  decisions")
    for name, admission, v, o, div in rows:
        print(f"{name:<16} {admission:<12} {v.steps:>6}/{o.steps:<6} {v.preemptions:>5}/{o.preemptions:<6} "
              f"{v.hit_tokens:>8}/{o.hit_tokens:<8}  {'identical' if div is None else f'differ at step {div[0]}'}")
    return 0 if identical == total else 1


if __name__ == "__main__":
    sys.exit(main())

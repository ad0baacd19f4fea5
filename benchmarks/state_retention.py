"""Which state checkpoints to keep: the prefix-cache retention interval on a Qwen3-Next layout.

A state group (Gated DeltaNet, Mamba) can resume a request only from a cached checkpoint,
the state after a whole number of blocks; ``prefix_cache_retention_interval`` chooses which
ones are cached: ``None`` every block boundary a chunk ends on (dense), ``0`` only the
prompt's last one and the request's shared-prefix junction (vLLM's default; the junction is
where full attention hit further than any state checkpoint, e.g. the end of a known system
prompt's whole blocks: the scheduler stops the chunk there and the checkpoint is kept),
``k`` every ``k`` tokens, the prompt's last and the junction. Dense keeps more hits but fills
the pool with state blocks, which then evict attention blocks.

This plays one multi-turn chat workload (closed loop: ``--users`` users, each a
conversation of 2-6 turns on one of 8 Zipf-popular system prompts; the next turn, which
extends the previous prompt and reply, arrives a few steps after the reply) through
hybridkv's scheduler and the fake runner at a fixed pool, once per interval, and prints
the prefix hit rate, the cached state checkpoints at the end, the mean pool usage and the
steps to finish. Torch-free, about 10 s a pool::

    PYTHONPATH=src python3 benchmarks/state_retention.py [--pool 700] [--block 544]
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from hybridkv.core.config import CacheManagerConfig, KVCacheConfig, KVCacheGroup
from hybridkv.core.kv_cache_manager import KVCacheManager
from hybridkv.core.specs import FullAttentionSpec
from hybridkv.core.state_spec import gated_delta_net_state, unify_page_sizes
from hybridkv.scheduler.config import SchedulerConfig
from hybridkv.scheduler.fake_runner import FakeRunner, fake_token
from hybridkv.scheduler.interface import SamplingParams
from hybridkv.scheduler.scheduler import Scheduler


def qwen3next_config(num_blocks: int, block_size: int) -> KVCacheConfig:
    """1 full-attention group + 3 Gated DeltaNet groups (12 layers each), pages unified."""
    attn = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=256, dtype="bfloat16")
    gdn = gated_delta_net_state(block_size=block_size, num_k_heads=16, num_v_heads=32, head_k_dim=128,
                                head_v_dim=128, conv_kernel=4)
    if block_size >= 544:
        bs, (attn,), (gdn,) = unify_page_sizes([attn], [gdn], block_size=block_size)
    else:  # a small block (a study, not a real page): pad to the attention page anyway
        from dataclasses import replace

        gdn = replace(gdn, shapes=((3, 64), (2, 16, 16)), page_size_padded=attn.page_size_bytes)
    groups = (KVCacheGroup(attn, tuple(f"layers.{i}" for i in range(3, 48, 4))),) + tuple(
        KVCacheGroup(gdn, tuple(f"layers.{i}" for i in range(48) if i % 4 != 3)[g::3]) for g in range(3))
    return KVCacheConfig(num_blocks, groups)


class Chats:
    """Closed-loop conversations: ``users`` at a time, ``total`` in all. Every conversation's
    content comes from its own seeded generator, so each run sees the same requests whatever
    the order they finish in."""

    def __init__(self, seed: int, block: int, users: int, total: int):
        self.seed = seed
        self.unit = block  # lengths in blocks, so every block size sees the same shape
        rng = random.Random(seed)
        self.systems = [[rng.randrange(32000) for _ in range(self._size(rng, 2.5, 11))] for _ in range(8)]
        self.weights = [1 / (k + 1) for k in range(8)]
        self.users, self.total, self.started = users, total, 0
        self.pending: list[tuple[int, str, list[int], int]] = []  # (arrival step, id, prompt, output len)
        self.conv: dict[str, list] = {}  # id -> [rng, history, turns left]
        for _ in range(min(users, total)):
            self._new_conversation(0)

    def _size(self, rng: random.Random, lo: float, hi: float) -> int:
        return max(1, int(rng.uniform(lo, hi) * self.unit))

    def _new_conversation(self, step: int) -> None:
        cid = f"conv{self.started}"
        self.started += 1
        rng = random.Random(f"{self.seed}:{cid}")
        self.conv[cid] = [rng, list(rng.choices(self.systems, self.weights)[0]), rng.randint(2, 6)]
        self._next_turn(cid, step, 0)

    def _next_turn(self, cid: str, step: int, turn: int) -> None:
        c = self.conv[cid]
        rng = c[0]
        c[1] = prompt = c[1] + [rng.randrange(32000) for _ in range(self._size(rng, 0.1, 1.0))]
        self.pending.append((step + rng.randint(2, 20), f"{cid}-t{turn}", prompt, self._size(rng, 0.06, 0.7)))

    def arrivals(self, step: int):
        due = [p for p in self.pending if p[0] <= step]
        self.pending = [p for p in self.pending if p[0] > step]
        return due

    def finished(self, rid: str, output_len: int, step: int) -> None:
        cid, turn = rid.rsplit("-t", 1)
        c = self.conv[cid]
        c[1] = c[1] + [fake_token(rid, k) for k in range(output_len)]
        c[2] -= 1
        if c[2]:
            self._next_turn(cid, step, int(turn) + 1)
        elif self.started < self.total:
            self._new_conversation(step)

    def done(self) -> bool:
        return not self.pending and self.started >= self.total


def run(retention, args) -> dict:
    cfg = qwen3next_config(args.pool, args.block)
    kv = KVCacheManager(cfg, CacheManagerConfig(max_model_len=1 << 20, prefix_cache_retention_interval=retention))
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=args.budget, max_num_seqs=args.max_running,
                                          max_model_len=1 << 20))
    runner = FakeRunner()
    chats = Chats(args.seed, cfg.block_size, args.users, args.conversations)
    outputs: dict[str, int] = {}
    hit = admitted = 0
    usage = []
    usable = cfg.num_blocks - 1
    t = time.perf_counter()
    while not chats.done() or sched.has_unfinished_requests():
        step = sched.step_count
        for _, rid, prompt, out in chats.arrivals(step):
            sched.add_request(rid, prompt, SamplingParams(max_tokens=out))
            outputs[rid] = out
        if not sched.has_unfinished_requests():
            sched.step_count += 1
            continue
        waiting = {s.request_id for s in sched.waiting}
        output, finished = sched.step(runner)
        done = {f.request_id: f for f in finished}
        for sr in output.scheduled:
            if sr.request_id in waiting:  # admitted this step (first time or after a preemption)
                seq = sched.sequences.get(sr.request_id) or done[sr.request_id]
                hit += sr.num_computed_tokens
                admitted += seq.request.num_tokens
        for seq in finished:
            chats.finished(seq.request_id, outputs[seq.request_id], step)
        usage.append((usable - kv.num_free_blocks) / usable)
    kv.check_invariants()
    coord = kv.coordinator
    state_gids = {g for m in coord.state_managers for g in m.group_ids}
    lead_gids = {m.group_ids[0] for m in coord.state_managers}
    checkpoints = sum(1 for b in kv.pool.blocks if b.block_hash is not None and b.group_id in lead_gids)
    attn_cached = sum(1 for b in kv.pool.blocks if b.block_hash is not None and b.group_id not in state_gids)
    return dict(hit=hit, admitted=admitted, checkpoints=checkpoints,
                state_blocks=checkpoints * len(state_gids) // max(1, len(lead_gids)), attn_cached=attn_cached,
                usage=sum(usage) / max(1, len(usage)), steps=sched.step_count, preempt=sched.num_preemptions,
                seconds=time.perf_counter() - t)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pool", type=int, default=700, help="blocks in the pool (default 700)")
    ap.add_argument("--block", type=int, default=544, help="attention block size before unification (544: real)")
    ap.add_argument("--budget", type=int, default=8192)
    ap.add_argument("--max-running", type=int, default=64)
    ap.add_argument("--users", type=int, default=48)
    ap.add_argument("--conversations", type=int, default=160)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    bs = qwen3next_config(2, args.block).block_size
    print(f"Qwen3-Next (1 full + 3 GDN groups), block {bs}, pool {args.pool} blocks, budget {args.budget}, "
          f"{args.max_running} running at most; {args.conversations} conversations ({args.users} at a time) "
          f"of 2-6 turns on 8 system prompts of 2.5-11 blocks")
    hdr = (f"{'retention':>11} {'hit rate':>8} {'hit tokens':>10} {'admitted':>9} {'state ckpts':>11} "
           f"{'(blocks)':>8} {'attn cached':>11} {'mean usage':>10} {'steps':>6} {'preempt':>7} {'s':>5}")
    print(hdr)
    print("-" * len(hdr))
    for retention in (None, 0, 4 * bs, 16 * bs):
        r = run(retention, args)
        label = "None" if retention is None else ("0" if retention == 0 else f"{retention // bs}*block")
        print(f"{label:>11} {r['hit'] / max(1, r['admitted']):>8.3f} {r['hit']:>10} {r['admitted']:>9} "
              f"{r['checkpoints']:>11} {r['state_blocks']:>8} {r['attn_cached']:>11} {r['usage']:>10.3f} "
              f"{r['steps']:>6} {r['preempt']:>7} {r['seconds']:>5.1f}", flush=True)
    print("hit rate = prefix-hit tokens / tokens of the admitted requests (at admission); state ckpts = cached "
          "checkpoints (x3 groups = blocks) at the end; attn cached = cached full-attention blocks at the end; "
          "mean usage = blocks held by requests / usable, per step")
    return 0


if __name__ == "__main__":
    sys.exit(main())

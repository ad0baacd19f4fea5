"""The router's own cost: µs per routing decision at 8 replicas x 100k indexed blocks each.

    python3 benchmarks/route_cost.py [--replicas 8] [--blocks 100000] [--prompt-tokens 2048] [--layout gemma3]

One decision = score one prompt on every replica's :class:`~hybridkv.router.index.ReplicaIndex`
(the longest prefix valid for every group, the core's hit rules over the remote index).
Printed separately: hashing the prompt (our chained sha256 at the replicas' block size,
once per decision: a :class:`~hybridkv.router.index.Prompt` is shared by all replicas),
scoring the hashed prompt on all replicas, and the two together; and the full-group-only
score (what a router that drops the sparse groups pays). Median of ``repeats``.

Each replica is filled through :meth:`ReplicaIndex.apply` with wire BlockStored events
(block 16): conversations of ``system prompt (1024 tokens, one of 8 shared by all
replicas) + 1024 tokens of its own``, stored in every group, until it holds
``blocks_per_replica`` blocks (all groups together). The probe prompt is replica 0's
first conversation, cut or extended to ``prompt_tokens``: a whole-prompt hit there, the
shared system prompt (half of it) on every other replica, so every replica walks its
index well into the prompt (the costly case, not a miss at block 0).

Layouts: ``gemma3`` (1 full + 1 sliding-window 1024 group, as the engine groups Gemma 3),
``scout`` (1 full + 3 chunked 8192 groups, Llama 4 Scout), ``full`` (one full group).
Pure Python, one thread; a decision does no allocation beyond the hashes.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import _paths  # noqa: E402,F401  (this checkout's src and tests.support importable)

from hybridkv.router.index import Prompt, ReplicaIndex  # noqa: E402
from hybridkv.protocol.kv_events import BlockStored  # noqa: E402

BLOCK = 16
SYSTEM_TOKENS = 1024
OWN_TOKENS = 1024
LAYOUTS = {
    "gemma3": [("full_attention", None), ("sliding_window", 1024)],
    "scout": [("full_attention", None)] + [("chunked_local_attention", 8192)] * 3,
    "full": [("full_attention", None)],
}


def _fill(index: ReplicaIndex, conversations: list[list[int]], groups, num_blocks: int) -> None:
    """Store conversations (each in every group) until the index holds ``num_blocks`` blocks."""
    for tokens in conversations:
        if index.num_blocks >= num_blocks:
            return
        hashes = Prompt(tokens).block_hashes(BLOCK)  # a replica running our engine sends our hashes
        room = (num_blocks - index.num_blocks) // len(groups)
        n = min(len(hashes), max(room, 1))
        for gid, (kind, span) in enumerate(groups):
            index.apply([BlockStored(block_hashes=hashes[:n], parent_block_hash=None, token_ids=tokens[:n * BLOCK],
                                     block_size=BLOCK, lora_id=None, medium="GPU", lora_name=None, group_idx=gid,
                                     kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=span)])


def build(num_replicas: int, blocks_per_replica: int, layout: str, seed: int = 0) -> tuple[list[ReplicaIndex], list[list[int]]]:
    rng = random.Random(seed)
    groups = LAYOUTS[layout]
    systems = [[rng.randrange(1, 150_000) for _ in range(SYSTEM_TOKENS)] for _ in range(8)]
    per_conv = (SYSTEM_TOKENS + OWN_TOKENS) // BLOCK * len(groups)
    indexes, firsts = [], []
    for r in range(num_replicas):
        index = ReplicaIndex(chain_capacity=max(1 << 16, blocks_per_replica))
        convs = [systems[(r + i) % 8] + [rng.randrange(1, 150_000) for _ in range(OWN_TOKENS)]
                 for i in range(blocks_per_replica // per_conv + 2)]
        _fill(index, convs, groups, blocks_per_replica)
        indexes.append(index)
        firsts.append(convs[0])
    return indexes, firsts


def _median_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def measure(num_replicas: int = 8, blocks_per_replica: int = 100_000, prompt_tokens: int = 2048,
            layout: str = "gemma3", repeats: int = 200, seed: int = 0) -> dict:
    """Build the replicas' indexes, then time routing decisions; a dict of the figures (µs)."""
    t0 = time.perf_counter()
    indexes, firsts = build(num_replicas, blocks_per_replica, layout, seed)
    build_s = time.perf_counter() - t0
    rng = random.Random(seed + 1)
    tokens = (firsts[0] + [rng.randrange(1, 150_000) for _ in range(prompt_tokens)])[:prompt_tokens]
    hashed = Prompt(tokens)
    hashed.block_hashes(BLOCK)
    scores = [ix.score(hashed) for ix in indexes]

    def hash_only():
        Prompt(tokens).block_hashes(BLOCK)

    def score_only():
        for ix in indexes:
            ix.score(hashed)

    def full_only():
        for ix in indexes:
            ix.score_full_only(hashed)

    def decision():
        p = Prompt(tokens)
        for ix in indexes:
            ix.score(p)

    hash_only(), score_only(), decision()  # warm
    return {
        "layout": layout,
        "replicas": num_replicas,
        "blocks_per_replica": min(ix.num_blocks for ix in indexes),
        "prompt_tokens": len(tokens),
        "hit_tokens": scores,
        "build_s": build_s,
        "hash_us": _median_us(hash_only, repeats),
        "score_us": _median_us(score_only, repeats),
        "score_full_only_us": _median_us(full_only, repeats),
        "decision_us": _median_us(decision, repeats),
        "repeats": repeats,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=100_000, help="indexed blocks per replica (all groups)")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default=None, help="default: all")
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    print(f"{'layout':8} {'replicas':>8} {'blocks/rep':>10} {'prompt':>6} {'hash us':>8} {'score us':>9} "
          f"{'full-only us':>12} {'decision us':>11}  hits (tokens, per replica)")
    for layout in [args.layout] if args.layout else ["gemma3", "scout", "full"]:
        r = measure(args.replicas, args.blocks, args.prompt_tokens, layout, args.repeats)
        print(f"{r['layout']:8} {r['replicas']:>8} {r['blocks_per_replica']:>10} {r['prompt_tokens']:>6} "
              f"{r['hash_us']:>8.1f} {r['score_us']:>9.1f} {r['score_full_only_us']:>12.1f} {r['decision_us']:>11.1f}"
              f"  {r['hit_tokens']}  (built in {r['build_s']:.1f} s)")
    print("decision = hash the prompt once (block 16, sha256) + score it on every replica; median of "
          f"{args.repeats}; one Python thread")


if __name__ == "__main__":
    main()

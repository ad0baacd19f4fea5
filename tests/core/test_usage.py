"""The core's pool accounting (``KVCacheManager.pool_usage``) against a count by hand, on random
request streams over hybrid layouts: shared prefixes, sliding / chunked frees, stripes, frees."""

from __future__ import annotations

import random

import pytest

from hybridkv.core.config import CacheManagerConfig, KVCacheConfig, KVCacheGroup
from hybridkv.core.kv_cache_manager import KVCacheManager
from hybridkv.core.usage import usable_blocks

from tests.support.kv_specs import chunked, full, sliding
from tests.support.tiers import slow_except

LAYOUTS = {
    "full": (full(),),
    "full+sliding": (full(), sliding(12), sliding(12)),
    "full+chunked": (full(), chunked(8), chunked(8), chunked(8)),
    "sliding+chunked": (full(), sliding(6), chunked(16)),
}


def by_hand(kv: KVCacheManager, live: dict) -> tuple[list[int], int]:
    """Distinct non-null block ids each group's tables hold; free blocks holding a cache entry (a stripe of k: k)."""
    held = [set() for _ in range(kv.coordinator.num_groups)]
    for rid in live:
        for g, ids in enumerate(kv.get_block_ids(rid)):
            held[g].update(i for i in ids if i != 0)
    cached_free = sum(b.width for b in kv.pool.blocks[1:] if b.ref_cnt == 0 and b.block_hash is not None)
    return [len(h) for h in held], cached_free


@pytest.mark.parametrize("layout", slow_except(sorted(LAYOUTS), sorted(LAYOUTS).index("full+sliding")))
@pytest.mark.parametrize("stripes", [False, True])  # the fast tier: full+sliding
def test_pool_usage_equals_a_count_by_hand(layout, stripes):
    rng = random.Random(hash((layout, stripes)) & 0xFFFF)
    specs = LAYOUTS[layout]
    kv = KVCacheManager(KVCacheConfig(120, tuple(KVCacheGroup(s) for s in specs)),
                        CacheManagerConfig(max_model_len=400, stripe_groups=stripes))
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(4, 40))] for _ in range(4)]
    live: dict = {}
    peak = [0] * len(specs)
    peak_used = 0
    for n in range(300):
        u = kv.pool_usage()
        used, cached_free = by_hand(kv, live)
        assert list(u.used_per_group) == used
        assert (u.usable, u.free, u.cached_free) == (usable_blocks(120), kv.num_free_blocks, cached_free)
        peak = [max(p, x) for p, x in zip(peak, used)]
        peak_used = max(peak_used, sum(used))
        assert list(u.peak_per_group) == peak and u.peak_used == peak_used
        op = rng.random()
        if live and (op < 0.25 or len(live) > 6):
            rid = rng.choice(sorted(live))
            kv.free(live.pop(rid))
        elif op < 0.55 or not live:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 30))]
            req = kv.make_request(f"r{n}", tokens)
            blocks, hit = kv.get_computed_blocks(req)
            if kv.allocate_slots(req, req.num_tokens - hit, hit, blocks) is None:
                continue  # no room: nothing was taken
            req.num_computed_tokens = req.num_tokens
            live[req.request_id] = req
        else:
            req = live[rng.choice(sorted(live))]
            if req.num_tokens >= 390:
                continue
            req.append_token_ids(rng.randrange(50))
            if kv.allocate_slots(req, 1) is None:
                continue
            req.num_computed_tokens += 1
            kv.remove_skipped_blocks(req)
        kv.check_invariants()


def test_usable_blocks_is_the_one_rule():
    assert [usable_blocks(n) for n in (0, 1, 2, 64)] == [0, 0, 1, 63]

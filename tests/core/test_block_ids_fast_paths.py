"""KVCacheBlocks.get_block_ids reads ids straight from the compact form (and answers
None for no blocks with allow_none): it must equal the ids of the expanded lists.
Seeded random loops over hybrid layouts with stripes, prefix hits, decode steps."""

import random

import pytest

from hybridkv.core.config import CacheManagerConfig, KVCacheConfig, KVCacheGroup
from hybridkv.core.kv_cache_manager import KVCacheManager

from tests.support.kv_specs import chunked, full, sliding

LAYOUTS = {
    "full": lambda bs: (full(bs),),
    "scout": lambda bs: (full(bs), chunked(6, bs), chunked(6, bs), chunked(6, bs)),
    "mixed": lambda bs: (sliding(5, bs), full(bs), chunked(5, bs), sliding(5, bs)),
}


def _expanded_ids(kb):
    blocks = kb._coordinator.expand(kb._hit) if kb._blocks is None else kb._blocks
    return tuple([b.block_id for b in g] for g in blocks)


def _check(kb):
    want = _expanded_ids(kb)
    got = kb.get_block_ids()
    assert got == want
    assert all(type(g) is list for g in got)
    none = kb.get_block_ids(allow_none=True)
    assert (none is None) == (not any(want))
    if none is not None:
        assert none == want
    # new lists each call: the caller may keep or change them
    got[0].append(-1)
    assert kb.get_block_ids() == want


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("seed", range(4))
def test_block_ids_match_expanded_lists(layout, seed):
    rng = random.Random(seed)
    bs = rng.choice((1, 2, 3))
    specs = LAYOUTS[layout](bs)
    kv = KVCacheManager(KVCacheConfig(rng.randint(30, 90), tuple(KVCacheGroup(s) for s in specs)),
                        CacheManagerConfig(max_model_len=80))
    prefixes = [[rng.randrange(5) for _ in range(rng.randint(1, 20))] for _ in range(3)]
    running = {}
    seen_none = seen_blocks = 0
    for step in range(120):
        if len(running) < 4 and rng.random() < 0.4:
            rid = f"r{step}"
            req = kv.make_request(rid, rng.choice(prefixes) + [rng.randrange(9) for _ in range(rng.randint(1, 9))])
            hit, n = kv.get_computed_blocks(req)
            _check(hit)
            num_new = min(rng.randint(1, 12), req.num_tokens - n)
            new = kv.allocate_slots(req, num_new, n, hit)
            if new is None:
                continue
            _check(new)
            req.num_computed_tokens = n + num_new
            running[rid] = req
        elif running:
            rid = rng.choice(sorted(running))
            req = running[rid]
            if req.num_computed_tokens == req.num_tokens:
                req.append_token_ids(rng.randrange(9))
            if rng.random() < 0.15 or req.num_tokens >= 70:
                kv.free(req)
                del running[rid]
                continue
            num_new = req.num_tokens - req.num_computed_tokens
            new = kv.allocate_slots(req, num_new)
            if new is None:
                kv.free(req)
                del running[rid]
                continue
            _check(new)
            if new.get_block_ids(allow_none=True) is None:
                seen_none += 1
            else:
                seen_blocks += 1
            req.num_computed_tokens += num_new
        kv.check_invariants()
    assert seen_blocks and (seen_none or bs == 1), (bs, seen_none, seen_blocks)  # both paths ran (bs 1: every step allocates)

"""Cases from the side-by-side check against vLLM 0.33.0's v1 KV cache manager.

``benchmarks/vs_vllm.py`` drives both managers with identical call sequences and
compares them step by step (and fuzzes tiny configs). These are the cases it
turned up, written as plain hybridkv tests (no vLLM import). Each says what vLLM
0.33 does and which side follows the attention rules:

* chunked local (chunk C): the next token, at index n, attends to [floor(n/C)*C, n];
  a hit of R tokens is valid iff every block from floor(R/C)*C to R is a real block;
* sliding window W: token n attends to (n - W, n]; a hit of R tokens needs the
  W - 1 tokens before R, i.e. cdiv(W - 1, block) blocks.

F1 was a hybridkv bug found by the check (fixed in 95fcf0f, "retry shorter when the
straddling block misses"); its tests keep it fixed. F2 is a vLLM quirk; hybridkv
follows the rule and the tests pin that.
"""

from __future__ import annotations

import itertools

import pytest

from hybridkv.core.block_pool import BlockPool
from hybridkv.core.config import CacheManagerConfig, KVCacheConfig, KVCacheGroup
from hybridkv.core.kv_cache_manager import KVCacheManager
from hybridkv.core.managers import ChunkedLocalAttentionManager, SlidingWindowManager
from hybridkv.core.specs import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec

from tests.support.kv_specs import fake_hashes, ids, mark_cached


def _spec(kind: str, bs: int, param: int = 0):
    common = dict(block_size=bs, num_kv_heads=1, head_size=1, dtype="float32")
    if kind == "full":
        return FullAttentionSpec(**common)
    if kind == "chunked":
        return ChunkedLocalAttentionSpec(attention_chunk_size=param, **common)
    return SlidingWindowSpec(sliding_window=param, **common)


def make_kv(groups, bs, num_blocks=64, uncached_first=False):
    cfg = KVCacheConfig(num_blocks=num_blocks, groups=tuple(KVCacheGroup(_spec(k, bs, p)) for k, p in groups))
    return KVCacheManager(cfg, CacheManagerConfig(max_model_len=1 << 16), uncached_first=uncached_first)


def prefill_and_free(kv, rid, prompt):
    """What the scheduler does for a request that finishes right after its prefill."""
    req = kv.make_request(rid, prompt)
    blocks, hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None
    req.num_computed_tokens = req.num_tokens
    req.append_token_ids(99)
    kv.free(req)
    return hit


def chunked_hit_is_valid(hit_ids: list[int], hit: int, chunk: int, bs: int) -> bool:
    """Every block the next token (index ``hit``) attends to is a real block."""
    first = hit // chunk * chunk // bs
    return len(hit_ids) * bs == hit and all(b != 0 for b in hit_ids[first:])


def oracle_chunked(cached: list[bool], max_length: int, chunk: int, bs: int) -> int:
    """Longest valid chunked-local hit (whole blocks, <= max_length) by brute force."""
    best = 0
    for k in range(min(max_length // bs, len(cached)) + 1):
        r = k * bs
        if all(cached[r // chunk * chunk // bs:k]):
            best = r
    return best


# --------------------------------------------------------------------------------
# Cases where both managers agree (vLLM's own documented examples): regression tests.
# --------------------------------------------------------------------------------
def test_vllm_docstring_chunked_examples():
    # vLLM ChunkedLocalAttentionManager.find_longest_cache_hit docstring: chunk 8, block 4.
    pool = BlockPool(40)
    m = ChunkedLocalAttentionManager(_spec("chunked", 4, 8), (0,), pool)
    hashes = fake_hashes(4)
    # max length 15: tokens 0-7 outside the window (null), block 2 (tokens 8-11) looked up
    blocks, n = m.find_longest_cache_hit(hashes, 15)
    assert (ids(blocks[0]), n) == ([0, 0], 8)
    mark_cached(pool, hashes, [False, False, True, False])
    blocks, n = m.find_longest_cache_hit(hashes, 15)
    assert (ids(blocks[0]), n) == ([0, 0, 12], 12)
    # max length 16: every token before 16 is outside the window -> four null blocks
    blocks, n = m.find_longest_cache_hit(hashes, 16)
    assert (ids(blocks[0]), n) == ([0, 0, 0, 0], 16)


@pytest.mark.parametrize("n, skipped", [(13, 8), (8, 8), (7, 0)])
def test_vllm_docstring_chunked_skipped_tokens(n, skipped):
    m = ChunkedLocalAttentionManager(_spec("chunked", 4, 8), (0,), BlockPool(8))
    assert m.num_skipped_tokens(n) == skipped


def test_vllm_docstring_sliding_window_examples():
    # vLLM: window 4, num_computed 7 -> 4 skipped; window 8, block 4 -> a hit is
    # [NULL, NULL, b, b] (cdiv(7, 4) = 2 contiguous blocks).
    assert SlidingWindowManager(_spec("sliding", 4, 4), (0,), BlockPool(8)).num_skipped_tokens(7) == 4
    pool = BlockPool(40)
    m = SlidingWindowManager(_spec("sliding", 4, 8), (0,), pool)
    hashes = fake_hashes(5)
    got = mark_cached(pool, hashes, [True, False, True, True, False])
    blocks, n = m.find_longest_cache_hit(hashes, 20)
    assert (ids(blocks[0]), n) == ([0, 0, got[2], got[3]], 16)


def test_scout_shaped_prefix_hit_matches_vllm():
    # full + 3 chunked (C 8, block 4), the shape of trace (b): a second request
    # sharing 2.5 chunks of prompt hits up to its last full shared block; the chunked
    # groups get nulls before the chunk of the hit and real blocks after. Same in vLLM.
    kv = make_kv([("full", 0)] + [("chunked", 8)] * 3, bs=4)
    sys_prompt = list(range(20))
    prefill_and_free(kv, "r0", sys_prompt + [100, 101])
    req = kv.make_request("r1", sys_prompt + [200, 201, 202])
    blocks, hit = kv.get_computed_blocks(req)
    assert hit == 20
    per_group = blocks.get_block_ids()
    assert all(b != 0 for b in per_group[0]) and len(per_group[0]) == 5
    for g in (1, 2, 3):
        assert per_group[g][:4] == [0, 0, 0, 0] and per_group[g][4] != 0
    kv.allocate_slots(req, req.num_tokens - hit, hit, blocks)
    kv.check_invariants()


# --------------------------------------------------------------------------------
# F1: chunk size not a multiple of the block size.
#
# The scan puts null blocks before s = floor(max_length / C) * C; when s is not
# block-aligned and the block straddling s misses, the hit is start * block < s,
# and the next token then attends to tokens mapped to the null block.
# vLLM 0.33 has the same flaw with one chunked spec group (UnitaryKVCacheCoordinator,
# or the "simple hybrid" full + chunked path, both a single pass); its
# HybridKVCacheCoordinator, when it iterates (two or more non-full spec groups, or
# one spec group over several KV cache groups), re-asks every group at the reduced
# length until nothing changes and so lands on a valid hit. hybridkv's fixed point
# skips a manager whose previous answer equals the current length, so before the fix
# it kept the invalid hit even there. Fix (95fcf0f): ChunkedLocalAttentionManager.
# find_longest_cache_hit retries with max_length = hit while hit < s.
# --------------------------------------------------------------------------------


def test_chunked_hit_keeps_the_cached_block_before_a_misaligned_chunk_start():
    # C 12, block 8. r0 caches block 0 (tokens 0-7). r1 shares tokens 0-7 only:
    # max_length 15 -> s = 12 -> start block 1 (tokens 8-15) misses -> hit 8.
    # Token 8 is in chunk [0, 12): it attends to tokens 0-7, so block 0 must be the
    # cached block, not the null block. (vLLM 0.33, one group: hit 8 with [null].)
    kv = make_kv([("chunked", 12)], bs=8)
    prefill_and_free(kv, "r0", list(range(9)))
    req = kv.make_request("r1", list(range(8)) + list(range(50, 58)))
    blocks, hit = kv.get_computed_blocks(req)
    assert hit == 8
    assert blocks.get_block_ids()[0] != [0]
    kv.allocate_slots(req, req.num_tokens - hit, hit, blocks)
    kv.check_invariants()  # before the fix: "null block at 0 past the skipped prefix"


@pytest.mark.parametrize("groups", [[("chunked", 5)], [("chunked", 5)] * 2])
def test_chunked_hit_on_an_empty_cache_lands_on_a_chunk_boundary(groups):
    # C 5, block 4, empty cache, 51-token prompt (max_length 50): s = 50 -> 12 null
    # blocks -> 48, but token 48 attends to 45-47 (block 11). With nothing cached the
    # longest valid hit is 40 (10 null blocks, token 40 starts a chunk).
    # vLLM 0.33: 48 with one chunked group, 40 with two (it iterates).
    kv = make_kv(groups, bs=4)
    req = kv.make_request("r", list(range(51)))
    blocks, hit = kv.get_computed_blocks(req)
    assert hit == 40


def test_existing_example_c20_block8_max39_all_missing():
    # The example of the manager's docstring (block 8, C 20, max_length 39), with
    # nothing cached: a hit of 16 tokens [null, null] (what both managers returned
    # before the fix) would leave token 16, in chunk [0, 20), reading null blocks 0
    # and 1; the only valid hit is 0.
    pool = BlockPool(40)
    m = ChunkedLocalAttentionManager(_spec("chunked", 8, 20), (0,), pool)
    blocks, n = m.find_longest_cache_hit(fake_hashes(5), 39)
    assert n == 0


@pytest.mark.parametrize(
    "chunk, bs",
    [(4, 2), (8, 4), (6, 2), (12, 4)]  # chunk a multiple of the block
    + [(3, 2), (5, 4), (6, 4), (12, 8), (20, 8)],  # not a multiple (F1)
)
def test_chunked_hit_is_the_longest_valid_hit(chunk, bs):
    # every cache pattern over 6 blocks, every max_length: the manager's hit is valid
    # and as long as the brute-force longest valid hit.
    n_blocks = 6
    hashes = fake_hashes(n_blocks)
    for pattern in itertools.product([False, True], repeat=n_blocks):
        pool = BlockPool(40)
        m = ChunkedLocalAttentionManager(_spec("chunked", bs, chunk), (0,), pool)
        mark_cached(pool, hashes, list(pattern))
        for max_length in range(n_blocks * bs + 1):
            blocks, hit = m.find_longest_cache_hit(hashes, max_length)
            assert chunked_hit_is_valid(ids(blocks[0]), hit, chunk, bs), (pattern, max_length, hit, ids(blocks[0]))
            assert hit == oracle_chunked(list(pattern), max_length, chunk, bs), (pattern, max_length)


# --------------------------------------------------------------------------------
# F2: sliding window 1 (a token attends only to itself).
#
# hybridkv: cdiv(0, block) = 0 blocks are needed, so every hit is valid with null
# blocks only (the rule). vLLM 0.33: reachable_block_mask caches none of a W=1 group's
# blocks (need 0 < 1 block per segment), while its finder still needs one cached block
# to report a match, so the group always hits 0 and zeroes the whole hybrid hit.
# hybridkv follows the rule; these tests pin it.
# --------------------------------------------------------------------------------
def test_sliding_window_1_hits_without_any_cached_block():
    kv = make_kv([("sliding", 1)], bs=4)
    req = kv.make_request("r", list(range(9)))
    blocks, hit = kv.get_computed_blocks(req)
    assert hit == 8 and blocks.get_block_ids()[0] == [0, 0]  # vLLM 0.33: 0
    kv.allocate_slots(req, req.num_tokens - hit, hit, blocks)
    kv.check_invariants()


def test_sliding_window_1_does_not_limit_a_hybrid_hit():
    kv = make_kv([("full", 0), ("sliding", 1)], bs=4)
    prefill_and_free(kv, "r0", list(range(9)))
    req = kv.make_request("r1", list(range(12)))
    blocks, hit = kv.get_computed_blocks(req)
    assert hit == 8  # full attention's hit; vLLM 0.33: 0
    full_ids, sw_ids = blocks.get_block_ids()
    assert 0 not in full_ids and sw_ids == [0, 0]

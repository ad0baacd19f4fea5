"""Stale prefix hits: a hit whose blocks were evicted before it was used is refused.

``get_computed_blocks`` takes no references, so allocating another request before the
hit is used can evict its blocks. ``allocate_slots`` must then raise StaleHitError with
nothing changed, in both layouts (stripes, and a manager per group as in vLLM). Before
the fix the cases below raised ``ValueError: list.remove(x)`` (stripes) or silently
gave one block to two requests / two groups (found by search, smallest pools).
"""

from __future__ import annotations

import pytest

from hybridkv.core.config import CacheManagerConfig, KVCacheConfig, KVCacheGroup
from hybridkv.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from hybridkv.errors import InvalidArgumentError, StaleHitError

from tests.support.kv_specs import chunked, full, manager_snapshot, sliding

SPECS = (full(2), sliding(3, 2), chunked(8, 2), chunked(8, 2))  # the two chunked groups stripe


def make_kv(num_blocks: int, stripe: bool, specs=SPECS) -> KVCacheManager:
    cfg = KVCacheConfig(num_blocks, tuple(KVCacheGroup(s) for s in specs))
    return KVCacheManager(cfg, CacheManagerConfig(max_model_len=64, stripe_groups=stripe))


def prefill_and_free(kv: KVCacheManager, rid: str, prompt: list[int]) -> None:
    req = kv.make_request(rid, prompt)
    assert kv.allocate_slots(req, req.num_tokens) is not None
    req.num_computed_tokens = req.num_tokens
    kv.free(req)


def shared_ids(kv: KVCacheManager, a: str, b: str) -> set[int]:
    out: set[int] = set()
    for ta, tb in zip(kv.get_block_ids(a), kv.get_block_ids(b)):
        out |= (set(ta) & set(tb)) - {0}
    return out


# (stripes, pool, prompt prefix length, z's tokens): what the old code did
CASES = [
    pytest.param(True, 17, 7, 1, id="stripes-list.remove"),
    pytest.param(True, 21, 8, 5, id="stripes-cached-for-other-group"),
    pytest.param(False, 14, 5, 1, id="groups-block-in-two-groups"),
]


@pytest.mark.parametrize("stripe, num_blocks, lx, lz", CASES)
def test_stale_hit_raises_and_changes_nothing(stripe, num_blocks, lx, lz):
    kv = make_kv(num_blocks, stripe)
    prefill_and_free(kv, "x", list(range(1, lx + 1)) + [99])
    y = kv.make_request("y", list(range(1, lx + 1)) + [50])
    hit, n = kv.get_computed_blocks(y)
    assert n == lx // 2 * 2
    z = kv.make_request("z", list(range(70, 70 + lz)))
    assert kv.allocate_slots(z, lz) is not None  # evicts (some of) the hit's blocks
    before = manager_snapshot(kv, [y, z])
    with pytest.raises(StaleHitError):
        kv.allocate_slots(y, y.num_tokens - n, n, hit)
    assert manager_snapshot(kv, [y, z]) == before
    kv.check_invariants()
    # what the error says to do: look the hit up again; it is valid now
    hit, n = kv.get_computed_blocks(y)
    while kv.allocate_slots(y, y.num_tokens - n, n, hit) is None:
        z.num_computed_tokens = lz
        kv.free(z)
        hit, n = kv.get_computed_blocks(y)
    kv.check_invariants()
    if kv.has_request("z"):
        assert not shared_ids(kv, "y", "z")


@pytest.mark.parametrize("stripe", [True, False])
def test_hit_used_for_another_request(stripe):
    kv = make_kv(40, stripe)
    prefill_and_free(kv, "x", [1, 2, 3, 4, 5, 6, 9])
    y = kv.make_request("y", [1, 2, 3, 4, 5, 6, 50])
    hit, n = kv.get_computed_blocks(y)
    assert n == 6
    other = kv.make_request("o", [1, 2, 7, 7, 5, 6, 50])  # shares block 0 only
    before = manager_snapshot(kv, [other])
    with pytest.raises(StaleHitError):
        kv.allocate_slots(other, 1, n, hit)
    assert manager_snapshot(kv, [other]) == before
    same = kv.make_request("s", [1, 2, 3, 4, 5, 6, 51])  # same prefix: the hit is its hit too
    assert kv.allocate_slots(same, 1, n, hit) is not None
    assert kv.get_block_ids("s")[0][:3] == hit.get_block_ids()[0]
    kv.check_invariants()


@pytest.mark.parametrize("stripe", [True, False])
def test_hit_survives_unrelated_eviction(stripe):
    # the pool evicts other cached blocks in between: the hit is checked block by block and kept
    kv = make_kv(45, stripe)
    prefill_and_free(kv, "old", [80, 81, 82, 83, 84])  # cached first: evicted first (LRU head)
    prefill_and_free(kv, "x", [1, 2, 3, 4, 5, 6, 9])
    y = kv.make_request("y", [1, 2, 3, 4, 5, 6, 50])
    hit, n = kv.get_computed_blocks(y)
    ids = hit.get_block_ids()
    epoch = kv.pool.cache_epoch
    z = kv.make_request("z", list(range(70, 70 + 2 * 7)))
    assert kv.allocate_slots(z, z.num_tokens) is not None
    assert kv.pool.cache_epoch != epoch  # something was evicted
    assert kv.allocate_slots(y, 1, n, hit) is not None
    assert [t[:3] for t in kv.get_block_ids("y")] == list(ids)
    assert not shared_ids(kv, "y", "z")
    kv.check_invariants()


@pytest.mark.parametrize("stripe", [True, False])
def test_hit_after_reset_prefix_cache_is_stale(stripe):
    kv = make_kv(40, stripe)
    prefill_and_free(kv, "x", [1, 2, 3, 4, 5])
    y = kv.make_request("y", [1, 2, 3, 4, 6])
    hit, n = kv.get_computed_blocks(y)
    assert n == 4 and kv.reset_prefix_cache()
    with pytest.raises(StaleHitError):
        kv.allocate_slots(y, 1, n, hit)
    kv.check_invariants()
    assert kv.allocate_slots(y, 5) is not None


def test_fresh_hit_is_not_checked_block_by_block(monkeypatch):
    # the scheduler's order (look up, allocate at once) costs O(1) per hit, not O(blocks)
    kv = make_kv(40, True)
    prefill_and_free(kv, "x", [1, 2, 3, 4, 5, 6, 9])
    monkeypatch.setattr(kv.coordinator, "check_hit", lambda *a: pytest.fail("checked"))
    y = kv.make_request("y", [1, 2, 3, 4, 5, 6, 50])
    hit, n = kv.get_computed_blocks(y)
    assert n == 6 and kv.allocate_slots(y, 1, n, hit) is not None


@pytest.mark.parametrize("stripe", [True, False])
def test_blocks_that_are_no_hit(stripe):
    kv = make_kv(40, stripe)
    prefill_and_free(kv, "x", [1, 2, 3, 4, 5])
    y = kv.make_request("y", [1, 2, 3, 4, 6])
    # newly allocated blocks passed back as a hit: they hold no cached prefix
    w = kv.make_request("w", [1, 2, 3, 4, 7])
    new = kv.allocate_slots(w, 5)
    before = manager_snapshot(kv, [y])
    with pytest.raises((StaleHitError, InvalidArgumentError)):
        kv.allocate_slots(y, 1, 4, new)
    # a hit found by another manager (another pool)
    other = make_kv(40, stripe)
    prefill_and_free(other, "x", [1, 2, 3, 4, 5])
    oy = other.make_request("y", [1, 2, 3, 4, 6])
    foreign, n = other.get_computed_blocks(oy)
    assert n == 4
    with pytest.raises(InvalidArgumentError):
        kv.allocate_slots(y, 1, 4, foreign)
    # per-group lists built by hand: the wrong number of groups, or not blocks
    with pytest.raises(InvalidArgumentError):
        kv.allocate_slots(y, 1, 4, KVCacheBlocks(([],)))
    with pytest.raises(InvalidArgumentError):
        kv.allocate_slots(y, 1, 4, KVCacheBlocks(tuple([1, 2] for _ in SPECS)))
    assert manager_snapshot(kv, [y]) == before
    # the same hit built by hand from this pool's blocks is checked and accepted
    hit, n = kv.get_computed_blocks(y)
    by_hand = KVCacheBlocks(tuple(list(g) for g in hit.blocks))
    assert kv.allocate_slots(y, 1, n, by_hand) is not None
    kv.check_invariants()

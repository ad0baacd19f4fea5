"""Every misuse of the core's public API raises a typed error from hybridkv.errors and
changes nothing: one table per object, each row run against a manager (both layouts)
or a pool holding live, freed, waiting and cached state, with a whole-state snapshot
compared before and after. Then single cases that need their own set-up (a computed
count moved back past freed blocks, another manager's request, unordered prompts, the
admission count), and a random probe: arbitrary values for every argument of every
public call either work or raise a HybridKVError.
"""

from __future__ import annotations

import random

import pytest

from hybridkv.core.block_pool import BlockPool
from hybridkv.core.config import CacheManagerConfig, KVCacheConfig, KVCacheGroup
from hybridkv.core.hashing import MultiModalFeature
from hybridkv.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from hybridkv.core.request import BlockHasher, Request
from hybridkv.errors import (
    HybridKVError,
    InvalidArgumentError,
    InvalidConfigError,
    InvariantViolation,
    PromptTooLongError,
    RequestError,
    RequestFreedError,
    UnknownRequestError,
)

from tests.support.kv_specs import chunked, full, manager_snapshot, pool_snapshot, sliding

SPECS = (full(2), sliding(3, 2), chunked(4, 2), chunked(4, 2))
CFG = KVCacheConfig(60, tuple(KVCacheGroup(s) for s in SPECS))


def world(stripe: bool):
    """A manager with: 'a' live (prefilled, decoding), 'f' freed but keeping its
    num_computed_tokens, 'w' waiting with a prefix hit found, cached free blocks."""
    kv = KVCacheManager(CFG, CacheManagerConfig(max_model_len=32, stripe_groups=stripe))
    a = kv.make_request("a", [1, 2, 3, 4, 5, 6, 7])
    assert kv.allocate_slots(a, 7) is not None
    a.num_computed_tokens = 7
    a.append_token_ids(8)
    f = kv.make_request("f", [9, 9, 9, 9, 9])
    assert kv.allocate_slots(f, 5) is not None
    f.num_computed_tokens = 5
    kv.free(f)
    w = kv.make_request("w", [1, 2, 3, 4, 30])
    hit, n = kv.get_computed_blocks(w)
    assert n == 4
    return kv, {"a": a, "f": f, "w": w, "hit": hit, "n": n}


def other_manager_hit():
    kv, r = world(True)
    return r["hit"]


MANAGER_CASES = [
    # free
    ("free(123)", lambda kv, r: kv.free(123), InvalidArgumentError),
    ("free(None)", lambda kv, r: kv.free(None), InvalidArgumentError),
    ("free(['a'])", lambda kv, r: kv.free(["a"]), InvalidArgumentError),
    ("free(unknown id)", lambda kv, r: kv.free("nope"), UnknownRequestError),
    ("free(freed)", lambda kv, r: kv.free(r["f"]), RequestFreedError),
    ("free(waiting)", lambda kv, r: kv.free(r["w"]), UnknownRequestError),
    # make_request
    ("make_request negative id", lambda kv, r: kv.make_request("x", [1, -2]), InvalidArgumentError),
    ("make_request None id", lambda kv, r: kv.make_request("x", [1, None]), InvalidArgumentError),
    ("make_request None prompt", lambda kv, r: kv.make_request("x", None), InvalidArgumentError),
    ("make_request empty", lambda kv, r: kv.make_request("x", []), InvalidArgumentError),
    ("make_request float", lambda kv, r: kv.make_request("x", [1.0, 2]), InvalidArgumentError),
    ("make_request bool", lambda kv, r: kv.make_request("x", [True, 2]), InvalidArgumentError),
    ("make_request str prompt", lambda kv, r: kv.make_request("x", "abc"), InvalidArgumentError),
    ("make_request str token", lambda kv, r: kv.make_request("x", [1, "2"]), InvalidArgumentError),
    ("make_request 2**63", lambda kv, r: kv.make_request("x", [1, 2, 3, 1 << 63]), InvalidArgumentError),
    ("make_request int id", lambda kv, r: kv.make_request(7, [1]), InvalidArgumentError),
    ("make_request unknown kwarg", lambda kv, r: kv.make_request("x", [1], lora=1), InvalidArgumentError),
    ("make_request lora_name int", lambda kv, r: kv.make_request("x", [1], lora_name=3), InvalidArgumentError),
    ("make_request cache_salt bytes", lambda kv, r: kv.make_request("x", [1], cache_salt=b"s"), InvalidArgumentError),
    ("make_request mm object", lambda kv, r: kv.make_request("x", [1], mm_features=[object()]), InvalidArgumentError),
    ("make_request mm int", lambda kv, r: kv.make_request("x", [1], mm_features=5), InvalidArgumentError),
    ("MultiModalFeature offset -1", lambda kv, r: MultiModalFeature(-1, 2, "i"), InvalidArgumentError),
    ("MultiModalFeature length 0", lambda kv, r: MultiModalFeature(0, 0, "i"), InvalidArgumentError),
    ("MultiModalFeature id int", lambda kv, r: MultiModalFeature(0, 1, 5), InvalidArgumentError),
    ("Request hasher str", lambda kv, r: Request("x", [1], hasher="h"), InvalidArgumentError),
    ("BlockHasher(0)", lambda kv, r: BlockHasher(0), InvalidArgumentError),
    ("BlockHasher('4')", lambda kv, r: BlockHasher("4"), InvalidArgumentError),
    ("BlockHasher algo", lambda kv, r: BlockHasher(4, "md5"), InvalidConfigError),
    # append_token_ids: nothing appended
    ("append -5", lambda kv, r: r["a"].append_token_ids(-5), InvalidArgumentError),
    ("append 'x'", lambda kv, r: r["a"].append_token_ids("x"), InvalidArgumentError),
    ("append None", lambda kv, r: r["a"].append_token_ids(None), InvalidArgumentError),
    ("append 1.5", lambda kv, r: r["a"].append_token_ids(1.5), InvalidArgumentError),
    ("append True", lambda kv, r: r["a"].append_token_ids(True), InvalidArgumentError),
    ("append [1, -1]", lambda kv, r: r["a"].append_token_ids([1, -1]), InvalidArgumentError),
    ("append [2**64]", lambda kv, r: r["a"].append_token_ids([1 << 64]), InvalidArgumentError),
    # allocate_slots
    ("allocate freed, computed kept", lambda kv, r: kv.allocate_slots(r["f"], 1), RequestError),
    ("allocate str", lambda kv, r: kv.allocate_slots("a", 1), InvalidArgumentError),
    ("allocate -1", lambda kv, r: kv.allocate_slots(r["a"], -1), InvalidArgumentError),
    ("allocate 1.0", lambda kv, r: kv.allocate_slots(r["a"], 1.0), InvalidArgumentError),
    ("allocate True", lambda kv, r: kv.allocate_slots(r["w"], True), InvalidArgumentError),
    ("allocate lookahead -1", lambda kv, r: kv.allocate_slots(r["w"], 1, num_lookahead_tokens=-1), InvalidArgumentError),
    ("allocate past its tokens", lambda kv, r: kv.allocate_slots(r["w"], 6), InvalidArgumentError),
    ("allocate past max_model_len", lambda kv, r: kv.allocate_slots(kv.make_request("x", [1] * 40), 40),
     PromptTooLongError),
    ("allocate computed without hit", lambda kv, r: kv.allocate_slots(r["w"], 1, 4), InvalidArgumentError),
    ("allocate hit, wrong count", lambda kv, r: kv.allocate_slots(r["w"], 1, 2, r["hit"]), InvalidArgumentError),
    ("allocate hit to a live request", lambda kv, r: kv.allocate_slots(r["a"], 1, 4, r["hit"]), RequestError),
    ("allocate list as hit", lambda kv, r: kv.allocate_slots(r["w"], 1, 4, [[1]]), InvalidArgumentError),
    ("allocate another manager's hit", lambda kv, r: kv.allocate_slots(r["w"], 1, 4, other_manager_hit()),
     InvalidArgumentError),
    ("allocate ints as hit", lambda kv, r: kv.allocate_slots(r["w"], 1, 4, KVCacheBlocks(([1, 2],) * 4)),
     InvalidArgumentError),
    ("allocate same id, other object", lambda kv, r: kv.allocate_slots(kv.make_request("a", [1, 2, 3]), 1),
     RequestError),
    ("allocate other block size", lambda kv, r: kv.allocate_slots(Request("x", [1, 2, 3, 4], hasher=BlockHasher(4)), 4),
     InvalidArgumentError),
    # other calls
    ("get_computed_blocks(str)", lambda kv, r: kv.get_computed_blocks("w"), InvalidArgumentError),
    ("get_computed_blocks other block size",
     lambda kv, r: kv.get_computed_blocks(Request("x", [1, 2, 3, 4, 5], hasher=BlockHasher(4))), InvalidArgumentError),
    ("remove_skipped_blocks(str)", lambda kv, r: kv.remove_skipped_blocks("a"), InvalidArgumentError),
    ("remove_skipped_blocks(waiting)", lambda kv, r: kv.remove_skipped_blocks(r["w"]), UnknownRequestError),
    ("get_block_ids([1])", lambda kv, r: kv.get_block_ids([1]), InvalidArgumentError),
    ("get_block_ids(5)", lambda kv, r: kv.get_block_ids(5), InvalidArgumentError),
    ("get_block_ids(unknown)", lambda kv, r: kv.get_block_ids("nope"), UnknownRequestError),
    ("get_blocks(5)", lambda kv, r: kv.get_blocks(5), InvalidArgumentError),
    ("has_request([1])", lambda kv, r: kv.has_request([1]), InvalidArgumentError),
    ("KVCacheManager(None, ...)", lambda kv, r: KVCacheManager(None, kv.config), InvalidConfigError),
    ("KVCacheManager(..., None)", lambda kv, r: KVCacheManager(CFG, None), InvalidConfigError),
    ("KVCacheManager uncached_first", lambda kv, r: KVCacheManager(CFG, kv.config, uncached_first="y"),
     InvalidConfigError),
    ("CacheManagerConfig caching 'yes'", lambda kv, r: CacheManagerConfig(8, enable_caching="yes"), InvalidConfigError),
    ("CacheManagerConfig hash md5", lambda kv, r: CacheManagerConfig(8, hash_algo="md5"), InvalidConfigError),
    ("CacheManagerConfig hash list", lambda kv, r: CacheManagerConfig(8, hash_algo=["x"]), InvalidConfigError),
]


@pytest.mark.parametrize("stripe", [True, False], ids=["stripes", "groups"])
@pytest.mark.parametrize("call, error", [pytest.param(c, e, id=name) for name, c, e in MANAGER_CASES])
def test_manager_misuse_raises_and_changes_nothing(call, error, stripe):
    kv, r = world(stripe)
    reqs = [r["a"], r["f"], r["w"]]
    before = manager_snapshot(kv, reqs)
    with pytest.raises(error):
        call(kv, r)
    assert manager_snapshot(kv, reqs) == before
    kv.check_invariants()
    # and the manager still works: the waiting request is admitted with its hit
    assert kv.allocate_slots(r["w"], 1, r["n"], r["hit"]) is not None
    kv.check_invariants()


# num_computed_tokens is a plain attribute (a validating setter cost 10-27% per request-step):
# the manager refuses a bad value where it reads it. The live request 'a' is on the decode
# fast path, which checks only the sign; the waiting 'w' takes the slow path.
BAD_COMPUTED = [("a", -5), ("a", 9), ("a", "3"), ("a", None), ("w", -1), ("w", 6), ("w", 2.0), ("w", True), ("w", [])]


@pytest.mark.parametrize("stripe", [True, False], ids=["stripes", "groups"])
@pytest.mark.parametrize("rid, value", BAD_COMPUTED)
def test_bad_num_computed_tokens_is_refused_where_read(rid, value, stripe):
    kv, r = world(stripe)
    req = r[rid]
    good = req.num_computed_tokens
    req.num_computed_tokens = value
    before = manager_snapshot(kv, [r["a"], r["f"], r["w"]])
    with pytest.raises(InvalidArgumentError):
        kv.allocate_slots(req, 1)
    if rid == "a":
        with pytest.raises(InvalidArgumentError):
            kv.remove_skipped_blocks(req)
    assert manager_snapshot(kv, [r["a"], r["f"], r["w"]]) == before
    kv.check_invariants()
    req.num_computed_tokens = good
    assert kv.allocate_slots(req, 1) is not None


def pool_world():
    """Groups 1 and 2 striped; held: a plain block and a stripe; free: cached blocks."""
    pool = BlockPool(12, 3)
    pool.stripe_groups((1, 2))
    plain = pool.get_new_blocks(3)
    pool.cache_full_blocks(plain, [b"h0", b"h1"], 0, 2, 0)
    pool.free_blocks(plain[:0:-1])  # plain[1] (cached) and plain[2] free, plain[0] held
    (lead,) = pool.get_new_stripes(1, 2)
    return pool, {"held": plain[0], "free": plain[1], "lead": lead, "follower": lead.stripe[1]}


POOL_CASES = [
    ("get_new_blocks(-1)", lambda p, b: p.get_new_blocks(-1), InvalidArgumentError),
    ("get_new_blocks(1.5)", lambda p, b: p.get_new_blocks(1.5), InvalidArgumentError),
    ("get_new_blocks(True)", lambda p, b: p.get_new_blocks(True), InvalidArgumentError),
    ("get_new_blocks(too many)", lambda p, b: p.get_new_blocks(100), InvalidArgumentError),
    ("get_new_stripes width 0", lambda p, b: p.get_new_stripes(1, 0), InvalidArgumentError),
    ("get_new_stripes -1", lambda p, b: p.get_new_stripes(-1, 2), InvalidArgumentError),
    ("get_new_stripes width 2.0", lambda p, b: p.get_new_stripes(1, 2.0), InvalidArgumentError),
    ("free a free block", lambda p, b: p.free_blocks([b["free"]]), InvariantViolation),
    ("free a held block twice", lambda p, b: p.free_blocks([b["held"], b["held"]]), InvariantViolation),
    ("free held then free", lambda p, b: p.free_blocks([b["lead"], b["held"], b["free"]]), InvariantViolation),
    ("free a follower", lambda p, b: p.free_blocks(iter([b["held"], b["follower"]])), InvariantViolation),
    ("touch a follower", lambda p, b: p.touch([b["held"], b["follower"]]), InvalidArgumentError),
    ("cache bad group", lambda p, b: p.cache_full_blocks([b["held"]], [b"x"], 0, 1, 5), InvalidArgumentError),
    ("cache follower group", lambda p, b: p.cache_full_blocks([b["lead"]], [b"x"], 0, 1, 2), InvalidArgumentError),
    ("cache past the hashes", lambda p, b: p.cache_full_blocks([b["held"]], [b"x"], 0, 3, 0), InvalidArgumentError),
    ("cache start > end", lambda p, b: p.cache_full_blocks([b["held"]], [b"x"], 1, 0, 0), InvalidArgumentError),
    ("cache start -1", lambda p, b: p.cache_full_blocks([b["held"]], [b"x"], -1, 1, 0), InvalidArgumentError),
    ("lookup group 3", lambda p, b: p.lookup(b"h0", 3), InvalidArgumentError),
    ("lookup group -1", lambda p, b: p.lookup(b"h0", -1), InvalidArgumentError),
    ("get_cached_block group 9", lambda p, b: p.get_cached_block(b"h0", [0, 9]), InvalidArgumentError),
    ("group_map('0')", lambda p, b: p.group_map("0"), InvalidArgumentError),
    ("stripe_groups again", lambda p, b: p.stripe_groups((1, 2)), InvalidArgumentError),
    ("BlockPool('10')", lambda p, b: BlockPool("10"), InvalidArgumentError),
    ("BlockPool(10, 0)", lambda p, b: BlockPool(10, 0), InvalidArgumentError),
]


@pytest.mark.parametrize("call, error", [pytest.param(c, e, id=name) for name, c, e in POOL_CASES])
def test_pool_misuse_raises_and_changes_nothing(call, error):
    pool, b = pool_world()
    before = pool_snapshot(pool)
    with pytest.raises(error):
        call(pool, b)
    assert pool_snapshot(pool) == before
    pool.check_invariants({b["held"].block_id: 1, b["lead"].block_id: 1, b["follower"].block_id: 1})


# ------------------------------------------------------------------ single cases
def one_group_manager() -> KVCacheManager:
    return KVCacheManager(KVCacheConfig(20, (KVCacheGroup(full()),)), CacheManagerConfig(max_model_len=64))


def free_and_block_ids(kv: KVCacheManager, rid: str):
    return kv.num_free_blocks, kv.get_block_ids(rid)


@pytest.mark.parametrize("stripes", [True, False])
@pytest.mark.parametrize("local", [sliding(3, 2), chunked(4, 2)])
def test_a_computed_count_moved_back_past_freed_blocks_is_refused(stripes, local):
    kv = KVCacheManager(
        KVCacheConfig(40, (KVCacheGroup(full(2)), KVCacheGroup(local), KVCacheGroup(local))),
        CacheManagerConfig(max_model_len=64, stripe_groups=stripes),
    )
    r = kv.make_request("a", list(range(1, 30)))
    for _ in range(21):  # decode one token at a time: the local groups free their old blocks
        assert kv.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
    for bad in (2, 2.5, True, -1):
        r.num_computed_tokens = bad
        before = free_and_block_ids(kv, "a")
        with pytest.raises(InvalidArgumentError):
            kv.allocate_slots(r, 1)
        assert free_and_block_ids(kv, "a") == before
        kv.check_invariants()
    # a step back that reads nothing freed is allowed (speculative tokens rejected)
    r.num_computed_tokens = 20
    assert kv.allocate_slots(r, 1) is not None
    r.num_computed_tokens = 21
    assert kv.allocate_slots(r, 1) is not None
    kv.check_invariants()


def test_free_refuses_another_managers_request_of_the_same_id():
    kv = one_group_manager()
    other = one_group_manager()
    r = kv.make_request("a", [1, 2, 3])
    assert kv.allocate_slots(r, 3) is not None
    free = kv.num_free_blocks
    with pytest.raises(RequestError):
        kv.free(other.make_request("a", [1, 2, 3]))
    assert kv.num_free_blocks == free and kv.has_request("a")
    kv.free("a")  # by id: allowed
    kv.check_invariants()


@pytest.mark.parametrize("prompt", [{1, 2}, frozenset([1, 2]), {1: 2}, "12", b"12"])
def test_unordered_or_text_prompts_are_refused(prompt):
    kv = one_group_manager()
    with pytest.raises(InvalidArgumentError, match="ordered sequence of ints"):
        kv.make_request("a", prompt)


def test_admission_count_refuses_what_allocate_slots_refuses():
    kv = one_group_manager()
    r = kv.make_request("a", list(range(1, 10)))
    with pytest.raises(InvalidArgumentError, match="must be KVCacheBlocks"):
        kv.num_blocks_to_admit(r, 9, "junk", 4)
    assert kv.num_blocks_to_admit(r, 9) == 3
    assert kv.allocate_slots(r, 9) is not None
    with pytest.raises(InvalidArgumentError, match="already holds blocks"):
        kv.num_blocks_to_admit(r, 9)


# ------------------------------------------------------------------ random probe
JUNK = [None, -1, 0, 1, 3, 2.5, True, "a", "nope", b"x", [], [1], [-1], (2,), {}, object(), 1 << 70, [None]]


@pytest.mark.parametrize("stripe", [True, False], ids=["stripes", "groups"])
def test_random_arguments_raise_only_typed_errors(stripe):
    """Arbitrary values for every public call: it works or raises a HybridKVError, and the
    manager stays consistent and usable either way."""
    rng = random.Random(7)
    kv, r = world(stripe)
    reqs = [r["a"], r["f"], r["w"]]
    calls = [
        lambda x, y, z: kv.allocate_slots(x, y, z),
        lambda x, y, z: kv.allocate_slots(r["w"], x, y, z),
        lambda x, y, z: kv.allocate_slots(r["a"], x, num_lookahead_tokens=y),
        lambda x, y, z: kv.free(x),
        lambda x, y, z: kv.get_computed_blocks(x),
        lambda x, y, z: kv.make_request(x, y),
        lambda x, y, z: kv.make_request("p", [1, 2], lora_name=x, cache_salt=y),
        lambda x, y, z: kv.get_block_ids(x),
        lambda x, y, z: kv.has_request(x),
        lambda x, y, z: kv.remove_skipped_blocks(x),
        lambda x, y, z: r["a"].append_token_ids(x),
        lambda x, y, z: allocate_with_computed(r["w"], x),
        lambda x, y, z: kv.pool.lookup(x, y),
    ]
    def allocate_with_computed(req, value):
        good, req.num_computed_tokens = req.num_computed_tokens, value
        try:
            kv.allocate_slots(req, 1)
        finally:
            req.num_computed_tokens = good

    for _ in range(600):
        args = [rng.choice(JUNK + reqs) for _ in range(3)]
        call = rng.choice(calls)
        before = manager_snapshot(kv, reqs)
        try:
            call(*args)
        except HybridKVError:
            assert manager_snapshot(kv, reqs) == before, call
        kv.check_invariants()
    for rid in ("a", "w", "f", "p"):
        if kv.has_request(rid):
            kv.free(rid)
    kv.check_invariants()

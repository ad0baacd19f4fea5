"""Prefix hits against a brute-force oracle, for random cache contents.

A hit of L tokens is valid for a group when every block holding a token that the
next token (index L) attends to is cached; the blocks before that are null:

* full: tokens [0, L);
* sliding window W: tokens [max(0, L - W + 1), L);
* chunked local C: tokens [floor(L / C) * C, L);
* state (linear attention, SSM): the checkpoint after L tokens, i.e. block L / B - 1
  (nothing when L = 0): not downward closed.

The coordinator's answer must be the longest L <= max_length (whole blocks) valid for
every group, and the blocks it returns must be real exactly where tokens are needed.
With one manager per group (``stripe_groups=False``) every group's cache contents are
drawn independently; with stripes, groups of one spec are cached together.
"""

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.core.config import KVCacheConfig, KVCacheGroup
from hybridkv.core.coordinator import KVCacheCoordinator

from tests.support.kv_specs import chunked, fake_hashes, full, mark_cached, sliding, state
from tests.support.tiers import examples


def first_needed_token(spec, L):
    if spec.kind == "full_attention":
        return 0
    if spec.kind == "sliding_window":
        return max(0, L - spec.sliding_window + 1)
    if spec.kind == "mamba":
        return max(0, L - 1)
    return L // spec.attention_chunk_size * spec.attention_chunk_size


def valid(spec, cached, L, bs):
    return all(cached[i] for i in range(first_needed_token(spec, L) // bs, L // bs))


def check_hit(c, specs, hashes, cached, expect, bs, max_length):
    """The coordinator's hit equals the oracle's longest valid length, with real blocks
    (``expect[g][position]``) exactly where tokens are needed and null blocks before."""
    blocks, L = c.find_longest_cache_hit(hashes, max_length)
    limit = min(max_length, len(hashes) * bs) // bs * bs
    candidates = [x for x in range(0, limit + 1, bs) if all(valid(s, m, x, bs) for s, m in zip(specs, cached))]
    want = max(candidates) if limit >= bs else 0
    assert L == want, (specs, bs, cached, max_length)
    for g, (spec, table) in enumerate(zip(specs, blocks)):
        assert len(table) == L // bs
        first = first_needed_token(spec, L) // bs
        assert all(b.is_null for b in table[:first])
        assert all(not b.is_null and b.block_id == expect[g][i] for i, b in enumerate(table) if i >= first)


def make(kind, n, bs):
    return {"full": full, "state": state}[kind](bs) if kind in ("full", "state") else (
        sliding(n, bs) if kind == "sliding" else chunked(n, bs))


spec_strategy = st.one_of(
    st.just(("full", 0)),
    st.tuples(st.just("sliding"), st.integers(1, 9)),
    st.tuples(st.just("chunked"), st.integers(1, 9)),
    st.just(("state", 0)),
)


@settings(max_examples=examples(400), deadline=None)
@given(
    bs=st.integers(1, 4),
    kinds=st.lists(spec_strategy, min_size=1, max_size=3),
    data=st.data(),
)
def test_hit_is_the_longest_valid_for_every_group(bs, kinds, data):
    specs = [make(k, n, bs) for k, n in kinds]
    num_blocks = data.draw(st.integers(0, 10))
    hashes = fake_hashes(num_blocks)
    c = KVCacheCoordinator(KVCacheConfig(200, tuple(KVCacheGroup(s) for s in specs)), stripe_groups=False)
    cached = []
    for g in range(len(specs)):
        mask = data.draw(st.lists(st.booleans(), min_size=num_blocks, max_size=num_blocks))
        mark_cached(c.pool, hashes, mask, group=g, first_id=10 + 15 * g)
        cached.append(mask)
    expect = [{i: 10 + 15 * g + i for i in range(num_blocks)} for g in range(len(specs))]
    check_hit(c, specs, hashes, cached, expect, bs, data.draw(st.integers(0, num_blocks * bs + bs - 1)))


@settings(max_examples=examples(300), deadline=None)
@given(
    bs=st.integers(1, 4),
    kinds=st.lists(st.sampled_from([("full", 0), ("sliding", 3), ("chunked", 3), ("chunked", 5), ("state", 0)]),
                   min_size=1, max_size=5),
    data=st.data(),
)
def test_striped_hit_is_the_longest_valid_for_every_group(bs, kinds, data):
    specs = [make(k, n, bs) for k, n in kinds]
    num_blocks = data.draw(st.integers(0, 10))
    hashes = fake_hashes(num_blocks)
    c = KVCacheCoordinator(KVCacheConfig(400, tuple(KVCacheGroup(s) for s in specs)))
    pool = c.pool
    cached = [None] * len(specs)
    expect = [dict() for _ in specs]  # group -> {position: block id}
    for m in c.managers:  # groups of one spec: one mask, one stripe per cached position
        mask = data.draw(st.lists(st.booleans(), min_size=num_blocks, max_size=num_blocks))
        for i in range(num_blocks):
            if mask[i]:
                (lead,) = pool.get_new_stripes(1, m.width)
                pool.cache_full_blocks([lead], [hashes[i]], 0, 1, m.group_ids[0])
                pool.free_blocks([lead])
                for j, g in enumerate(m.group_ids):
                    expect[g][i] = (lead.stripe[j] if lead.stripe else lead).block_id
        for g in m.group_ids:
            cached[g] = mask
    pool.check_invariants()
    check_hit(c, specs, hashes, cached, expect, bs, data.draw(st.integers(0, num_blocks * bs + bs - 1)))

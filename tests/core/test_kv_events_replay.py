"""KV events replayed into a dict reproduce the pool's prefix cache exactly.

Hypothesis drives the random add / allocate / free / reset sequences of
:mod:`tests.core.test_random_operations` with events on; after every step the events
are drained into a replica ({block id: hash} per group) that must equal the pool's
cached set per group, and every BlockStored must carry the tokens and parent hash of
the request blocks it names, and its group's kind and window / chunk size.
"""

from hypothesis import HealthCheck, settings
from hypothesis.stateful import invariant

from hybridkv.core.config import CacheManagerConfig, KVCacheConfig, KVCacheGroup
from hybridkv.core.events import AllBlocksCleared, BlockRemoved, BlockStored
from hybridkv.core.kv_cache_manager import KVCacheManager

from tests.support.manager_machines import BS, HybridManagerMachine, MixedStripeWidthsMachine
from tests.support.tiers import examples


class EventReplay:
    """Mixed into a manager machine: the same rules, events on, the replica checked."""

    def __init__(self):
        super().__init__()
        cfg = KVCacheConfig(self.NUM_BLOCKS, tuple(KVCacheGroup(s) for s in self.specs))
        self.kv = KVCacheManager(cfg, CacheManagerConfig(max_model_len=64, enable_kv_events=True))
        self.replica: list[dict[int, bytes]] = [{} for _ in self.specs]
        self.all_requests: dict[str, object] = {}  # every request seen (they keep their tokens)

    def _chain(self) -> dict[bytes, tuple[bytes | None, tuple[int, ...]]]:
        """hash -> (parent hash, the block's tokens), over every request seen (a hash names a prefix)."""
        chain = {}
        for r in self.all_requests.values():
            for i, h in enumerate(r.block_hashes):
                chain[h] = (r.block_hashes[i - 1] if i else None, tuple(r.all_token_ids[i * BS:(i + 1) * BS]))
        return chain

    @invariant()
    def events_reproduce_the_cache(self):
        self.all_requests.update(self.waiting)
        self.all_requests.update(self.running)
        chain = None
        for e in self.kv.take_events():
            if isinstance(e, BlockStored):
                spec = self.specs[e.group_id]
                assert (e.spec_kind, e.attention_span, e.block_size) == (spec.kind, spec.attention_span, BS)
                assert len(e.block_ids) == len(e.block_hashes) and len(e.token_ids) == BS * len(e.block_hashes)
                chain = chain or self._chain()
                parent = e.parent_hash
                for i, (h, bid) in enumerate(zip(e.block_hashes, e.block_ids)):
                    assert chain[h] == (parent, e.token_ids[i * BS:(i + 1) * BS])
                    assert bid not in self.replica[e.group_id]
                    self.replica[e.group_id][bid] = h
                    parent = h
            elif isinstance(e, BlockRemoved):
                assert e.spec_kind == self.specs[e.group_id].kind
                assert self.replica[e.group_id].pop(e.block_id) == e.block_hash
            else:
                assert isinstance(e, AllBlocksCleared)
                for group in self.replica:
                    group.clear()
        for g, group in enumerate(self.replica):
            assert group == self.kv.pool.cached_block_ids(g), g


class HybridEventsMachine(EventReplay, HybridManagerMachine):
    pass


class MixedStripeEventsMachine(EventReplay, MixedStripeWidthsMachine):
    pass


_SETTINGS = settings(max_examples=examples(100), stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestHybridEvents = HybridEventsMachine.TestCase
TestHybridEvents.settings = _SETTINGS
TestMixedStripeEvents = MixedStripeEventsMachine.TestCase
TestMixedStripeEvents.settings = _SETTINGS

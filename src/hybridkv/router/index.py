"""What one replica has cached, from its KV event stream, and how long a prompt's hit there is.

A :class:`ReplicaIndex` is fed each batch of a replica's wire events
(:mod:`hybridkv.protocol.kv_events`: ours, or vLLM's) and keeps, per KV cache group, which
blocks are resident, keyed by OUR chained hash (:mod:`hybridkv.core.hashing`) recomputed
from the token ids each BlockStored carries: a replica that hashes differently (vLLM's
sha256_cbor, its 64-bit int hashes) indexes all the same. The replica's hash of a block
maps to ours, and a BlockStored's ``parent_block_hash`` is looked up there to chain the
next block (a prompt's first block chains from our seed). The map outlives residency (the
last ``chain_capacity`` replica hashes seen, plus every resident one), so a run stored
after its parent was evicted still chains.

Scoring runs the core's own hit rules: one manager per group, built with
:meth:`~hybridkv.core.managers.AttentionManager.detached` over the group's resident
hashes, and the coordinator's fixed point (:func:`~hybridkv.core.coordinator.fixed_point_hit`):
the longest prefix valid for every group (per attention type: README.md, "Semantics").

Example (block 4, a replica of 1 full + 1 sliding-window 8 group)::

    index = ReplicaIndex()
    index.apply(decode_batch(payload).events)      # the replica stored blocks 0-3 of a
    index.score(prompt)                            # 20-token prompt in both groups -> 16
    # then its sliding group evicted blocks 0-1 (out of the window): still 16, the
    # window of token 16 needs tokens 9-15 (blocks 2-3) only; evicting block 2 -> 8 (or less)

Groups are learned from BlockStored events (index, kind, window / chunk, block size); a
group whose metadata changes (the replica restarted with another config) clears the
index first. State groups (``mamba``: linear attention, SSM) are scored by the core's
state rule: a hit needs a checkpoint cached at exactly its length. AllBlocksCleared
drops every block but keeps the groups; :meth:`ReplicaIndex.clear` forgets them too.
Blocks stored with a LoRA name or extra keys get those mixed into our hash, so they never
match a plain prompt. EAGLE replicas recompute one more block than the score counts.

Nothing here raises on bad input: ``num_bad_events`` counts what was skipped (unknown
parent chain, BlockRemoved of a block never stored, inconsistent metadata, malformed
tokens, a kind the rules do not cover, e.g. a chunked group without its chunk size as
vLLM 0.33 sends: its blocks are chained, never scored). Not thread-safe: the caller
serialises :meth:`~ReplicaIndex.apply` and :meth:`~ReplicaIndex.score`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from hybridkv.core.coordinator import fixed_point_hit, hit_order
from hybridkv.core.hashing import get_hash_fn, hash_block_tokens, seed_hash
from hybridkv.core.managers import AttentionManager, manager_class_for
from hybridkv.core.request import BlockHasher, Request
from hybridkv.core.specs import CacheSpec, ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec
from hybridkv.core.state_spec import StateSpec
from hybridkv.errors import HybridKVError, InvalidArgumentError

__all__ = ["ReplicaIndex", "GroupInfo", "Prompt", "FULL_KINDS", "SLIDING_KINDS", "CHUNKED_KINDS", "STATE_KINDS"]

#: wire kinds scored with full-attention rules (None: a pre-hybrid vLLM names no kind)
FULL_KINDS = frozenset({"full_attention", "mla_attention", None})
SLIDING_KINDS = frozenset({"sliding_window", "sliding_window_mla"})
CHUNKED_KINDS = frozenset({"chunked_local_attention"})
#: recurrent state groups (vLLM names every state layer "mamba"); their events carry no span
STATE_KINDS = frozenset({"mamba"})


@dataclass(frozen=True, slots=True)
class GroupInfo:
    """One group of a replica as its events describe it; ``span`` is the window (sliding)
    or chunk size (chunked), None for full attention. ``scored``: the hit rules cover it."""

    kind: str | None
    span: int | None
    block_size: int
    scored: bool = True


def _spec(kind: str | None, span: Any, block_size: int) -> CacheSpec | None:
    """The core spec whose manager applies the group's rules, None if none does (the
    rules read only the block size, the kind and the window / chunk)."""
    common = dict(block_size=block_size, num_kv_heads=1, head_size=1)
    try:
        if kind in STATE_KINDS:
            return StateSpec(block_size=block_size, shapes=((1,),), dtypes=("float32",))
        if kind in FULL_KINDS:
            return FullAttentionSpec(**common)
        if kind in SLIDING_KINDS:
            return SlidingWindowSpec(**common, sliding_window=span)
        if kind in CHUNKED_KINDS:
            return ChunkedLocalAttentionSpec(**common, attention_chunk_size=span)
    except HybridKVError:  # a window / chunk that is not a positive int
        return None
    return None


class Prompt:
    """A prompt's token ids and, cached per (block size, hash), its block hashes: make one
    per request and score it on every replica to hash it once.

    >>> p = Prompt(range(10))
    >>> len(p.block_hashes(4)), p.block_hashes(4) is p.block_hashes(4)
    (2, True)
    """

    __slots__ = ("token_ids", "_hashes")

    _HASHERS: dict[tuple[int, str], BlockHasher] = {}

    def __init__(self, token_ids: Sequence[int]):
        self.token_ids = token_ids
        self._hashes: dict[tuple[int, str], list] = {}

    def __len__(self) -> int:
        return len(self.token_ids)

    def block_hashes(self, block_size: int, hash_algo: str = "sha256") -> list:
        """Our chained hashes of the full blocks (the core's own hasher: the bytes the engine's
        ``make_request`` computes); InvalidArgumentError for ids outside [0, 2**63)."""
        key = (block_size, hash_algo)
        hashes = self._hashes.get(key)
        if hashes is None:
            hasher = self._HASHERS.get(key)
            if hasher is None:
                hasher = self._HASHERS[key] = BlockHasher(block_size, hash_algo)
            hashes = Request("route", self.token_ids, hasher=hasher).block_hashes if len(self.token_ids) else []
            self._hashes[key] = hashes
        return hashes


class _Group:
    """One group's residency: {our hash: count} (what its detached manager reads) and
    {replica hash: [our hash, count]} (what BlockRemoved names)."""

    __slots__ = ("info", "resident", "stored", "manager")

    def __init__(self, info: GroupInfo, spec: CacheSpec | None):
        self.info = info
        self.resident: dict[Any, int] = {}
        self.stored: dict[Any, list] = {}
        self.manager: AttentionManager | None = (
            manager_class_for(spec).detached(spec, self.resident) if spec is not None else None
        )


class ReplicaIndex:
    """Per group, which blocks of which token chains one replica holds (see the module doc)."""

    def __init__(self, hash_algo: str = "sha256", *, chain_capacity: int = 1 << 16):
        if type(chain_capacity) is not int or chain_capacity < 1:
            raise InvalidArgumentError(f"chain_capacity must be an int >= 1, got {chain_capacity!r}")
        self.hash_algo = hash_algo
        self._fn = get_hash_fn(hash_algo)
        self._seed = seed_hash(self._fn)
        self._capacity = chain_capacity
        self._groups: dict[int, _Group] = {}
        # replica hash -> our hash, two generations (bounded, O(1) to age)
        self._chain: dict = {}
        self._chain_old: dict = {}
        self._order: list[AttentionManager] = []
        self._order_full: list[AttentionManager] = []
        self._block_sizes: set[int] = set()
        #: resident blocks, all groups (a block stored twice counts twice)
        self.num_blocks = 0
        #: events (or blocks of one) skipped: unknown parent, unknown removal, bad metadata...
        self.num_bad_events = 0

    # ------------------------------------------------------------ state
    @property
    def groups(self) -> dict[int, GroupInfo]:
        """{group index: its kind, window / chunk, block size}, as learned from events."""
        return {gid: g.info for gid, g in sorted(self._groups.items())}

    def clear(self) -> None:
        """Forget everything: blocks, chains and groups (e.g. the replica went down)."""
        self._groups.clear()
        self._drop_blocks()
        self._rebuild()

    def _drop_blocks(self) -> None:
        for g in self._groups.values():
            g.resident.clear()
            g.stored.clear()
        self._chain = {}
        self._chain_old = {}
        self.num_blocks = 0

    def _rebuild(self) -> None:
        managers = [g.manager for g in self._groups.values() if g.manager is not None]
        self._order = hit_order(managers)
        self._order_full = [m for m in self._order if m.downward_closed]
        self._block_sizes = {m.block_size for m in managers}

    # ------------------------------------------------------------ events
    def apply(self, events: Iterable[Any]) -> None:
        """Apply one batch's wire events in order (BlockStored / BlockRemoved / AllBlocksCleared);
        anything else, or anything inconsistent, is counted in ``num_bad_events``."""
        for e in events:
            name = type(e).__name__
            try:
                if name == "BlockStored":
                    self._stored(e)
                elif name == "BlockRemoved":
                    self._removed(e)
                elif name == "AllBlocksCleared":
                    self._drop_blocks()
                else:
                    self.num_bad_events += 1
            except (AttributeError, TypeError, ValueError):  # a struct of another shape
                self.num_bad_events += 1

    def _our_hash(self, replica_hash: Any) -> Any:
        ours = self._chain.get(replica_hash)
        if ours is None:
            ours = self._chain_old.get(replica_hash)
            if ours is None:
                for g in self._groups.values():
                    entry = g.stored.get(replica_hash)
                    if entry is not None:
                        return entry[0]
        return ours

    def _remember(self, replica_hash: Any, ours: Any) -> None:
        chain = self._chain
        chain[replica_hash] = ours
        if len(chain) >= self._capacity:
            self._chain_old, self._chain = chain, {}

    def _stored(self, e: Any) -> None:
        hashes = e.block_hashes
        bs = e.block_size
        tokens = e.token_ids
        if type(bs) is not int or bs < 1 or len(tokens) != bs * len(hashes) or not hashes:
            self.num_bad_events += 1
            return
        gid = 0 if e.group_idx is None else e.group_idx
        kind, span = e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window
        info = GroupInfo(kind, None if kind in FULL_KINDS or kind in STATE_KINDS else span, bs)
        group = self._groups.get(gid)
        if group is None or group.info.kind != kind or group.info.span != info.span or group.info.block_size != bs:
            if group is not None:  # the replica restarted with another config
                self.num_bad_events += 1
                self._groups.clear()
                self._drop_blocks()
            spec = _spec(kind, span, bs)
            if spec is None:
                self.num_bad_events += 1
                info = GroupInfo(kind, info.span, bs, scored=False)
            group = self._groups[gid] = _Group(info, spec)
            self._rebuild()
        parent = self._seed if e.parent_block_hash is None else self._our_hash(e.parent_block_hash)
        if parent is None:  # the chain before this run is unknown: its tokens name no prefix we can key
            self.num_bad_events += 1
            return
        lora, extra = e.lora_name, e.extra_keys
        if extra is not None and len(extra) != len(hashes):
            extra = [tuple(extra)] * len(hashes)
        fn = self._fn
        chain_get, old_get = self._chain.get, self._chain_old.get
        resident, stored = group.resident, group.stored
        for i, rh in enumerate(hashes):
            ours = chain_get(rh) or old_get(rh)  # hashed before (another group, an earlier run)
            if ours is None:
                key = extra[i] if extra is not None else None
                keys = ("lora", lora, key) if lora is not None or key else None
                try:
                    ours = hash_block_tokens(fn, parent, tokens[i * bs:(i + 1) * bs], keys)
                except HybridKVError:  # token ids outside [0, 2**63)
                    self.num_bad_events += 1
                    return
            self._remember(rh, ours)
            entry = stored.get(rh)
            if entry is None:
                stored[rh] = [ours, 1]
            elif entry[0] == ours:
                entry[1] += 1
            else:  # one replica hash for two prefixes: keep the first
                self.num_bad_events += 1
                parent = ours
                continue
            resident[ours] = resident.get(ours, 0) + 1
            self.num_blocks += 1
            parent = ours

    def _removed(self, e: Any) -> None:
        group = self._groups.get(0 if e.group_idx is None else e.group_idx)
        for rh in e.block_hashes:
            entry = group.stored.get(rh) if group is not None else None
            if entry is None:
                self.num_bad_events += 1
                continue
            ours = entry[0]
            entry[1] -= 1
            if not entry[1]:
                del group.stored[rh]
            n = group.resident[ours] - 1
            if n:
                group.resident[ours] = n
            else:
                del group.resident[ours]
            self.num_blocks -= 1

    # ------------------------------------------------------------ scoring
    def score(self, prompt: Sequence[int] | Prompt, max_length: int | None = None) -> int:
        """Tokens of ``prompt`` (ids, or a :class:`Prompt` to share its hashes between
        replicas) the replica can skip: the longest prefix of at most ``len - 1`` tokens
        (and ``max_length``) valid for every scored group; 0 before any group is known."""
        return self._score(self._order, prompt, max_length)

    def score_full_only(self, prompt: Sequence[int] | Prompt, max_length: int | None = None) -> int:
        """The same over the full-attention groups alone (what a router that drops the
        sparse groups predicts); 0 when the replica has none."""
        return self._score(self._order_full, prompt, max_length)

    def _score(self, order: list[AttentionManager], prompt: Any, max_length: int | None) -> int:
        if not order:
            return 0
        if type(prompt) is not Prompt:
            prompt = Prompt(prompt)
        limit = len(prompt) - 1
        if max_length is not None and max_length < limit:
            limit = max_length
        if limit <= 0:
            return 0
        if len(self._block_sizes) == 1:
            hashes = prompt.block_hashes(order[0].block_size, self.hash_algo)
            return fixed_point_hit(order, hashes, limit)[1]
        hashes_of = {m: prompt.block_hashes(m.block_size, self.hash_algo) for m in order}
        return fixed_point_hit(order, (), limit, hashes_of)[1]

"""The prefix-cache map of :class:`~hybridkv.core.block_pool.BlockPool`: looking blocks
up by content address, giving blocks addresses, and taking addresses away (eviction).

Keyed by (block hash, group id): one dict per group, so a block cached for group 1
is never returned for group 0; striped groups share their lead group's dict, which
maps a hash to a stripe lead. A hash held by several blocks maps to
{block_id: block}. See :mod:`hybridkv.core.block_pool` for blocks' life.
"""

from __future__ import annotations

from typing import Sequence

from hybridkv.core.blocks import KVCacheBlock
from hybridkv.core.events import BlockRemoved, BlockStored
from hybridkv.core.hashing import BlockHash
from hybridkv.errors import InvalidArgumentError

__all__ = ["PrefixCacheMap"]


class PrefixCacheMap:
    """Mixed into BlockPool, whose ``__init__`` sets the attributes used here
    (``_cached``, ``_member_of``, ``_stripe_groups``, ``_events``, ``cache_epoch``...)."""

    __slots__ = ()

    def get_cached_block(self, block_hash: BlockHash, group_ids: Sequence[int]) -> list[KVCacheBlock] | None:
        """The cached block of ``block_hash`` in each group, or None if any group misses."""
        out = []
        for g in group_ids:
            hit = self.lookup(block_hash, g)
            if hit is None:
                return None
            out.append(hit)
        return out

    def _check_group(self, group_id: int) -> None:
        if type(group_id) is not int or not 0 <= group_id < self.num_groups:
            raise InvalidArgumentError(f"group id must be an int in [0, {self.num_groups}), got {group_id!r}")

    def group_map(self, group_id: int) -> dict:
        """Group ``group_id``'s hash map (hash -> block, or {block_id: block} for duplicates); read only.

        For striped groups it is the lead group's map, whose blocks are stripe leads."""
        self._check_group(group_id)
        return self._cached[self._member_of[group_id][0]]

    def lookup(self, block_hash: BlockHash, group_id: int) -> KVCacheBlock | None:
        """The cached block of ``block_hash`` in one group (no list built)."""
        self._check_group(group_id)
        lead_group, j = self._member_of[group_id]
        try:
            hit = self._cached[lead_group].get(block_hash)
        except TypeError:  # unhashable
            raise InvalidArgumentError(f"a block hash is bytes, got {block_hash!r:.40}") from None
        if hit is not None and type(hit) is dict:
            hit = next(iter(hit.values()))
        if hit is not None and j:
            hit = hit.stripe[j]
        return hit

    def cached_block_ids(self, group_id: int) -> dict[int, BlockHash]:
        """{block id: block hash} of every block holding a content address in ``group_id``
        (duplicates and stripe followers included); for checks, e.g. against KV events."""
        self._check_group(group_id)
        lead_group, j = self._member_of[group_id]
        out: dict[int, BlockHash] = {}
        for key, entry in self._cached[lead_group].items():
            for block in entry.values() if type(entry) is dict else (entry,):
                out[(block.stripe[j] if j else block).block_id] = key
        return out

    def _evict_all(self, blocks: list[KVCacheBlock]) -> None:
        """Forget the content address of every cached block (or stripe) among ``blocks``."""
        maps = self._cached
        self.cache_epoch += 1
        events = self._events if self.enable_kv_events else None
        for block in blocks:
            key = block.block_hash
            if key is None:
                continue
            group = maps[block.group_id]
            entry = group.get(key)
            if entry is block:
                del group[key]
            elif type(entry) is dict:
                del entry[block.block_id]
                if len(entry) == 1:
                    group[key] = next(iter(entry.values()))
            if events is not None:
                gids = self._stripe_groups.get(block.group_id, (block.group_id,))
                for member, gid in zip(block.stripe or (block,), gids):
                    events.append(BlockRemoved(key, member.block_id, gid, self.group_kinds[gid]))
            block.block_hash = None
            block.group_id = -1

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        start: int,
        end: int,
        group_id: int,
        token_ids: Sequence[int] | None = None,
    ) -> None:
        """Give blocks[start:end] the content addresses block_hashes[start:end] in ``group_id``.

        Null blocks and blocks already cached (prefix hits) are skipped. For a
        striped lead group, ``blocks`` are stripe leads and every member group is cached.
        ``token_ids`` (the request's tokens) are read only for KV events.
        """
        self._check_group(group_id)
        if self._member_of[group_id][1]:
            raise InvalidArgumentError(f"group {group_id} is striped: cache its stripes through their lead group")
        if not (type(start) is int and type(end) is int and 0 <= start <= end <= min(len(blocks), len(block_hashes))):
            raise InvalidArgumentError(
                f"cache range [{start!r}, {end!r}) is outside {len(blocks)} blocks / {len(block_hashes)} hashes"
            )
        cached = self._cached[group_id]
        stored: list[int] | None = [] if self.enable_kv_events else None
        for i in range(start, end):
            block = blocks[i]
            if block.is_null or block.block_hash is not None:
                continue
            key = block_hashes[i]
            block.block_hash = key
            block.group_id = group_id
            entry = cached.get(key)
            if entry is None:
                cached[key] = block
            elif type(entry) is dict:
                entry[block.block_id] = block
            else:
                cached[key] = {entry.block_id: entry, block.block_id: block}
            if stored is not None:
                stored.append(i)
        if stored:
            self._stored_events(blocks, block_hashes, stored, group_id, token_ids)

    def _stored_events(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        positions: list[int],
        group_id: int,
        token_ids: Sequence[int] | None,
    ) -> None:
        """One BlockStored per run of consecutive ``positions`` and per member group
        (a stripe's groups get one event each, with their own block ids)."""
        bs = self.block_size
        runs: list[list[int]] = []
        for i in positions:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first, last = run[0], run[-1]
            parent = block_hashes[first - 1] if first > 0 else None
            hashes = tuple(block_hashes[first:last + 1])
            tokens = tuple(token_ids[first * bs:(last + 1) * bs]) if token_ids is not None else ()
            for j, gid in enumerate(self._stripe_groups.get(group_id, (group_id,))):
                ids = tuple((b.stripe[j] if b.stripe else b).block_id for b in (blocks[i] for i in run))
                self._events.append(
                    BlockStored(hashes, ids, parent, bs, gid, self.group_kinds[gid], tokens, self.group_spans[gid])
                )

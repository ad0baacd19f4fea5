"""Test-only block bookkeeping, standing in for the core KV cache manager.

Per request and group it keeps a block table; before each step it replaces the
blocks that no query of this step or later can attend to by the null block 0:

    chunked C  blocks wholly before floor(n / C) * C
    sliding W  blocks wholly before n - W + 1
    full       none

(``n`` = tokens already computed = position of the step's first query). Freed blocks
(ref count 0) and the null block are filled with NaN in the KV storage, so any read
of one turns the outputs into NaN and the parity tests fail.

Optional prefix sharing: a new request may start at ``n`` computed tokens (a
multiple of the block size) by sharing a running request's blocks when the prompts
agree on ``n`` tokens and the donor still holds every block a query at ``n`` needs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hybridkv.engine.attention.types import AttentionType
from hybridkv.engine.kv_storage import PagedKVStorage

NULL = 0


def first_needed_position(attn: AttentionType, n: int) -> int:
    """The smallest key position a query at position ``n`` (or later) may attend to."""
    if attn.kind == "sliding":
        return max(0, n - attn.size + 1)
    if attn.kind == "chunked":
        return (n // attn.size) * attn.size
    return 0


@dataclass
class Stats:
    nulled_blocks: int = 0
    shared_tokens: int = 0
    peak_used_blocks: int = 0


@dataclass
class NaiveBlocks:
    group_types: list[AttentionType]
    block_size: int
    num_blocks: int
    storage: PagedKVStorage | None = None
    free: deque = field(init=False)
    refs: dict = field(init=False, default_factory=dict)
    tables: dict = field(init=False, default_factory=dict)
    stats: Stats = field(init=False, default_factory=Stats)

    def __post_init__(self) -> None:
        self.free = deque(range(1, self.num_blocks))
        if self.storage is not None:
            self.storage.fill_blocks(list(range(self.num_blocks)), float("nan"))

    # ------------------------------------------------------------ internals
    def _release(self, block: int) -> None:
        if block == NULL:
            return
        self.refs[block] -= 1
        if self.refs[block] == 0:
            del self.refs[block]
            self.free.append(block)
            if self.storage is not None:
                self.storage.fill_blocks([block], float("nan"))

    def _needed_new_blocks(self, req: str, total_tokens: int) -> int:
        need = -(-total_tokens // self.block_size)
        return sum(max(0, need - len(t)) for t in self.tables[req])

    # -------------------------------------------------------------- public
    def add(self, req: str) -> None:
        assert req not in self.tables
        self.tables[req] = [[] for _ in self.group_types]

    def drop_out_of_range(self, req: str, num_computed: int) -> None:
        """Null the blocks no query at ``num_computed`` or later can attend to."""
        for attn, table in zip(self.group_types, self.tables[req]):
            first = first_needed_position(attn, num_computed)
            for b in range(min(first // self.block_size, len(table))):
                if table[b] != NULL:
                    self._release(table[b])
                    table[b] = NULL
                    self.stats.nulled_blocks += 1

    def allocate(self, req: str, num_computed: int, num_new: int) -> bool:
        """Make the tables cover ``num_computed + num_new`` tokens; False if the pool is short."""
        self.drop_out_of_range(req, num_computed)
        total = num_computed + num_new
        if self._needed_new_blocks(req, total) > len(self.free):
            return False
        need = -(-total // self.block_size)
        for table in self.tables[req]:
            while len(table) < need:
                block = self.free.popleft()
                self.refs[block] = 1
                table.append(block)
        used = self.num_blocks - 1 - len(self.free)
        self.stats.peak_used_blocks = max(self.stats.peak_used_blocks, used)
        return True

    def release_all(self, req: str) -> None:
        for table in self.tables.pop(req):
            for block in table:
                self._release(block)

    def block_ids(self, req: str) -> tuple[list[int], ...]:
        return tuple(list(t) for t in self.tables[req])

    def share_prefix(self, req: str, tokens: list[int], donors: dict[str, tuple[list[int], int]]) -> int:
        """Start ``req`` from the longest usable shared prefix; returns its computed tokens.

        ``donors``: request id -> (its tokens, its computed count).
        """
        bs = self.block_size
        best, best_donor = 0, None
        for donor, (dtokens, dcomputed) in donors.items():
            if donor not in self.tables:
                continue
            limit = min(len(tokens) - 1, dcomputed)
            n = (limit // bs) * bs
            while n > best:
                if tokens[:n] == dtokens[:n] and self._donor_has(donor, n):
                    best, best_donor = n, donor
                    break
                n -= bs
        if best_donor is None:
            return 0
        for attn, mine, theirs in zip(self.group_types, self.tables[req], self.tables[best_donor]):
            first_block = first_needed_position(attn, best) // bs
            for b in range(best // bs):
                block = theirs[b] if b >= first_block else NULL
                if block != NULL:
                    self.refs[block] += 1
                mine.append(block)
        self.stats.shared_tokens += best
        return best

    def _donor_has(self, donor: str, n: int) -> bool:
        bs = self.block_size
        for attn, table in zip(self.group_types, self.tables[donor]):
            first_block = first_needed_position(attn, n) // bs
            if any(table[b] == NULL for b in range(first_block, n // bs)):
                return False
        return True

"""One request's block table in one manager (:class:`RequestBlocks`) and the checks of every
table a manager holds (:func:`check_tables`, run by ``check_invariants``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridkv.errors import InvariantViolation

if TYPE_CHECKING:
    from hybridkv.core.block_pool import KVCacheBlock

__all__ = ["RequestBlocks", "check_table_shape", "check_tables", "overlap"]


class RequestBlocks:
    """One request's block table in one manager.

    ``blocks`` is the first group's table (stripe leads; the null block for
    skipped positions); the other groups' tables follow from it (member j of each
    lead). ``ids[g]`` are the block ids of the manager's g-th group: ``ids[0]``
    always current, the others brought up to date on demand (``synced`` leading
    positions are), so a caller that never asks for them costs nothing.
    Example (two groups, blocks [null, S5, S9] with stripes (5, 6), (9, 10)):
    ids [[0, 5, 9], [0, 6, 10]].
    """

    __slots__ = ("blocks", "ids", "num_cached", "num_skipped", "synced", "gap")

    def __init__(self, num_groups: int):
        self.blocks: list[KVCacheBlock] = []
        self.ids: list[list[int]] = [[] for _ in range(num_groups)]
        self.num_cached = 0
        self.num_skipped = 0
        self.synced = 0  # leading positions of ids[1:] that are current
        self.gap = (0, 0)  # positions [lo, hi) past num_skipped holding null blocks (tail_only); (0, 0): none


def overlap(a: int, b: int, gap: tuple[int, int]) -> int:
    """Positions of ``[a, b)`` inside ``gap``: ``overlap(2, 9, (4, 6)) == 2``."""
    return max(0, min(b, gap[1]) - max(a, gap[0]))


def check_tables(manager, ref_counts: dict[int, int]) -> None:
    """Check every table of ``manager`` (an :class:`~hybridkv.core.managers.base.AttentionManager`)
    and add its block references to ``ref_counts``; the table's shape is the manager's own rule
    (``manager._check_table_shape``)."""
    width = manager.width
    for rid, st in manager.requests.items():
        length = len(st.blocks)
        if not 0 <= st.num_skipped <= length or not 0 <= st.num_cached <= length or st.synced > length:
            raise InvariantViolation(
                f"request {rid!r}: skipped {st.num_skipped} / cached {st.num_cached} / synced {st.synced} "
                f"outside table of {length}"
            )
        if [b.block_id for b in st.blocks] != st.ids[0]:
            raise InvariantViolation(f"request {rid!r}: block id list out of sync with its table")
        manager._check_table_shape(rid, st)
        for i, block in enumerate(st.blocks):
            if not block.is_null and width > 1 and (block.stripe is None or len(block.stripe) != width):
                raise InvariantViolation(f"request {rid!r}: block {block.block_id} at {i} is no stripe of {width}")
        for g, ids in enumerate(st.ids[1:], 1):
            want = [0 if b.is_null else b.stripe[g].block_id for b in st.blocks[:st.synced]]
            if ids != want:
                raise InvariantViolation(f"request {rid!r}: ids of group {manager.group_ids[g]} out of sync")
        for table in manager._per_group(st.blocks):
            for block in table:
                if not block.is_null:
                    ref_counts[block.block_id] = ref_counts.get(block.block_id, 0) + 1


def check_table_shape(rid: str, st: RequestBlocks, tail_only: bool) -> None:
    """Null blocks exactly at the skipped positions (the leading ones) and, ``tail_only``, one gap
    past them that the table's last block is not in."""
    lo, hi = st.gap
    if st.gap != (0, 0) and (not tail_only or not st.num_skipped < hi <= len(st.blocks) or lo >= hi
                             or st.blocks[-1].is_null):
        raise InvariantViolation(f"request {rid!r}: gap {st.gap} in a table of {len(st.blocks)} "
                                 f"({st.num_skipped} skipped, tail_only {tail_only})")
    for i, block in enumerate(st.blocks):
        if block.is_null != (i < st.num_skipped or lo <= i < hi):
            raise InvariantViolation(
                f"request {rid!r}: block {block.block_id} at {i} with {st.num_skipped} skipped, gap {st.gap}")

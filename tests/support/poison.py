"""NaN in every KV block a read must never reach: a read of a stale or unwritten slot then
poisons the logits (the differential and fault-injection tests)."""

from __future__ import annotations

__all__ = ["poison_free_blocks"]


def poison_free_blocks(engine) -> None:
    """NaN into every block of ``engine`` (an LLMEngine) no running request holds and no
    prefix-cache entry names."""
    keep = {0}
    for seq in engine.scheduler.running:
        for table in engine.kv.get_block_ids(seq.request_id):
            keep.update(table)
    for block in engine.kv.pool.blocks:
        if block.block_hash is not None:
            keep.update(b.block_id for b in (block.stripe or (block,)))
    engine.storage.fill_blocks(sorted(set(range(engine.storage.num_blocks)) - keep), float("nan"))

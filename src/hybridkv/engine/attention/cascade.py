"""When a step attends to its sequences' shared prefix once (cascade attention).

If every sequence of a step holds the same first blocks in a group (a system prompt hit
by all of them), the keys of those blocks can be read once for all queries: a *prefix
pass* attends every query to the keys ``[0, P)`` (one shared block table, no causal
mask: every query comes after them), a *suffix pass* attends each query to its own keys
from ``P``, and the two are merged by their log-sum-exps
(:func:`~hybridkv.engine.attention.triton_kernels.merge.merge_attention`).

Which layers may: full attention always; a sliding-window or chunked-local layer only when
every query of the step still sees the whole prefix (sliding ``W``: every position
``< W``; chunked ``C``: every position in chunk 0), since otherwise the prefix pass would
read keys a query may not see. Whether it pays is vLLM's ``use_cascade_attention``
model: at least 256 shared tokens and 8 sequences; then always, unless the step is a
pure GQA decode, where flash-decoding's programs are compared with cascade's waves.

Worked example (block size 16, 8 sequences whose tables all start ``[5, 9, 2, ...]``
and then differ; the shortest has 300 tokens computed): 3 shared blocks -> P = 48 < 256:
no cascade. With 20 shared blocks, P = 320 > 300 -> P = 300, the shortest's start.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["CASCADE_MIN_PREFIX", "CASCADE_MIN_SEQS", "common_prefix_blocks", "cascade_prefix_len",
           "use_cascade"]

#: vLLM's thresholds: fewer shared tokens or sequences are not worth a second pass
CASCADE_MIN_PREFIX = 256
CASCADE_MIN_SEQS = 8


def common_prefix_blocks(tables: Sequence[Sequence[int]], null_block: int = 0) -> int:
    """Leading block ids every table holds, the null block never counted.

    >>> common_prefix_blocks([[5, 9, 2, 7], [5, 9, 2, 8], [5, 9, 3]])
    2
    >>> common_prefix_blocks([[0, 9], [0, 9]])
    0
    """
    first = tables[0]
    n = min(len(t) for t in tables)
    for c in range(n):
        block = first[c]
        if block == null_block or any(t[c] != block for t in tables):
            return c
    return n


def use_cascade(prefix_len: int, query_lens: Sequence[int], num_heads: int, num_kv_heads: int,
                num_sms: int) -> bool:
    """vLLM's ``use_cascade_attention`` performance model (``prefix_len`` shared tokens)."""
    if prefix_len < CASCADE_MIN_PREFIX or len(query_lens) < CASCADE_MIN_SEQS:
        return False
    rep = num_heads // num_kv_heads
    if not (rep > 1 and all(q == 1 for q in query_lens)):  # no flash-decoding to compare with
        return True
    tile = 128
    prefix_tiles = -(-prefix_len // tile)
    cascade_time = -(-num_heads * -(-len(query_lens) // tile) // num_sms) * prefix_tiles
    decoding_ctas = len(query_lens) * num_kv_heads * -(-rep // tile) * prefix_tiles
    return cascade_time < -(-decoding_ctas // num_sms)


def cascade_prefix_len(
    tables: Sequence[Sequence[int]], starts: Sequence[int], query_lens: Sequence[int], block_size: int,
    kind: str, size: int | None, num_heads: int, num_kv_heads: int, num_sms: int,
) -> int:
    """The shared prefix ``P`` (tokens) a step of one group attends to once, 0 for none.

    ``tables[s]`` is sequence ``s``'s block table in the group, whose layers are of ``kind``;
    ``P`` is capped at the smallest ``starts[s]`` so every query comes after it.
    """
    if len(starts) < CASCADE_MIN_SEQS or min(starts) < CASCADE_MIN_PREFIX:
        return 0
    if kind != "full" and max(a + q for a, q in zip(starts, query_lens)) > int(size):
        return 0  # some query no longer sees the whole prefix (last position >= W, or past chunk 0)
    prefix = min(common_prefix_blocks(tables) * block_size, min(starts))
    return prefix if use_cascade(prefix, query_lens, num_heads, num_kv_heads, num_sms) else 0

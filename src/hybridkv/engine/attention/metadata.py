"""The step's attention metadata: what every backend reads, built once per step.

A step computes a flat batch of ``T`` tokens from ``S`` sequences (varlen). Sequence ``s``
computes ``q_len[s]`` tokens at absolute positions ``start[s] .. start[s] + q_len[s] - 1``
(``start`` = tokens already computed) and its group-``g`` block table maps position ``p`` to
slot ``table[p // block_size] * block_size + p % block_size``. Worked example: block size 4,
a table ``[7, 2]``: position 5 is slot ``2 * 4 + 1 = 9``.

A ``tail_only`` group (sliding window / chunked local storing only what later tokens read)
may map a prefill chunk's dead positions to the null block: those tokens get slot ``-1`` (not
stored) and the step's attention reads every key it computed itself from the step's own K/V
(``gap_groups`` names the groups where this step has such positions; decode steps never do).

Only fields every backend shares live here; what a backend computes once per step (layouts,
query plans, splits) is its own typed step state, ``meta.state``
(:meth:`~hybridkv.engine.attention.backend.AttentionBackend.new_state`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from hybridkv.engine.attention.registry import get_backend
from hybridkv.engine.host_tensors import long_tensor
from hybridkv.engine.kv_storage import PagedKVStorage
from hybridkv.errors import InvalidArgumentError

__all__ = ["AttentionMetadata", "gap_groups", "padded_tables"]


def padded_tables(block_ids: Sequence[Sequence[Sequence[int]]]) -> tuple[list[int], int]:
    """Every sequence's group tables flattened ``[S, G, W]``, null-padded to the widest (``W``).

    >>> padded_tables([[[3, 4], [5]], [[6], [7, 8, 9]]])
    ([3, 4, 0, 5, 0, 0, 6, 0, 0, 7, 8, 9], 3)
    """
    width = max(len(t) for tables in block_ids for t in tables)
    flat: list[int] = []
    for tables in block_ids:
        for t in tables:
            flat.extend(t)
            flat.extend([0] * (width - len(t)))
    return flat, width


def gap_groups(block_ids: Sequence[Sequence[Sequence[int]]], starts: Sequence[int], query_lens: Sequence[int],
               block_size: int) -> frozenset[int]:
    """Groups in which some sequence's table maps one of its step's positions (``starts[s] ..
    starts[s] + query_lens[s] - 1``) to the null block 0 (a tail_only gap: whole blocks of the
    step's own tokens).

    >>> sorted(gap_groups([[[3, 4, 5], [6, 0, 7]]], [1], [10], 4))
    [1]
    """
    out: set[int] = set()
    for tables, a, n in zip(block_ids, starts, query_lens):
        if n > block_size:
            lo, hi = -(-a // block_size), (a + n) // block_size
            out.update(g for g, t in enumerate(tables) if 0 in t[lo:hi])
    return frozenset(out)


@dataclass(slots=True)
class AttentionMetadata:
    """Everything the attention layers of one step read, built once per step.

    Use :meth:`build`. Tensors: ``positions`` [T]; ``start`` / ``q_len`` / ``seq_len``
    [S]; ``block_tables[g]`` [S, max_blocks_g] (padded with the null block, which is
    never read); ``slot_mappings[g]`` [T]. ``starts`` / ``query_lens``: the same as
    Python ints (the layouts are planned from them). ``output_seqs``: the sequences
    whose last token's output the step needs (None: every token's). ``gap_groups``: the
    groups whose tables map some of this step's own positions to the null block (their
    slots are -1; attention reads the step's keys from its K/V).
    """

    storage: PagedKVStorage
    positions: torch.Tensor
    start: torch.Tensor
    q_len: torch.Tensor
    seq_len: torch.Tensor
    starts: list[int]
    query_lens: list[int]
    block_tables: list[torch.Tensor]
    slot_mappings: list[torch.Tensor]
    output_seqs: list[int] | None = None
    #: the :class:`~hybridkv.engine.attention.backend.AttentionBackend` that runs this step's attention
    #: (a registered name is resolved to it)
    backend: Any = "reference"
    #: a CUDA-graph decode step: no sequence has more keys than this (its splits are fixed by it, not by the step)
    decode_key_bound: int | None = None
    block_ids: Sequence[Sequence[Sequence[int]]] | None = None  # the tables as given (cascade reads them)
    #: ints -> an int64 tensor on the device (None: :func:`long_tensor`); use :meth:`ints`
    upload: Callable[[Sequence[int]], torch.Tensor] | None = None
    #: groups with unstored positions this step (tail_only gaps; see the module docstring)
    gap_groups: frozenset[int] = frozenset()
    #: the backend's step state (:meth:`AttentionBackend.new_state`), made with the metadata
    state: Any = None
    _decode: bool | None = field(default=None, repr=False)
    _output_rows: Any = field(default=False, repr=False)  # False: not computed yet
    _stored: dict = field(default_factory=dict, repr=False)  # group -> (rows, slots) of stored tokens
    _first_rows: list[int] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.backend, str):
            self.backend = get_backend(self.backend)
        self.state = self.backend.new_state(self)

    @property
    def num_seqs(self) -> int:
        return len(self.starts)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @classmethod
    def build(
        cls,
        storage: PagedKVStorage,
        num_computed: Sequence[int],
        query_lens: Sequence[int],
        block_ids: Sequence[Sequence[Sequence[int]]],
        output_seqs: Sequence[int] | None = None,
        backend: Any = "reference",
        upload: Callable[[Sequence[int]], torch.Tensor] | None = None,
    ) -> "AttentionMetadata":
        """Metadata for ``S`` sequences; ``block_ids[s][g]`` is sequence ``s``'s group-``g`` table.

        output_seqs: sequence indices whose last token's output is wanted (the model then
        runs its last layer's attention queries and MLP for those rows only).
        upload: how ints reach the device (default :func:`~hybridkv.engine.host_tensors.long_tensor`).
        """
        device = storage.device
        bs = storage.block_size
        num_seqs = len(num_computed)
        if len(query_lens) != num_seqs or len(block_ids) != num_seqs:
            raise InvalidArgumentError("num_computed, query_lens and block_ids must have one entry per sequence")
        if num_seqs == 0:
            raise InvalidArgumentError("a step needs at least one sequence")
        if output_seqs is not None and any(not 0 <= s < num_seqs for s in output_seqs):
            raise InvalidArgumentError(f"output_seqs must index the {num_seqs} sequences, got {list(output_seqs)}")
        for s, (n, q, tables) in enumerate(zip(num_computed, query_lens, block_ids)):
            if n < 0 or q <= 0:
                raise InvalidArgumentError(f"sequence {s}: need num_computed >= 0 and >= 1 new token, got {n}, {q}")
            if len(tables) != storage.num_groups:
                raise InvalidArgumentError(
                    f"sequence {s}: {len(tables)} block tables for {storage.num_groups} KV cache groups"
                )
            need = -(-(n + q) // bs)
            for g, table in enumerate(tables):
                if len(table) < need:
                    raise InvalidArgumentError(
                        f"sequence {s} group {g}: {len(table)} blocks cannot hold {n + q} tokens of block size {bs}"
                    )

        starts, lens = [int(n) for n in num_computed], [int(q) for q in query_lens]
        ints = upload if upload is not None else (lambda values: long_tensor(values, device))
        start = ints(starts)  # [S]
        q_len = ints(lens)  # [S]
        if max(lens) == 1:  # a pure decode step: one token per sequence
            seq_ids = torch.arange(num_seqs, device=device)  # [T = S]
            positions = start
        else:
            total = sum(lens)  # given, so that no size is read back from the device
            seq_ids = torch.repeat_interleave(torch.arange(num_seqs, device=device), q_len, output_size=total)  # [T]
            cu = torch.cumsum(q_len, 0) - q_len  # [S] first flat token of each sequence
            offset = torch.arange(total, device=device) - cu[seq_ids]  # [T] index within the sequence
            positions = start[seq_ids] + offset  # [T]

        num_groups = storage.num_groups
        flat, width = padded_tables(block_ids)
        tables_sgw = ints(flat).view(num_seqs, num_groups, width)  # [S, G, W]
        blocks = tables_sgw.permute(1, 0, 2)[:, seq_ids, torch.div(positions, bs, rounding_mode="floor")]  # [G, T]
        slots = blocks * bs + positions % bs
        gaps = gap_groups(block_ids, starts, lens, bs) if max(lens) > 1 else frozenset()
        if gaps:  # tail_only: a null block among the step's own positions is not stored
            slots = torch.where(blocks == 0, -1, slots)
        return cls(
            storage=storage,
            positions=positions,
            start=start,
            q_len=q_len,
            seq_len=start + q_len,
            starts=starts,
            query_lens=lens,
            block_tables=[tables_sgw[:, g] for g in range(num_groups)],  # [S, W] views
            slot_mappings=list(slots.unbind(0)),  # [T] each
            output_seqs=None if output_seqs is None else [int(s) for s in output_seqs],
            gap_groups=gaps,
            backend=backend,
            block_ids=block_ids,
            upload=upload,
        )

    def stored(self, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [n], slots [n]): the step's tokens ``group`` stores and their slots (a gap
        group's; every token of any other group)."""
        got = self._stored.get(group)
        if got is None:
            slots = self.slot_mappings[group]
            rows = (slots >= 0).nonzero().squeeze(1)
            got = self._stored[group] = (rows, slots.index_select(0, rows))
        return got

    def ints(self, values: Sequence[int]) -> torch.Tensor:
        """int64 tensor [n] of ``values`` on the step's device, through ``upload`` when given
        (a CUDA runner's pinned stager: no host synchronisation)."""
        if self.upload is not None:
            return self.upload(values)
        return long_tensor(values, self.positions.device)

    def renew_state(self) -> None:
        """A new step over these same fields (a CUDA-graph step's static buffers, refilled): the
        backend's step state is made anew."""
        self.state = self.backend.new_state(self)

    def is_decode(self) -> bool:
        """Every sequence has one query token this step (a decode step)."""
        if self._decode is None:
            self._decode = max(self.query_lens) == 1
        return self._decode

    def output_rows(self) -> torch.Tensor | None:
        """[N] flat index of the last token of each of ``output_seqs``; None: all T rows, in order."""
        if self._output_rows is False:
            seqs = self.output_seqs
            if seqs is None or (len(seqs) == self.num_tokens and seqs == list(range(self.num_seqs))):
                self._output_rows = None
            else:
                ends = self.first_rows()[1:]
                self._output_rows = self.ints([ends[s] - 1 for s in seqs])
        return self._output_rows

    def first_rows(self) -> list[int]:
        """[S + 1]: the flat row of each sequence's first token this step, then ``T``
        (query_lens [3, 1, 2] -> [0, 3, 4, 6])."""
        if self._first_rows is None:
            self._first_rows = list(itertools.accumulate(self.query_lens, initial=0))
        return self._first_rows

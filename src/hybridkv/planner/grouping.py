"""Grouping layers into KV cache groups of one size, so that groups can share tensors.

All groups draw block ids from one pool. The pool is ``group_size`` shared tensors
("positions"); tensor j holds ``num_blocks`` pages of one layer, and layer j of every
group lives in tensor j, so a block id addresses page ``id`` of each tensor. For that
every group needs the same number of layer slots (``group_size``) and every layer the
same page size. A type with ``n`` layers fills ``cdiv(n, group_size)`` groups; the slots
it leaves empty are *padding*: when that group takes a block, the page of the block in
an empty slot's tensor is allocated but unused.

Layers of one type are dealt round-robin (group i of k gets ``layers[i::k]``, as vLLM
does), which spreads the padding and keeps pipeline stages balanced.

How the group size is chosen
----------------------------
The candidates run from the smallest type's layer count to the largest: below the
smallest count, groups multiply with nothing to gain on an n:1 pattern (so the
rarest type is always exactly one group). Among them we pick the size whose padding
costs the fewest bytes for one request of ``max_model_len`` tokens: a padded slot
costs ``spec.max_num_blocks(max_model_len)`` pages, so padding a full-attention group
is expensive at long context and padding a sliding group is nearly free. Ties go to
fewer groups, then the larger size. Minimising these bytes is the same as maximising
the concurrency the pool gives.

Worked example: Gemma 3 27B, 52 sliding (window 1024) + 10 full layers, block 16,
max_model_len 1_048_576. Page = 2 * 16 tokens * 16 heads * 128 * 2 bytes = 131072 B.
A sliding slot costs cdiv(min(1023 + 16, L), 16) = 65 pages, a full slot 65536 pages::

    size  sliding groups  full groups  padded slots        padding pages per request
    10    6 (60 slots)    1 (10)       8 sliding           8 * 65             =    520
    11    5 (55)          1 (11)       3 sliding + 1 full  3 * 65 + 65536     = 65_731
    13    4 (52)          1 (13)       3 full              3 * 65536          = 196_608
    26    2 (52)          1 (26)       16 full             16 * 65536         = 1_048_576

Size 10 wins: 7 groups, 8 padded slots, 520 * 131072 = 68_157_440 bytes (65 MiB) of
padding per request. (At max_model_len 1024 every slot costs 64 pages, and size 13,
with 3 padded slots, would win instead.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hybridkv.core.specs import KVCacheSpec, cdiv
from hybridkv.errors import InvalidArgumentError, InvalidConfigError

__all__ = ["LayerGroup", "Grouping", "GroupSizeOption", "group_size_options", "group_layers"]


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """One KV cache group: a spec, its real layers, and ``slots - len(layers)`` padding."""

    spec: KVCacheSpec
    layers: tuple[int, ...]
    slots: int

    @property
    def padding(self) -> int:
        return self.slots - len(self.layers)


@dataclass(frozen=True, slots=True)
class GroupSizeOption:
    """One candidate group size and what it costs (the padding is for one request)."""

    group_size: int
    num_groups: int
    padding_layers: int
    padding_pages_per_request: int


@dataclass(frozen=True, slots=True)
class Grouping:
    """Layers arranged in groups of ``group_size`` slots, all with one per-layer page size."""

    group_size: int
    page_size_bytes: int
    groups: tuple[LayerGroup, ...]

    @property
    def num_layers(self) -> int:
        return sum(len(g.layers) for g in self.groups)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def bytes_per_block(self) -> int:
        """One block id across every tensor: ``group_size * page_size_bytes``."""
        return self.group_size * self.page_size_bytes

    @property
    def padding_layers(self) -> int:
        return sum(g.padding for g in self.groups)

    def blocks_per_request(self, num_tokens: int) -> int:
        """Block ids one request of ``num_tokens`` holds at most: the sum over groups."""
        return sum(g.spec.max_num_blocks(num_tokens) for g in self.groups)

    def padding_bytes_per_request(self, num_tokens: int) -> int:
        """Bytes of padded slots among the blocks of one request of ``num_tokens``."""
        return self.page_size_bytes * sum(g.padding * g.spec.max_num_blocks(num_tokens) for g in self.groups)

    def position_layers(self, position: int) -> tuple[int | None, ...]:
        """For shared tensor ``position``: the layer of each group in it (None: padding)."""
        if not 0 <= position < self.group_size:
            raise InvalidArgumentError(f"position must be in [0, {self.group_size}), got {position!r}")
        return tuple(g.layers[position] if position < len(g.layers) else None for g in self.groups)


def _by_type(specs: Sequence[KVCacheSpec]) -> list[tuple[KVCacheSpec, list[int]]]:
    """(spec, layer indices) per distinct spec: full attention first, then by first layer."""
    if not specs:
        raise InvalidConfigError("a model needs at least one attention layer to plan a KV cache")
    types: dict[KVCacheSpec, list[int]] = {}
    for i, spec in enumerate(specs):
        if not isinstance(spec, KVCacheSpec):
            raise InvalidConfigError(f"layer {i}: expected a KVCacheSpec, got {spec!r}")
        types.setdefault(spec, []).append(i)
    block_sizes = {s.block_size for s in types}
    if len(block_sizes) != 1:
        raise InvalidConfigError(f"every layer needs one block size to share a pool, got {sorted(block_sizes)}")
    pages = {s.page_size_bytes for s in types}
    if len(pages) != 1:
        detail = ", ".join(f"{s.type_id} ({len(ix)} layers)" for s, ix in types.items())
        raise InvalidConfigError(
            "layers with different page sizes cannot share one pool (different head_dim, KV heads "
            f"or dtype per layer is not supported): {detail}"
        )
    return sorted(types.items(), key=lambda item: (item[0].kind != "full_attention", item[1][0]))


def group_size_options(specs: Sequence[KVCacheSpec], max_model_len: int) -> list[GroupSizeOption]:
    """Every candidate group size (smallest type's count .. largest's), smallest first."""
    types = _by_type(specs)
    counts = [len(ix) for _, ix in types]
    options = []
    for size in range(min(counts), max(counts) + 1):
        groups = pad_layers = pad_pages = 0
        for spec, layers in types:
            k = cdiv(len(layers), size)
            groups += k
            pad_layers += k * size - len(layers)
            pad_pages += (k * size - len(layers)) * spec.max_num_blocks(max_model_len)
        options.append(GroupSizeOption(size, groups, pad_layers, pad_pages))
    return options


def group_layers(specs: Sequence[KVCacheSpec], max_model_len: int, *, group_size: int | None = None) -> Grouping:
    """Group the layers (``specs[i]`` is layer i) for requests of up to ``max_model_len`` tokens.

    ``group_size`` forces a size (any positive int: a type of n layers then fills
    ``cdiv(n, group_size)`` groups); by default the cheapest candidate is chosen as the
    module docstring explains.

    >>> from hybridkv.core.specs import FullAttentionSpec, ChunkedLocalAttentionSpec
    >>> full = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128)
    >>> local = ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, attention_chunk_size=8192)
    >>> g = group_layers([local, local, local, full] * 12, 1_048_576)
    >>> g.group_size, g.num_groups, g.padding_layers, g.groups[1].layers[:3]
    (12, 4, 0, (0, 4, 8))
    """
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len <= 0:
        raise InvalidArgumentError(f"max_model_len must be a positive int, got {max_model_len!r}")
    types = _by_type(specs)
    if group_size is None:
        best = min(
            group_size_options(specs, max_model_len),
            key=lambda o: (o.padding_pages_per_request, o.num_groups, -o.group_size),
        )
        group_size = best.group_size
    elif isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise InvalidArgumentError(f"group_size must be a positive int, got {group_size!r}")
    groups = []
    for spec, layers in types:
        k = cdiv(len(layers), group_size)
        groups.extend(LayerGroup(spec, tuple(layers[i::k]), group_size) for i in range(k))
    return Grouping(group_size, types[0][0].page_size_bytes, tuple(groups))

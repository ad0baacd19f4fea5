"""Grouping layers into KV cache groups of one size, so that groups can share tensors.

All groups draw block ids from one pool. The pool is ``group_size`` shared tensors
("positions"); tensor j holds ``num_blocks`` pages of one layer, and layer j of every
group lives in tensor j, so a block id addresses page ``id`` of each tensor. For that
every group needs the same number of layer slots (``group_size``) and every layer the
same page size. A type with ``n`` layers fills ``cdiv(n, group_size)`` groups; the slots
it leaves empty are *padding*: when that group takes a block, the page of the block in
an empty slot's tensor is allocated but unused. Layers of one type are dealt round-robin
(group i of k gets ``layers[i::k]``, as vLLM does), which spreads the padding.

The group size runs from the smallest type's layer count (so the rarest type is always
exactly one group) to the largest; the size whose padding costs the fewest pages for
one request of ``max_model_len`` tokens wins. A padded slot costs
``spec.max_num_blocks(max_model_len, max_num_batched_tokens)`` pages, so padding a
full-attention group is expensive at long context and padding a sliding group nearly
free. On a tie the smaller size wins, as the null block costs ``group_size`` pages
(3 full + 7 sliding layers, window 1024, max_model_len 512, block 16: sizes 3 and 4
both pad 2 slots of 32 pages; 3002 pages hold (1000 - 1) / 128 = 7.805 requests at
size 3, (750 - 1) / 96 = 7.802 at size 4). With a known budget (``memory_bytes``) the
choice is made on the exact capacity (whole blocks, the null block taken out), ties
broken the same way.

Worked example: Gemma 3 27B, 52 sliding (window 1024) + 10 full layers, block 16,
max_model_len 1_048_576, budget 2048. Page = 2 * 16 tokens * 16 heads * 128 * 2 bytes
= 131072 B. A sliding slot costs (1023 + 2048 - 1) // 16 + 2 = 193 pages, a full slot
65536 pages::

    size  sliding groups  full groups  padded slots        padding pages per request
    10    6 (60 slots)    1 (10)       8 sliding           8 * 193            =  1_544
    11    5 (55)          1 (11)       3 sliding + 1 full  3 * 193 + 65536    = 66_115
    13    4 (52)          1 (13)       3 full              3 * 65536          = 196_608
    26    2 (52)          1 (26)       16 full             16 * 65536         = 1_048_576

Size 10 wins: 7 groups, 8 padded slots, 1544 * 131072 bytes (193 MiB) of padding per
request. (At max_model_len 1024 every slot costs 64 pages, and size 13, with 3 padded
slots, would win instead.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

from hybridkv.core.config import DEFAULT_MAX_NUM_BATCHED_TOKENS
from hybridkv.core.specs import CacheSpec, cdiv
from hybridkv.core.state_spec import StateSpec
from hybridkv.errors import InvalidArgumentError, InvalidConfigError

__all__ = ["LayerGroup", "Grouping", "GroupSizeOption", "RequestBytes", "group_size_options", "group_layers"]


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """One KV cache group: a spec (attention KV or a state), its real layers, and
    ``slots - len(layers)`` padding."""

    spec: CacheSpec
    layers: tuple[int, ...]
    slots: int

    @property
    def padding(self) -> int:
        return self.slots - len(self.layers)

    @property
    def is_state(self) -> bool:
        """Whether the group holds recurrent states (else attention KV)."""
        return isinstance(self.spec, StateSpec)

    def bytes_per_request(self, num_tokens: int, max_num_batched_tokens: int | None = None) -> int:
        """Bytes one request of ``num_tokens`` holds at most in the group's real layers
        (its padded slots not counted; a state's page padding is)."""
        return len(self.layers) * self.spec.max_memory_usage_bytes(num_tokens, max_num_batched_tokens)


class RequestBytes(NamedTuple):
    """What one request holds at most: attention KV, recurrent state (pages, padded), and
    the pages of padded slots, in bytes."""

    kv: int
    state: int
    padding: int


@dataclass(frozen=True, slots=True)
class GroupSizeOption:
    """One candidate group size and what it costs (the padding is for one request)."""

    group_size: int
    num_groups: int
    padding_layers: int
    padding_pages_per_request: int


@dataclass(frozen=True, slots=True)
class Grouping:
    """Layers arranged in groups of ``group_size`` slots, all with one per-layer page size.

    ``max_num_batched_tokens`` is the scheduler budget the per-request figures assume
    (None: a whole request may be computed in one step)."""

    group_size: int
    page_size_bytes: int
    groups: tuple[LayerGroup, ...]
    max_num_batched_tokens: int | None = None

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
        return sum(g.spec.max_num_blocks(num_tokens, self.max_num_batched_tokens) for g in self.groups)

    def padding_bytes_per_request(self, num_tokens: int) -> int:
        """Bytes of padded slots among the blocks of one request of ``num_tokens``."""
        budget = self.max_num_batched_tokens
        return self.page_size_bytes * sum(g.padding * g.spec.max_num_blocks(num_tokens, budget) for g in self.groups)

    def request_bytes(self, num_tokens: int) -> RequestBytes:
        """KV, state and slot-padding bytes of one request of ``num_tokens``."""
        budget = self.max_num_batched_tokens
        kv = sum(g.bytes_per_request(num_tokens, budget) for g in self.groups if not g.is_state)
        state = sum(g.bytes_per_request(num_tokens, budget) for g in self.groups if g.is_state)
        return RequestBytes(kv, state, self.padding_bytes_per_request(num_tokens))

    def max_concurrency(self, memory_bytes: int, num_tokens: int) -> float:
        """Requests of ``num_tokens`` that ``memory_bytes`` holds at once (the null block taken out)."""
        usable = max(memory_bytes // self.bytes_per_block - 1, 0)
        return usable / max(self.blocks_per_request(num_tokens), 1)

    def position_layers(self, position: int) -> tuple[int | None, ...]:
        """For shared tensor ``position``: the layer of each group in it (None: padding)."""
        if not 0 <= position < self.group_size:
            raise InvalidArgumentError(f"position must be in [0, {self.group_size}), got {position!r}")
        return tuple(g.layers[position] if position < len(g.layers) else None for g in self.groups)


def _by_type(
    specs: Sequence[CacheSpec], layer_ids: Sequence[int] | None = None
) -> list[tuple[CacheSpec, list[int]]]:
    """(spec, layer indices) per distinct spec: full attention first, then by first layer.
    ``layer_ids[k]`` is the layer of ``specs[k]`` (None: k)."""
    if not specs:
        raise InvalidConfigError("a model needs at least one layer with a KV cache or a state to plan a cache")
    if layer_ids is None:
        layer_ids = range(len(specs))
    elif len(layer_ids) != len(specs):
        raise InvalidArgumentError(f"layer_ids has {len(layer_ids)} entries for {len(specs)} specs")
    types: dict[CacheSpec, list[int]] = {}
    for i, spec in zip(layer_ids, specs):
        if not isinstance(spec, CacheSpec):
            raise InvalidConfigError(f"layer {i}: expected a CacheSpec, got {spec!r}")
        types.setdefault(spec, []).append(i)
    block_sizes = {s.block_size for s in types}
    if len(block_sizes) != 1:
        raise InvalidConfigError(f"every layer needs one block size to share a pool, got {sorted(block_sizes)}")
    pages = {s.page_size_bytes for s in types}
    if len(pages) != 1:
        detail = ", ".join(f"{s.type_id} ({len(ix)} layers)" for s, ix in types.items())
        raise InvalidConfigError(
            "layers with different page sizes cannot share one pool (different head_dim, KV heads "
            f"or dtype per layer is not supported; states must be padded to one page first): {detail}"
        )
    return sorted(types.items(), key=lambda item: (item[0].kind != "full_attention", item[1][0]))


def group_size_options(
    specs: Sequence[CacheSpec],
    max_model_len: int,
    max_num_batched_tokens: int | None = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    layer_ids: Sequence[int] | None = None,
) -> list[GroupSizeOption]:
    """Every candidate group size (smallest type's count .. largest's), smallest first."""
    types = _by_type(specs, layer_ids)
    counts = [len(ix) for _, ix in types]
    options = []
    for size in range(min(counts), max(counts) + 1):
        groups = pad_layers = pad_pages = 0
        for spec, layers in types:
            k = cdiv(len(layers), size)
            groups += k
            pad_layers += k * size - len(layers)
            pad_pages += (k * size - len(layers)) * spec.max_num_blocks(max_model_len, max_num_batched_tokens)
        options.append(GroupSizeOption(size, groups, pad_layers, pad_pages))
    return options


def _arrange(types: list[tuple[CacheSpec, list[int]]], group_size: int, budget: int | None) -> Grouping:
    groups = []
    for spec, layers in types:
        k = cdiv(len(layers), group_size)
        groups.extend(LayerGroup(spec, tuple(layers[i::k]), group_size) for i in range(k))
    return Grouping(group_size, types[0][0].page_size_bytes, tuple(groups), budget)


def group_layers(
    specs: Sequence[CacheSpec],
    max_model_len: int,
    *,
    group_size: int | None = None,
    max_num_batched_tokens: int | None = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    memory_bytes: int | None = None,
    layer_ids: Sequence[int] | None = None,
) -> Grouping:
    """Group the layers (``specs[i]`` is layer i, or layer ``layer_ids[i]``) for requests of
    up to ``max_model_len`` tokens. State layers group like attention layers: their own
    type (equal specs only), two pages per slot and request.

    ``group_size`` forces a size (any positive int: a type of n layers then fills
    ``cdiv(n, group_size)`` groups); by default the candidate that holds the most
    requests is chosen as the module docstring explains. ``max_num_batched_tokens`` is
    the scheduler budget of the per-request bound (None: whole requests in one step);
    ``memory_bytes``, when known, makes
    the choice on exact capacity.

    >>> from hybridkv.core.specs import FullAttentionSpec, ChunkedLocalAttentionSpec
    >>> full = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128)
    >>> local = ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, attention_chunk_size=8192)
    >>> g = group_layers([local, local, local, full] * 12, 1_048_576, max_num_batched_tokens=2048)
    >>> g.group_size, g.num_groups, g.padding_layers, g.groups[1].layers[:3], g.blocks_per_request(1_048_576)
    (12, 4, 0, (0, 4, 8), 67456)
    """
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len <= 0:
        raise InvalidArgumentError(f"max_model_len must be a positive int, got {max_model_len!r}")
    for name, value in (("max_num_batched_tokens", max_num_batched_tokens), ("memory_bytes", memory_bytes)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
    types = _by_type(specs, layer_ids)
    budget = max_num_batched_tokens
    if group_size is None:
        options = group_size_options(specs, max_model_len, budget, layer_ids)
        if memory_bytes is None:
            best = min(options, key=lambda o: (o.padding_pages_per_request, o.group_size))
            return _arrange(types, best.group_size, budget)
        scored = [(_arrange(types, o.group_size, budget), o) for o in options]
        grouping, _ = max(
            scored,
            key=lambda g_o: (
                g_o[0].max_concurrency(memory_bytes, max_model_len),
                -g_o[1].padding_pages_per_request,
                -g_o[1].group_size,
            ),
        )
        return grouping
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise InvalidArgumentError(f"group_size must be a positive int, got {group_size!r}")
    return _arrange(types, group_size, budget)

"""Budget arithmetic: blocks for a byte budget, concurrency, largest context; hybrid vs full.

A layout (a :class:`~hybridkv.planner.grouping.Grouping`) spends
``group_size * page_size_bytes`` per block id, so ``num_blocks = budget // that``.
Block 0 is the null block (it never holds KV), so ``usable = num_blocks - 1`` is what
every capacity figure here divides: concurrency, requests, largest context. (vLLM's
"Maximum concurrency" divides ``num_blocks``; the difference is one block.)

A request of L tokens holds ``sum over groups of spec.max_num_blocks(L, budget)`` block
ids, ``budget`` being the scheduler's ``max_num_batched_tokens`` (a prefill chunk of that
many tokens is allocated before what it pushes out of a window or chunk is freed).
The *full* layout is the fallback with hybrid management off: every layer is full
attention, one group of all layers.

Worked example: Llama-4-Scout, 80 GiB, 1M = 1_048_576 tokens, block 16, budget 2048,
page 65536 B (2 * 16 tokens * 8 KV heads * 128 * 2 bytes)::

    hybrid: 4 groups of 12 (12 full, 3 x 12 chunked), bytes/block = 12 * 65536 = 786_432
            num_blocks = 85_899_345_920 // 786_432 = 109_226 (usable 109_225)
            per request = 65_536 (full: 1_048_576 / 16)
                          + 3 * 640 (chunked: cdiv(8191 + 2048, 16), chunk starts aligned)
                        = 67_456 -> concurrency 109_225 / 67_456 = 1.619x
            largest context: 3 * 640 + cdiv(L, 16) <= 109_225 -> L = 107_305 * 16 = 1_716_880
    full:   1 group of 48, bytes/block = 48 * 65536 = 3_145_728
            num_blocks = 85_899_345_920 // 3_145_728 = 27_306 (usable 27_305)
            per request = 65_536 -> concurrency 27_305 / 65_536 = 0.417x; largest 436_880
    hybrid / full concurrency = 1.619 / 0.417 = 3.89 (36 of 48 layers hold ~10K tokens only)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hybridkv.core.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, KVCacheConfig, KVCacheGroup
from hybridkv.core.specs import FullAttentionSpec, KVCacheSpec
from hybridkv.core.usage import usable_blocks
from hybridkv.errors import InvalidArgumentError, PoolTooSmallError
from hybridkv.planner.architectures import ModelLayers, cache_name, model_layers
from hybridkv.planner.grouping import Grouping, group_layers
from hybridkv.planner.presets import load_model_config
from hybridkv.planner.sizes import format_bytes, parse_bytes, parse_tokens

__all__ = [
    "SharedTensor",
    "LayoutPlan",
    "MemoryPlan",
    "max_context_tokens",
    "layout_plan",
    "full_attention_grouping",
    "plan_memory",
    "plan_model",
]


@dataclass(frozen=True, slots=True)
class SharedTensor:
    """Tensor ``position``: ``num_blocks`` pages; ``layer_names[g]`` is group g's layer in it."""

    position: int
    layer_names: tuple[str | None, ...]
    size_bytes: int


def max_context_tokens(grouping: Grouping, usable_blocks: int) -> int | None:
    """Largest L with ``grouping.blocks_per_request(L) <= usable_blocks``; None if unbounded.

    Binary search over [0, usable_blocks * block_size]: a group never needs more than
    cdiv(L, block_size) blocks, so past that bound either some group has outgrown the
    pool or every group has stopped growing (only windowed layers): then any length fits.
    """
    block_size = grouping.groups[0].spec.block_size
    hi = usable_blocks * block_size
    if grouping.blocks_per_request(hi + 1) <= usable_blocks:
        return None
    lo = 0  # blocks_per_request(0) == 0 always fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if grouping.blocks_per_request(mid) <= usable_blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True, slots=True)
class LayoutPlan:
    """One layout under one budget: ``name`` is "hybrid" or "full"."""

    name: str
    grouping: Grouping
    memory_bytes: int
    max_model_len: int
    num_blocks: int
    blocks_per_request: int
    padding_bytes_per_request: int
    max_context_tokens: int | None

    @property
    def usable_blocks(self) -> int:
        """``num_blocks`` less the null block."""
        return usable_blocks(self.num_blocks)

    @property
    def bytes_per_block(self) -> int:
        return self.grouping.bytes_per_block

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes the tensors take: ``num_blocks * bytes_per_block`` (at most the budget)."""
        return self.num_blocks * self.bytes_per_block

    @property
    def max_concurrency(self) -> float:
        """Requests of ``max_model_len`` tokens the pool holds at once, fractional."""
        return self.grouping.max_concurrency(self.memory_bytes, self.max_model_len)

    @property
    def max_num_requests(self) -> int:
        """Whole requests of ``max_model_len`` tokens the pool holds at once."""
        return self.usable_blocks // self.blocks_per_request

    @property
    def tensors(self) -> tuple[SharedTensor, ...]:
        size = self.num_blocks * self.grouping.page_size_bytes
        specs = [g.spec for g in self.grouping.groups]
        return tuple(
            SharedTensor(
                j,
                tuple(None if i is None else cache_name(i, spec)
                      for i, spec in zip(self.grouping.position_layers(j), specs)),
                size,
            )
            for j in range(self.grouping.group_size)
        )

    @property
    def kv_cache_config(self) -> KVCacheConfig:
        """The config a core KV cache manager is built from."""
        groups = tuple(
            KVCacheGroup(g.spec, tuple(cache_name(i, g.spec) for i in g.layers)) for g in self.grouping.groups)
        return KVCacheConfig(num_blocks=self.num_blocks, groups=groups)


def layout_plan(name: str, grouping: Grouping, memory_bytes: int, max_model_len: int) -> LayoutPlan:
    """Blocks, per-request blocks and the largest context of ``grouping`` under ``memory_bytes``."""
    num_blocks = memory_bytes // grouping.bytes_per_block
    return LayoutPlan(
        name=name,
        grouping=grouping,
        memory_bytes=memory_bytes,
        max_model_len=max_model_len,
        num_blocks=num_blocks,
        blocks_per_request=grouping.blocks_per_request(max_model_len),
        padding_bytes_per_request=grouping.padding_bytes_per_request(max_model_len),
        max_context_tokens=max_context_tokens(grouping, usable_blocks(num_blocks)),
    )


def full_attention_grouping(
    model: ModelLayers,
    max_model_len: int,
    max_num_batched_tokens: int | None = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    *,
    memory_bytes: int | None = None,
) -> Grouping:
    """Hybrid off: every attention layer as full attention (one group of all the layers,
    when they are all attention). State layers stay states, in their own groups: a
    recurrent layer has no KV to keep in full."""
    specs = [
        FullAttentionSpec(block_size=s.block_size, num_kv_heads=s.num_kv_heads, head_size=s.head_size, dtype=s.dtype)
        if isinstance(s, KVCacheSpec) else s
        for s in model.specs
    ]
    return group_layers(specs, max_model_len, max_num_batched_tokens=max_num_batched_tokens,
                        memory_bytes=memory_bytes if model.state_specs else None, layer_ids=model.cache_layers)


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """A model's hybrid and full layouts under one budget; ``layout`` is the one in use."""

    model: ModelLayers
    memory_bytes: int
    max_model_len: int
    hybrid: LayoutPlan
    full: LayoutPlan
    hybrid_enabled: bool = True

    @property
    def layout(self) -> LayoutPlan:
        return self.hybrid if self.hybrid_enabled else self.full

    @property
    def kv_cache_config(self) -> KVCacheConfig:
        return self.layout.kv_cache_config

    @property
    def tensors(self) -> tuple[SharedTensor, ...]:
        return self.layout.tensors

    @property
    def concurrency_ratio(self) -> float | None:
        """Hybrid concurrency over full concurrency at ``max_model_len``; None if full holds nothing."""
        if self.full.max_concurrency == 0:
            return None
        return self.hybrid.max_concurrency / self.full.max_concurrency

    @property
    def context_ratio(self) -> float | None:
        """Largest hybrid context over largest full context; None if either is unbounded or 0."""
        h, f = self.hybrid.max_context_tokens, self.full.max_context_tokens
        if h is None or not f:
            return None
        return h / f


def plan_memory(
    model: ModelLayers,
    memory_bytes: int,
    max_model_len: int,
    *,
    hybrid: bool = True,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
) -> MemoryPlan:
    """Plan ``model`` into ``memory_bytes`` for requests of up to ``max_model_len`` tokens,
    computed at most ``max_num_batched_tokens`` a step.

    Raises :class:`PoolTooSmallError` when the layout in use gets fewer than 2 blocks
    (the null block and one usable); the other layout may hold nothing.
    """
    for what, value in (
        ("memory budget", memory_bytes),
        ("max_model_len", max_model_len),
        ("max_num_batched_tokens", max_num_batched_tokens),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise InvalidArgumentError(f"{what} must be a positive int, got {value!r}")
    budget = max_num_batched_tokens
    grouping = group_layers(model.specs, max_model_len, max_num_batched_tokens=budget, memory_bytes=memory_bytes,
                            layer_ids=model.cache_layers)
    hybrid_plan = layout_plan("hybrid", grouping, memory_bytes, max_model_len)
    full = full_attention_grouping(model, max_model_len, budget, memory_bytes=memory_bytes)
    full_plan = layout_plan("full", full, memory_bytes, max_model_len)
    result = MemoryPlan(model, memory_bytes, max_model_len, hybrid_plan, full_plan, hybrid)
    used = result.layout
    if used.num_blocks < 2:
        raise PoolTooSmallError(
            f"{format_bytes(memory_bytes)} holds {used.num_blocks} block(s) of {format_bytes(used.bytes_per_block)} "
            f"in the {used.name} layout of {model.name}; at least 2 are needed (the null block and one usable)"
        )
    return result


def plan_model(
    source: str | Path,
    *,
    memory: int | str = "80GiB",
    max_model_len: int | str | None = None,
    block_size: int = 16,
    dtype: str | None = None,
    hybrid: bool = True,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    tail_only: bool = False,
) -> MemoryPlan:
    """Plan a preset name or ``config.json`` path; sizes may be strings ("80GiB", "1M").

    ``max_model_len`` None uses the config's ``max_position_embeddings``; ``tail_only``: windowed
    layers store only what later tokens read (:func:`~hybridkv.planner.architectures.model_layers`).

    >>> plan = plan_model("llama4-scout", memory="80GiB", max_model_len="1M")
    >>> plan.hybrid.num_blocks, plan.full.num_blocks, plan.hybrid.blocks_per_request, round(plan.concurrency_ratio, 2)
    (109226, 27306, 67456, 3.89)
    """
    memory_bytes = parse_bytes(memory)
    tokens = None if max_model_len is None else parse_tokens(max_model_len)
    loaded = load_model_config(source)
    name = loaded.preset.hf_repo if loaded.preset is not None else loaded.label
    model = model_layers(loaded.config, label=loaded.label, name=name, block_size=block_size, dtype=dtype,
                         tail_only=tail_only)
    if tokens is None:
        if model.max_position_embeddings is None:
            raise InvalidArgumentError(f"{loaded.label}: max_position_embeddings is null; give a max model length")
        tokens = model.max_position_embeddings
    return plan_memory(model, memory_bytes, tokens, hybrid=hybrid, max_num_batched_tokens=max_num_batched_tokens)

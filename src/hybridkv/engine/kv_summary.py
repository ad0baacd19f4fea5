"""What the engine's KV cache did: blocks in use per group, prefix hits, preemptions.

The engine asks the core's accounting (:meth:`KVCacheManager.pool_usage`,
:mod:`hybridkv.core.usage`) once per step, after the scheduler has allocated the step's
slots (the moment the step computes with, so its high-water mark): the distinct non-null
blocks each group holds and their peaks. :class:`KVSummary` is the engine's
answer to ``kv_summary()``: that usage, the prefix-hit tokens and preemptions since
the engine started, and the KV bytes one request needs in this layout next to the
all-full-attention layout, both asked of the planner's
:class:`~hybridkv.planner.grouping.Grouping` (``blocks_per_request * bytes_per_block``).

Worked example (Gemma 3 270M: 18 layers, 15 sliding 512 + 3 full, 1 KV head of 256,
fp32, block 16, budget 2048, 32,768 tokens): a page is 2 * 16 * 1 * 256 * 4 = 32 KiB;
hybrid groups of 3 (1 full, 5 sliding) take 3 pages per block id, a request holds
2048 + 5 * ((511 + 2048 - 1) // 16 + 2 = 161) = 2853 ids = 267.5 MiB; all-full is one
group of 18 (18 pages per id), 2048 ids = 1152 MiB: 4.3x.

State groups (linear-attention layers) count like the others: a request holds at most two
block ids of each (the state it continues from and the one its step writes), whatever its
length, at ``bytes_per_block`` each; ``state_bytes_per_request`` is that part of the
request's bytes. The all-full layout keeps state layers as states, so a model of full
and linear layers only (Qwen3-Next) is the same in both: 1.00x. The tests' tiny Qwen3-Next
(1 full + 3 linear layers, block 16, 4 KiB a block id, fp32) at 256 tokens: 16 + 3 * 2 = 22
ids = 88 KiB, of which 24 KiB states.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from hybridkv.core.specs import CacheSpec
from hybridkv.core.state_spec import StateSpec
from hybridkv.core.usage import PoolUsage
from hybridkv.planner.grouping import Grouping

__all__ = ["GroupUsage", "KVSummary", "UsageTracker", "kv_bytes_per_request", "state_bytes_per_request"]


@dataclass(frozen=True, slots=True)
class GroupUsage:
    """One KV cache group: its attention type, layers and blocks in use (now / at peak)."""

    group: int
    kind: str  # the spec's kind: full_attention, sliding_window, chunked_local_attention, mamba (a state)
    size: int | None  # window / chunk in tokens; None for full attention
    num_layers: int
    blocks_in_use: int
    peak_blocks: int

    @property
    def label(self) -> str:
        """``full``, ``sliding(512)``, ``chunked(8192)``, ``state``."""
        short = "state" if self.kind == StateSpec.kind else self.kind.split("_")[0]
        return short if self.size is None else f"{short}({self.size})"


@dataclass(frozen=True, slots=True)
class KVSummary:
    """The engine's KV cache figures (see the module docstring)."""

    hybrid: bool
    groups: tuple[GroupUsage, ...]
    bytes_per_block: int
    peak_blocks: int  # all groups together, at the step that held the most
    prefix_hit_tokens: int
    num_preemptions: int
    num_tokens: int  # the request length the per-request bytes are for
    kv_bytes_per_request: int  # this layout (hybrid, or all-full with hybrid off)
    full_kv_bytes_per_request: int  # every layer as full attention
    state_bytes_per_request: int = 0  # of kv_bytes_per_request, the state groups' blocks
    full_state_bytes_per_request: int = 0  # of full_kv_bytes_per_request, the state groups' blocks

    @property
    def peak_bytes(self) -> int:
        return self.peak_blocks * self.bytes_per_block

    @property
    def full_over_layout(self) -> float:
        """All-full bytes per request over this layout's (1.0 with hybrid off)."""
        return self.full_kv_bytes_per_request / max(self.kv_bytes_per_request, 1)


def kv_bytes_per_request(grouping: Grouping, num_tokens: int) -> int:
    """Bytes one request of ``num_tokens`` holds at most in ``grouping``: its block ids
    (the specs' bound at the grouping's budget) times the bytes of one block id."""
    return grouping.blocks_per_request(num_tokens) * grouping.bytes_per_block


def state_bytes_per_request(grouping: Grouping, num_tokens: int) -> int:
    """Of :func:`kv_bytes_per_request`, the bytes of the state groups' block ids."""
    budget = grouping.max_num_batched_tokens
    return sum(g.spec.max_num_blocks(num_tokens, budget) for g in grouping.groups if g.is_state) * \
        grouping.bytes_per_block


class UsageTracker:
    """The engine's per-group labels and prefix-hit count beside the core's block accounting."""

    def __init__(self, specs: Iterable[CacheSpec], layers_per_group: Iterable[int]) -> None:
        self.specs = tuple(specs)
        self.num_layers = tuple(layers_per_group)
        self.prefix_hit_tokens = 0

    def groups(self, usage: PoolUsage) -> tuple[GroupUsage, ...]:
        """Per group: its spec, layers, blocks held now and peak (``usage``: the core's)."""
        return tuple(
            GroupUsage(g, spec.kind, spec.attention_span, layers, now, peak)
            for g, (spec, layers, now, peak) in enumerate(
                zip(self.specs, self.num_layers, usage.used_per_group, usage.peak_per_group))
        )

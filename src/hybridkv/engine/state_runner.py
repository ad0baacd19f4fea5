"""The runner's state part: recurrent states kept per pool block, read and written as the tables say.

A state group's table (:mod:`hybridkv.core.managers.state`) holds at block position
``p`` the state after ``(p + 1) * B`` tokens. A step of a request from ``n`` to ``m``
computed tokens continues from the block at position ``cdiv(n, B) - 1`` (the zero state
when ``n == 0``) and leaves its state in the block at ``cdiv(m, B) - 1``: one
:class:`~hybridkv.engine.state.StateMetadata` per state group, its slots the block ids
(the read block may be the write block: a decode inside one block position updates it
in place). The scheduler cuts prefill chunks on block boundaries
(``KVCacheManager.align_num_new_tokens``), so the state a checkpoint needs is the one at
the end of a step: one write per request and step. vLLM's worker copies the previous
block into the step's block, then runs there; reading one slot and writing another is
the same (``notes_vllm_mamba.md``, sections 2 and 4).

Worked example (block 16, 0 the null block): a request 32 tokens in, table ``[0, 7]``;
a step of 8 tokens gets table ``[0, 7, 9]``, reads block ``table[cdiv(32, 16) - 1] = 7``
(the state after 32 tokens) and writes ``table[cdiv(40, 16) - 1] = 9``. Its decode from
40 to 41 reads and writes block 9 (in place); the one from 47 to 48 too, and then block 9
holds the checkpoint after 48 tokens.

Storage: the states are *not* in the KV pages. Each state group's layer at position
``j`` shares pool ``j`` with the other state groups' (:meth:`StateStorage.shared`, as
the KV tensors are shared), and a pool has one slot per block id of the pool
(``num_slots = num_blocks``), so a block id addresses its state directly. Keeping a
state inside a block's KV page would need a block-major KV layout (a page is one
contiguous range there; ours is head-major); until then the engine allocates the
pools beside the KV tensors while the pool's accounting stays in uniform pages
(:mod:`hybridkv.engine.kv_layout` counts both allocations).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from hybridkv.engine.state import StateMetadata, StateShape, StateStorage, StepStates
from hybridkv.errors import InvalidArgumentError, InvalidConfigError, InvariantViolation
from hybridkv.scheduler.interface import ScheduledRequest

__all__ = ["StateRunner", "state_slots"]


def state_slots(table: Sequence[int], num_computed: int, num_new: int, block_size: int) -> tuple[int, int]:
    """(read block, write block) of a step from ``num_computed`` over ``num_new`` tokens:
    ``table[cdiv(n, B) - 1]`` (-1, the zero state, when ``n == 0``) and ``table[cdiv(n + q, B) - 1]``.

    >>> state_slots([0, 7, 9], 20, 14, 16), state_slots([5], 0, 10, 16), state_slots([0, 7], 20, 1, 16)
    ((7, 9), (-1, 5), (7, 7))
    """
    end = num_computed + num_new
    last = (end - 1) // block_size
    if last >= len(table):
        raise InvalidArgumentError(
            f"a state table of {len(table)} blocks cannot hold {end} tokens of block size {block_size}")
    read = table[(num_computed - 1) // block_size] if num_computed > 0 else -1
    write = table[last]
    if read == 0 or write == 0:
        raise InvariantViolation(
            f"state table {list(table)} has the null block where a step from {num_computed} to {end} "
            f"tokens reads or writes (block size {block_size})"
        )
    return read, write


class StateRunner:
    """The states of a model's linear-attention layers in the engine's state groups.

    ``groups`` maps a state group's id (its index among the KV cache manager's groups) to
    its layers; ``num_groups`` is the number of all groups, the others attention groups.

        states = StateRunner({1: [0, 4], 2: [1, 5], 3: [2, 6]}, 4, block_size=16, num_blocks=256,
                             shape=model.state_shape())
        model(input_ids, positions, attn_meta, states.step(scheduled))
    """

    def __init__(
        self,
        groups: Mapping[int, Sequence[int]],
        num_groups: int,
        block_size: int,
        num_blocks: int,
        shape: StateShape,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        if not groups or any(not 0 <= g < num_groups for g in groups):
            raise InvalidConfigError(f"state group ids {sorted(groups)} must be among the {num_groups} groups")
        self.group_ids: tuple[int, ...] = tuple(sorted(groups))
        self.attention_groups: tuple[int, ...] = tuple(g for g in range(num_groups) if g not in groups)
        self.block_size = block_size
        layers = [list(groups[g]) for g in self.group_ids]
        #: the recurrent state is float32 whatever the model's dtype (GatedDeltaNet's rule)
        self.storage = StateStorage.shared(layers, num_blocks, shape, dtype=dtype, ssm_dtype=torch.float32,
                                           device=device)
        self.layer_group: dict[int, int] = {i: k for k, ls in enumerate(layers) for i in ls}

    @property
    def layers(self) -> list[int]:
        return sorted(self.layer_group)

    def step(self, reqs: Sequence[ScheduledRequest]) -> StateMetadata | StepStates:
        """The step's metadata: one StateMetadata per state group (one alone when there is one)."""
        bs = self.block_size
        lens = [len(r.token_ids) for r in reqs]
        memo: dict = {}
        metas = []
        for g in self.group_ids:
            reads, writes = [], []
            for r, q in zip(reqs, lens):
                read, write = state_slots(r.block_ids[g], r.num_computed_tokens, q, bs)
                reads.append(read)
                writes.append(((q, write),))
            metas.append(StateMetadata.build(self.storage, lens, reads, writes, memo=memo))
        if len(metas) == 1:
            return metas[0]
        return StepStates(tuple(metas), self.layer_group)

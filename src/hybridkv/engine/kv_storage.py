"""Paged KV storage: the tensors that hold every layer's keys and values.

Layout (as the planner produces it): ``G`` KV cache groups, group ``g`` a list of
layer indices. All groups draw block ids from one pool, so a block id is owned by
at most one group at a time, and the layers at the same *position* ``j`` of
different groups can share one tensor: tensor ``j`` holds layer ``groups[g][j]``'s
KV for the blocks group ``g`` owns. ``P = max(len(group))`` tensors in all::

    groups = [[3, 7], [0, 4], [1, 5], [2, 6]]      # Llama-4 shaped, 8 layers
    tensor 0: layers 3, 0, 1, 2     tensor 1: layers 7, 4, 5, 6

Each tensor is ``[2, num_kv_heads, num_blocks, block_size, head_size]`` (K then V,
head-major): the keys of one head are one ``[num_slots, head_size]`` matrix, so one
``index_select`` over slots gathers K and V of every head already in the
``[head, sequence, key, dim]`` order the attention batches over (no transpose copy).
A *slot* is ``block_id * block_size + offset``. Block 0 is the null block: it is
never written (a write to a slot below ``block_size`` is refused) and the attention
never gathers it (checked in :mod:`hybridkv.engine.attention.reference`).
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

from hybridkv.core.blocks import NULL_BLOCK_ID  # the shared null block (one home: the core)
from hybridkv.core.specs import DTYPE_ALIASES, canonical_dtype
from hybridkv.errors import InvalidArgumentError, InvalidConfigError, InvariantViolation
from hybridkv.planner.sizes import format_bytes

__all__ = ["PagedKVStorage", "NULL_BLOCK_ID", "torch_dtype", "layer_index", "available_memory", "check_allocation"]


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` (or an alias of the core's, ``"bf16"``) -> ``torch.bfloat16``; a torch dtype passes through."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[canonical_dtype(dtype)]
    except (KeyError, TypeError):
        names = sorted([*_DTYPES, *(a for a, n in DTYPE_ALIASES.items() if n in _DTYPES)])
        raise InvalidConfigError(f"unsupported KV dtype {dtype!r}; expected one of {names}") from None


def layer_index(name: int | str) -> int:
    """Layer index of a core layer name: ``3``, ``"3"`` or ``"model.layers.3.self_attn"`` -> 3."""
    if isinstance(name, int) and not isinstance(name, bool):
        return name
    if isinstance(name, str):
        for part in name.split("."):
            if part.isdigit():
                return int(part)
    raise InvalidConfigError(f"cannot tell the layer index of layer name {name!r}")


def available_memory(device: str | torch.device = "cpu") -> int | None:
    """Bytes free for new tensors on ``device``: CUDA's free memory, else the host's
    ``MemAvailable`` (Linux ``/proc/meminfo``), else its physical memory; None when
    it cannot be told."""
    device = torch.device(device)
    if device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except (RuntimeError, AssertionError):
            return None
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def check_allocation(num_bytes: int, device: str | torch.device, what: str) -> None:
    """Refuse, before allocating, ``num_bytes`` that ``device`` does not have free.

    Raises InvalidConfigError naming ``what``, the bytes and the bytes available (a
    huge ``num_blocks`` would otherwise swap or hang instead of failing).
    """
    free = available_memory(device)
    if free is not None and num_bytes > free:
        raise InvalidConfigError(
            f"{what} would take {format_bytes(num_bytes)} ({num_bytes:,} bytes), more than the "
            f"{format_bytes(free)} ({free:,} bytes) available on {torch.device(device)}"
        )


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidConfigError(f"{name} must be a positive int, got {value!r}")
    return value


class PagedKVStorage:
    """``P`` shared KV tensors for ``G`` groups of layers, addressed by slot.

    Args:
        groups: ``groups[g]`` = the layer indices of group ``g``; layer ``groups[g][j]``
            lives in tensor ``j``. Every layer appears exactly once.
        block_size: tokens per block.
        num_blocks: blocks per tensor, the null block 0 included (so ``>= 2``).
        num_kv_heads, head_size: per-layer KV shape (equal for all layers).
        dtype: element type (a name such as ``"bfloat16"`` or a torch dtype).
        debug: check every write for null-block slots (one reduction per write).
    """

    def __init__(
        self,
        groups: Sequence[Sequence[int]],
        block_size: int,
        num_blocks: int,
        num_kv_heads: int,
        head_size: int,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        debug: bool = True,
    ) -> None:
        self.block_size = _positive_int("block_size", block_size)
        self.num_blocks = _positive_int("num_blocks", num_blocks)
        if num_blocks < 2:
            raise InvalidConfigError(f"num_blocks must be >= 2 (null block + one usable), got {num_blocks}")
        self.num_kv_heads = _positive_int("num_kv_heads", num_kv_heads)
        self.head_size = _positive_int("head_size", head_size)
        self.dtype = torch_dtype(dtype)
        self.device = torch.device(device)
        self.debug = debug

        self.groups: tuple[tuple[int, ...], ...] = tuple(tuple(g) for g in groups)
        if not self.groups or any(len(g) == 0 for g in self.groups):
            raise InvalidConfigError(f"every KV cache group needs at least one layer, got {self.groups}")
        #: layer index -> (group id, position = index of its tensor)
        self.layer_to_group_position: dict[int, tuple[int, int]] = {}
        for g, layers in enumerate(self.groups):
            for j, layer in enumerate(layers):
                if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
                    raise InvalidConfigError(f"layer indices must be non-negative ints, got {layer!r}")
                if layer in self.layer_to_group_position:
                    raise InvalidConfigError(f"layer {layer} appears in more than one KV cache group")
                self.layer_to_group_position[layer] = (g, j)

        num_positions = max(len(g) for g in self.groups)
        item = torch.empty((), dtype=self.dtype).element_size()
        total = num_positions * 2 * num_kv_heads * num_blocks * block_size * head_size * item
        check_allocation(total, self.device, f"a KV cache of {num_blocks:,} blocks")
        # kv_caches[j]: [2 (K, V), num_kv_heads, num_blocks, block_size, head_size]
        self.kv_caches: list[torch.Tensor] = [
            torch.zeros(
                2, num_kv_heads, num_blocks, block_size, head_size, dtype=self.dtype, device=self.device
            )
            for _ in range(num_positions)
        ]
        self.num_slots = num_blocks * block_size
        # by_slot[j]: the same memory as [2 * num_kv_heads, num_slots, head_size]
        self._by_slot = [c.view(2 * num_kv_heads, self.num_slots, head_size) for c in self.kv_caches]
        self._scratch: torch.Tensor | None = None  # gather(scratch=True)'s reused buffer

    @classmethod
    def from_kv_cache_config(
        cls, config, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None, debug: bool = True
    ) -> "PagedKVStorage":
        """Storage for a core ``KVCacheConfig`` (groups of layer names, one spec each, ``num_blocks``)."""
        specs = [g.spec for g in config.groups]
        shapes = {(s.num_kv_heads, s.head_size, s.dtype) for s in specs}
        if len(shapes) != 1:
            raise InvalidConfigError(f"all KV cache groups must share heads / head size / dtype, got {sorted(shapes)}")
        heads, head_size, spec_dtype = shapes.pop()
        groups = [[layer_index(n) for n in g.layer_names] for g in config.groups]
        return cls(groups, specs[0].block_size, config.num_blocks, heads, head_size,
                   dtype=dtype or spec_dtype, device=device, debug=debug)

    # ------------------------------------------------------------------ layout
    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_positions(self) -> int:
        return len(self.kv_caches)

    @property
    def num_layers(self) -> int:
        return len(self.layer_to_group_position)

    def group_of(self, layer: int) -> int:
        """The KV cache group of ``layer`` (whose block table addresses it)."""
        return self._locate(layer)[0]

    def kv_cache(self, layer: int) -> torch.Tensor:
        """The ``[2, H, num_blocks, block_size, D]`` tensor that holds ``layer``."""
        return self.kv_caches[self._locate(layer)[1]]

    def layer_kv(self, layer: int) -> torch.Tensor:
        """``layer``'s K and V by slot: ``[2 * H, num_slots, D]`` contiguous (rows ``:H`` keys, ``H:`` values)."""
        return self._by_slot[self._locate(layer)[1]]

    def flat_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s K and V viewed by slot: two ``[num_slots, H, D]`` (strided) views."""
        flat = self._by_slot[self._locate(layer)[1]].view(2, self.num_kv_heads, self.num_slots, self.head_size)
        return flat[0].transpose(0, 1), flat[1].transpose(0, 1)

    def gather(self, layer: int, slots: torch.Tensor, scratch: bool = False) -> torch.Tensor:
        """K and V of ``layer`` at ``slots`` [n]: ``[2 * H, n, D]`` (rows ``:H`` keys, ``H:`` values).

        scratch: into one buffer the storage keeps (grown to the largest gather), valid until
        the next scratch gather. A fresh multi-megabyte tensor per layer costs its page faults
        every time (glibc maps large blocks anew); the reused buffer pays them once.
        """
        source = self._by_slot[self._locate(layer)[1]]  # [2H, num_slots, D]
        if not scratch:
            return source.index_select(1, slots)
        shape = (source.shape[0], slots.shape[0], source.shape[2])
        need = shape[0] * shape[1] * shape[2]
        if self._scratch is None or self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=self.dtype, device=self.device)
        out = self._scratch[:need].view(shape)
        return torch.index_select(source, 1, slots, out=out)

    def _locate(self, layer: int) -> tuple[int, int]:
        try:
            return self.layer_to_group_position[layer]
        except KeyError:
            raise InvalidArgumentError(
                f"layer {layer!r} has no KV cache; known layers {sorted(self.layer_to_group_position)}"
            ) from None

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id names across all tensors (K and V, every position)."""
        per_tensor = 2 * self.block_size * self.num_kv_heads * self.head_size * self.kv_caches[0].element_size()
        return per_tensor * self.num_positions

    # ------------------------------------------------------------------- write
    def write(self, layer: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store new K/V of ``layer``: token ``t`` goes to slot ``slot_mapping[t]``.

        slot_mapping: [T] int64, key / value: [T, num_kv_heads, head_size].
        """
        if key.shape != value.shape or key.shape[1:] != (self.num_kv_heads, self.head_size):
            raise InvalidArgumentError(
                f"key/value must be [T, {self.num_kv_heads}, {self.head_size}], got "
                f"{tuple(key.shape)} and {tuple(value.shape)}"
            )
        if slot_mapping.shape != (key.shape[0],):
            raise InvalidArgumentError(
                f"slot_mapping must be [T={key.shape[0]}], got {tuple(slot_mapping.shape)}"
            )
        if self.debug:
            self.check_slots(layer, slot_mapping)
        kv = self._by_slot[self._locate(layer)[1]]  # [2H, num_slots, D]
        h = self.num_kv_heads
        if key.dtype != self.dtype:
            key, value = key.to(self.dtype), value.to(self.dtype)
        kv[:h].index_copy_(1, slot_mapping, key.transpose(0, 1))  # [H, T, D] source
        kv[h:].index_copy_(1, slot_mapping, value.transpose(0, 1))

    def check_slots(self, layer: int, slot_mapping: torch.Tensor) -> None:
        """Refuse (InvariantViolation) a write to the null block or past the pool (reads the slots back;
        a negative slot, which a tail_only gap's token gets, writes nothing and is allowed)."""
        slot_mapping = slot_mapping[slot_mapping >= 0]
        if not slot_mapping.numel():
            return
        lo = int(slot_mapping.min())
        hi = int(slot_mapping.max())
        if lo < self.block_size:
            raise InvariantViolation(f"write to the null block (slot {lo}) in layer {layer}")
        if hi >= self.num_blocks * self.block_size:
            raise InvariantViolation(
                f"slot {hi} beyond the pool ({self.num_blocks} blocks of {self.block_size}) in layer {layer}"
            )

    def fill_blocks(self, block_ids: Sequence[int], value: float) -> None:
        """Overwrite whole blocks in every tensor (tests poison freed blocks with NaN)."""
        if not block_ids:
            return
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        for cache in self.kv_caches:
            cache.index_fill_(2, idx, value)

"""Per-sequence state of linear-attention layers (Gated DeltaNet): the slot pools and a step's metadata.

A linear-attention layer keeps, per sequence, a fixed-size state instead of KV: two tensors
(:class:`StateShape`), ``conv`` [K - 1, conv_dim] (the causal conv1d's last inputs, in the
model's dtype) and ``ssm`` [Hv, Dk, Dv] (the recurrent memory, float32). They live in two
pools per layer (:class:`StateStorage`) addressed by *slot*. A step's :class:`StateMetadata`
says, per sequence of the flat batch, which slot its state comes from (-1: the zero state of
a fresh prefill) and in which slots to store the state after given numbers of its tokens
(:class:`StateWrite`; the last one after all of them). The layer that reads them is
:class:`~hybridkv.engine.layers.gated_deltanet.GatedDeltaNet`, whose docstring has a worked
example.

A model with several state groups (the engine's, see :mod:`hybridkv.engine.state_runner`)
gets a :class:`StepStates`: one StateMetadata per group, each layer picking its group's
with ``for_layer`` (a single StateMetadata answers ``for_layer`` with itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

import torch

from hybridkv.engine.host_tensors import long_tensor
from hybridkv.errors import InvalidArgumentError, InvalidConfigError

__all__ = ["StateShape", "StateStorage", "StateWrite", "StateMetadata", "StepStates"]


@dataclass(frozen=True, slots=True)
class StateShape:
    """One layer's per-sequence state: ``conv`` [kernel - 1, conv_dim] and ``ssm`` [Hv, Dk, Dv].

    The conv state is token-major (its rows are the last inputs, oldest first), as the
    core's :func:`~hybridkv.core.state_spec.gated_delta_net_state` counts it.

    >>> s = StateShape(conv_dim=8192, conv_kernel=4, num_v_heads=32, head_k_dim=128, head_v_dim=128)
    >>> s.conv_shape, s.ssm_shape, s.nbytes(conv_itemsize=2)  # Qwen3-Next-80B, bf16 conv
    ((3, 8192), (32, 128, 128), 2146304)
    """

    conv_dim: int
    conv_kernel: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int

    @property
    def conv_shape(self) -> tuple[int, int]:
        return (self.conv_kernel - 1, self.conv_dim)

    @property
    def ssm_shape(self) -> tuple[int, int, int]:
        return (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def nbytes(self, conv_itemsize: int, ssm_itemsize: int = 4) -> int:
        """Bytes of one sequence's state of one layer (the ssm is fp32: 4 bytes)."""
        k, c = self.conv_shape
        h, dk, dv = self.ssm_shape
        return c * k * conv_itemsize + h * dk * dv * ssm_itemsize


class StateStorage:
    """Per linear-attention layer, the two state pools addressed by slot.

    ``conv(layer)`` [num_slots, K - 1, conv_dim] in ``dtype``; ``ssm(layer)``
    [num_slots, Hv, Dk, Dv] in ``ssm_dtype`` (float32). Pools start zeroed; a slot
    holds whatever was last written there (reading -1 means the zero state).

        storage = StateStorage([0, 1, 2], num_slots=64, shape=model.state_shape())
    """

    def __init__(
        self,
        layers: Sequence[int],
        num_slots: int,
        shape: StateShape,
        dtype: torch.dtype = torch.float32,
        ssm_dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots <= 0:
            raise InvalidConfigError(f"num_slots must be a positive int, got {num_slots!r}")
        self.num_slots = num_slots
        self.shape = shape
        self.device = torch.device(device)
        self._conv = {i: torch.zeros(num_slots, *shape.conv_shape, dtype=dtype, device=device) for i in layers}
        self._ssm = {i: torch.zeros(num_slots, *shape.ssm_shape, dtype=ssm_dtype, device=device) for i in layers}

    @classmethod
    def shared(
        cls,
        groups: Sequence[Sequence[int]],
        num_slots: int,
        shape: StateShape,
        dtype: torch.dtype = torch.float32,
        ssm_dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> "StateStorage":
        """Pools shared by position, as :class:`~hybridkv.engine.kv_storage.PagedKVStorage`
        shares KV tensors: layer ``groups[g][j]`` lives in pool ``j``. Sound when the groups'
        slots are block ids of one pool (a block belongs to one group at a time).

            StateStorage.shared([[0, 4], [1, 5], [2, 6]], 64, shape)   # 2 pools of each, not 6
        """
        layers = [i for g in groups for i in g]
        if not layers or len(set(layers)) != len(layers):
            raise InvalidConfigError(f"every state layer must be in exactly one group, got {groups}")
        width = max(len(g) for g in groups)
        storage = cls(range(width), num_slots, shape, dtype, ssm_dtype, device)
        conv, ssm = storage._conv, storage._ssm
        storage._conv = {i: conv[j] for g in groups for j, i in enumerate(g)}
        storage._ssm = {i: ssm[j] for g in groups for j, i in enumerate(g)}
        return storage

    @property
    def layers(self) -> list[int]:
        return list(self._conv)

    @property
    def nbytes(self) -> int:
        """Bytes of every distinct pool (a pool shared by several layers counts once)."""
        pools = {id(t): t for d in (self._conv, self._ssm) for t in d.values()}
        return sum(t.numel() * t.element_size() for t in pools.values())

    def conv(self, layer: int) -> torch.Tensor:
        return self._conv[layer]

    def ssm(self, layer: int) -> torch.Tensor:
        return self._ssm[layer]


class StateWrite(NamedTuple):
    """Store the state after the first ``tokens`` tokens of the step's segment into ``slot``."""

    tokens: int
    slot: int


@dataclass(frozen=True, slots=True)
class StateMetadata:
    """What the linear-attention layers of one step read; one per step, built by :meth:`build`.

    Sequences are in the flat batch's order (the same as the step's AttentionMetadata):
    sequence ``s`` owns rows ``cu_starts[s] .. cu_starts[s] + query_lens[s] - 1``.

    * ``query_lens[s]``: its tokens this step (>= 1);
    * ``read_slots[s]``: the slot holding its state before its first token, -1 = zero state;
    * ``writes[s]``: :class:`StateWrite` s with strictly increasing ``tokens`` in
      ``1..query_lens[s]``, the last one at ``query_lens[s]``. Write slots are distinct
      across the whole step (a read slot may be written).

    Derived: ``decodes`` (sequences with one token: the recurrent form), ``prefills``
    (the others: the chunked form), and the slot / row tensors they use.
    """

    storage: StateStorage
    query_lens: tuple[int, ...]
    read_slots: tuple[int, ...]
    writes: tuple[tuple[StateWrite, ...], ...]
    cu_starts: tuple[int, ...]
    decodes: tuple[int, ...]
    prefills: tuple[int, ...]
    #: [S] read slots (-1: zero state), [W] write slots of all writes in (sequence, write) order
    read_slot_tensor: torch.Tensor
    write_slot_tensor: torch.Tensor
    _memo: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(
        cls,
        storage: StateStorage,
        query_lens: Sequence[int],
        read_slots: Sequence[int],
        writes: Sequence[Sequence[tuple[int, int]]],
        memo: dict[Any, Any] | None = None,
    ) -> "StateMetadata":
        """``memo``: the per-step memo of another metadata of the same step with the same
        query lengths and write positions (only the slots differ: the engine's state groups),
        so its index tensors are built once for all of them."""
        n = len(query_lens)
        if n == 0 or len(read_slots) != n or len(writes) != n:
            raise InvalidArgumentError("query_lens, read_slots and writes need one entry per sequence (at least one)")
        lens = tuple(int(q) for q in query_lens)
        reads = tuple(int(r) for r in read_slots)
        ws = tuple(tuple(StateWrite(int(t), int(sl)) for t, sl in w) for w in writes)
        seen: set[int] = set()
        for s, (q, r, w) in enumerate(zip(lens, reads, ws)):
            if q <= 0:
                raise InvalidArgumentError(f"sequence {s}: needs at least one token, got {q}")
            if not -1 <= r < storage.num_slots:
                raise InvalidArgumentError(f"sequence {s}: read slot {r} not in [-1, {storage.num_slots})")
            if not w or w[-1].tokens != q:
                raise InvalidArgumentError(f"sequence {s}: the last write must be after all {q} tokens, got {w}")
            prev = 0
            for write in w:
                if write.tokens <= prev:
                    raise InvalidArgumentError(f"sequence {s}: write positions must increase in 1..{q}, got {w}")
                prev = write.tokens
                if not 0 <= write.slot < storage.num_slots:
                    raise InvalidArgumentError(f"sequence {s}: write slot {write.slot} not in [0, {storage.num_slots})")
                if write.slot in seen:
                    raise InvalidArgumentError(f"slot {write.slot} is written twice in one step")
                seen.add(write.slot)
        cu, total = [], 0
        for q in lens:
            cu.append(total)
            total += q
        device = storage.device
        return cls(
            storage=storage,
            query_lens=lens,
            read_slots=reads,
            writes=ws,
            cu_starts=tuple(cu),
            decodes=tuple(s for s, q in enumerate(lens) if q == 1),
            prefills=tuple(s for s, q in enumerate(lens) if q > 1),
            read_slot_tensor=long_tensor(list(reads), device),
            write_slot_tensor=long_tensor([w.slot for seq in ws for w in seq], device),
            _memo={} if memo is None else memo,
        )

    def for_layer(self, layer: int) -> "StateMetadata":
        """The metadata of ``layer``: this one (every layer reads the same slots)."""
        return self

    @property
    def num_tokens(self) -> int:
        return self.cu_starts[-1] + self.query_lens[-1]

    def memo(self, key: Any, make: Callable[[], Any]) -> Any:
        """``make()`` once per step under ``key`` (index tensors every layer reuses)."""
        try:
            return self._memo[key]
        except KeyError:
            value = self._memo[key] = make()
            return value

    def rows(self, seqs: Sequence[int]) -> torch.Tensor:
        """[sum q_len] the flat rows of ``seqs``' tokens, in order."""
        return long_tensor([self.cu_starts[s] + i for s in seqs for i in range(self.query_lens[s])],
                           self.storage.device)


@dataclass(frozen=True, slots=True)
class StepStates:
    """A step's states when the layers are in several state groups: ``groups[k]`` is group
    ``k``'s :class:`StateMetadata` (same sequences, its own slots), ``layer_group[i]`` the
    group of layer ``i``."""

    groups: tuple[StateMetadata, ...]
    layer_group: dict[int, int]

    def for_layer(self, layer: int) -> StateMetadata:
        try:
            return self.groups[self.layer_group[layer]]
        except KeyError:
            raise InvalidArgumentError(f"layer {layer} is in no state group ({sorted(self.layer_group)})") from None

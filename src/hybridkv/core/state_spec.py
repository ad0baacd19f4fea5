"""Recurrent state layers (linear attention, state-space models): a constant amount per request.

A Gated DeltaNet layer (Qwen3-Next, Qwen3.5) or a Mamba-2 layer (Nemotron-H, Granite 4,
Falcon-H1) keeps, per request, a causal-convolution state and a recurrent state whose
sizes do not grow with the tokens. In the shared pool one block of a state group holds
one layer's whole state at one position: its page is the state's bytes (padded so every
group's page is equal). Block position ``i`` of a request's table stands for the state
after its first ``(i + 1) * block_size`` tokens; prefix caching keeps such *checkpoints*
(see :mod:`hybridkv.core.managers.state`).

Worked example (Qwen3-Next-80B-A3B, bf16): 16 key heads and 32 value heads of 128,
kernel 4::

    conv_dim   = 2 * 16 * 128 + 32 * 128 = 8192
    conv state = (kernel - 1, conv_dim) = (3, 8192) bf16     ->    49,152 bytes
    ssm state  = (v_heads, v_dim, k_dim) = (32, 128, 128) bf16 -> 1,048,576 bytes
    page       = 1,097,728 bytes = 536 tokens of its attention layers' KV (2 heads x 256,
                 bf16: 2048 bytes a token), so the attention block becomes 544 tokens
                 (a multiple of 16) and the state page is padded to 544 * 2048 = 1,114,112
                 bytes (+16,384, 1.49 %); see :func:`unify_page_sizes`.

Shapes are per layer, as the engine stores them (conv ``(kernel - 1, conv_dim)``); the
manager reads only the page size.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import ClassVar

from hybridkv.core.specs import CacheSpec, KVCacheSpec, canonical_dtype, cdiv, dtype_bytes
from hybridkv.errors import InvalidSpecError

__all__ = ["StateSpec", "STATE_TYPES", "gated_delta_net_state", "mamba2_state", "unify_page_sizes"]

#: the recurrent layer types a state spec names (the engine's kernels; the manager ignores it)
STATE_TYPES = ("gated_delta_net", "mamba2")


@dataclass(frozen=True, slots=True, kw_only=True)
class StateSpec(CacheSpec):
    """One layer's recurrent state: ``shapes[k]`` of ``dtypes[k]`` per state tensor.

    A request holds at most two blocks of it at once: the state it continues from and the
    one a step writes (the same block within a block position). ``page_size_padded``
    (bytes, at least the state's) makes the page equal to the other groups'.
    ``kind`` is ``"mamba"``, vLLM's name for every state layer in its KV events.

    >>> s = gated_delta_net_state(block_size=544, num_k_heads=16, num_v_heads=32, head_k_dim=128,
    ...                           head_v_dim=128, conv_kernel=4, dtype="bfloat16")
    >>> s.shapes, s.real_page_size_bytes
    (((3, 8192), (32, 128, 128)), 1097728)
    >>> s.max_num_blocks(100_000, 8192)
    2
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    state_type: str = "gated_delta_net"
    page_size_padded: int | None = None

    kind: ClassVar[str] = "mamba"

    def __post_init__(self) -> None:
        CacheSpec.__post_init__(self)
        shapes = self.shapes
        if not isinstance(shapes, (tuple, list)) or not shapes or not all(
            isinstance(sh, (tuple, list)) and sh and all(type(d) is int and d > 0 for d in sh) for sh in shapes
        ):
            raise InvalidSpecError(f"shapes must be a non-empty tuple of non-empty tuples of positive ints, got {shapes!r}")
        object.__setattr__(self, "shapes", tuple(tuple(sh) for sh in shapes))
        dtypes = self.dtypes
        if isinstance(dtypes, str) or not isinstance(dtypes, (tuple, list)) or len(dtypes) != len(shapes):
            raise InvalidSpecError(f"dtypes must be a tuple of one dtype name per shape ({len(shapes)}), got {dtypes!r}")
        canonical = tuple(canonical_dtype(d) for d in dtypes)
        for d in canonical:
            dtype_bytes(d)
        object.__setattr__(self, "dtypes", canonical)
        if self.state_type not in STATE_TYPES:
            raise InvalidSpecError(f"state_type must be one of {STATE_TYPES}, got {self.state_type!r}")
        pad = self.page_size_padded
        if pad is not None and (type(pad) is not int or pad < self.real_page_size_bytes):
            raise InvalidSpecError(
                f"page_size_padded must be an int >= the state's {self.real_page_size_bytes} bytes, got {pad!r}"
            )

    @property
    def real_page_size_bytes(self) -> int:
        """The state's own bytes, every tensor of one layer."""
        return sum(prod(sh) * dtype_bytes(d) for sh, d in zip(self.shapes, self.dtypes))

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer (padded)."""
        return self.real_page_size_bytes if self.page_size_padded is None else self.page_size_padded

    @property
    def padding_bytes(self) -> int:
        return self.page_size_bytes - self.real_page_size_bytes

    @property
    def type_id(self) -> str:
        dims = "_".join("x".join(map(str, sh)) + d for sh, d in zip(self.shapes, self.dtypes))
        return f"mamba_{self.state_type}_{dims}_{self.block_size}_{self.page_size_bytes}"

    def covers(self, other: CacheSpec) -> bool:
        """Only its own state: a state group holds layers of one identical state."""
        return other == self

    def max_num_tokens(self, max_model_len: int, max_num_batched_tokens: int | None = None) -> int:
        """Tokens whose block positions one request holds at once: two positions' worth."""
        return min(2 * self.block_size, max_model_len)

    def _max_blocks(self, max_model_len: int, budget: int) -> int:
        # the block it continues from and the one the step writes (one while both are the same)
        return 2


def gated_delta_net_state(*, block_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                          conv_kernel: int, dtype: str = "bfloat16", ssm_dtype: str | None = None) -> StateSpec:
    """A Gated DeltaNet layer's state (Qwen3-Next, Qwen3.5): conv ``(K - 1, conv_dim)`` with
    ``conv_dim = 2 * k_heads * k_dim + v_heads * v_dim`` (q, k and v are convolved), and the
    recurrent state ``(v_heads, v_dim, k_dim)``; ``ssm_dtype`` defaults to ``dtype``."""
    for name, v in (("num_k_heads", num_k_heads), ("num_v_heads", num_v_heads), ("head_k_dim", head_k_dim),
                    ("head_v_dim", head_v_dim)):
        if type(v) is not int or v <= 0:
            raise InvalidSpecError(f"{name} must be a positive int, got {v!r}")
    if type(conv_kernel) is not int or conv_kernel < 2:
        raise InvalidSpecError(f"conv_kernel must be an int >= 2, got {conv_kernel!r}")
    conv_dim = 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim
    return StateSpec(block_size=block_size, shapes=((conv_kernel - 1, conv_dim), (num_v_heads, head_v_dim, head_k_dim)),
                     dtypes=(dtype, ssm_dtype or dtype), state_type="gated_delta_net")


def mamba2_state(*, block_size: int, intermediate_size: int, n_groups: int, state_size: int, num_heads: int,
                 head_dim: int, conv_kernel: int, dtype: str = "bfloat16", ssm_dtype: str | None = None) -> StateSpec:
    """A Mamba-2 layer's state (Nemotron-H, Granite 4, Falcon-H1): conv ``(K - 1, conv_dim)``
    with ``conv_dim = intermediate + 2 * n_groups * state_size`` (x, B and C are convolved),
    and the SSM state ``(num_heads, head_dim, state_size)``."""
    for name, v in (("intermediate_size", intermediate_size), ("n_groups", n_groups), ("state_size", state_size),
                    ("num_heads", num_heads), ("head_dim", head_dim)):
        if type(v) is not int or v <= 0:
            raise InvalidSpecError(f"{name} must be a positive int, got {v!r}")
    if type(conv_kernel) is not int or conv_kernel < 2:
        raise InvalidSpecError(f"conv_kernel must be an int >= 2, got {conv_kernel!r}")
    conv_dim = intermediate_size + 2 * n_groups * state_size
    return StateSpec(block_size=block_size, shapes=((conv_kernel - 1, conv_dim), (num_heads, head_dim, state_size)),
                     dtypes=(dtype, ssm_dtype or dtype), state_type="mamba2")


def unify_page_sizes(attention: list[KVCacheSpec], states: list[StateSpec], *, block_size: int,
                     alignment: int = 16) -> tuple[int, list[KVCacheSpec], list[StateSpec]]:
    """Make every group's page equal, vLLM's way: raise the attention block size to the
    smallest multiple of ``alignment`` whose attention page holds the largest state page
    (or ``block_size`` if larger), then pad every state page to the attention page. Returns the
    block size and the specs at it (attention pages must already agree per token).

    Qwen3-Next-80B-A3B, bf16 (2048 KV bytes a token, state 1,097,728 bytes), block 16:
    ``16 * cdiv(1097728, 16 * 2048) = 16 * 34 = 544`` tokens, page 1,114,112 bytes, the
    state padded by 16,384 bytes. Without attention layers (a pure state model) the
    block size stays ``block_size`` and the pages are the largest state page.
    """
    from dataclasses import replace

    if type(alignment) is not int or alignment <= 0:
        raise InvalidSpecError(f"alignment must be a positive int, got {alignment!r}")
    if not states:
        return block_size, list(attention), []
    largest = max(s.real_page_size_bytes for s in states)
    if attention:
        per_token = {a.page_size_bytes // a.block_size for a in attention}
        if len(per_token) != 1:
            raise InvalidSpecError(f"attention layers with different KV bytes per token: {sorted(per_token)}")
        tok = per_token.pop()
        bs = max(block_size, alignment * cdiv(largest, alignment * tok))
        page = bs * tok
        attention = [replace(a, block_size=bs) for a in attention]
    else:
        bs, page = block_size, largest
    states = [replace(s, block_size=bs, page_size_padded=None if page == s.real_page_size_bytes else page)
              for s in states]
    return bs, attention, states

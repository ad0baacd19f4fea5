"""KV cache specs: what one layer's KV cache looks like, per attention type.

A spec is a frozen, slotted dataclass of plain ints and a dtype name. Layers with
equal specs can share one KV cache group. All arithmetic here is in tokens, blocks
and bytes; nothing imports torch.

Worked example (Llama-4-Scout, bf16, 8 KV heads of 128, block 16, chunk 8192)::

    page_size_bytes = 2 (K and V) * 16 tokens * 8 heads * 128 dims * 2 bytes = 65536
    FullAttentionSpec.max_memory_usage_bytes(1_000_000)
        = cdiv(1_000_000, 16) blocks * 65536 = 62500 * 65536
    ChunkedLocalAttentionSpec(chunk 8192).max_memory_usage_bytes(1_000_000)
        = cdiv(min(8192 + 16, 1_000_000), 16) blocks * 65536 = 513 * 65536
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Iterable, TypeVar

from hybridkv.errors import InvalidSpecError

__all__ = [
    "DTYPE_BYTES",
    "dtype_bytes",
    "cdiv",
    "KVCacheSpec",
    "FullAttentionSpec",
    "SlidingWindowSpec",
    "ChunkedLocalAttentionSpec",
]

#: bytes per element for the dtype names a spec accepts
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "fp8": 1,
    "int8": 1,
    "uint8": 1,
}

_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``dtype`` (a name such as ``"bfloat16"``)."""
    name = _DTYPE_ALIASES.get(dtype, dtype)
    try:
        return DTYPE_BYTES[name]
    except (KeyError, TypeError):
        raise InvalidSpecError(
            f"unknown dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}"
        ) from None


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints: cdiv(17, 16) == 2."""
    return -(-a // b)


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidSpecError(f"{name} must be a positive int, got {value!r}")


S = TypeVar("S", bound="KVCacheSpec")


@dataclass(frozen=True, slots=True, kw_only=True)
class KVCacheSpec:
    """Fields shared by every attention spec. Not used directly."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str = "bfloat16"

    #: short name of the attention type, used in events and reports
    kind: ClassVar[str] = "abstract"

    def __post_init__(self) -> None:
        _check_positive_int("block_size", self.block_size)
        _check_positive_int("num_kv_heads", self.num_kv_heads)
        _check_positive_int("head_size", self.head_size)
        canonical = _DTYPE_ALIASES.get(self.dtype, self.dtype)
        dtype_bytes(canonical)
        if canonical != self.dtype:
            object.__setattr__(self, "dtype", canonical)

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of this layer: K and V, every head, every token."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * dtype_bytes(self.dtype)

    @property
    def type_id(self) -> str:
        """Equal for specs whose blocks are interchangeable (same type, window/chunk, page)."""
        return f"{self.kind}_{self.block_size}_{self.page_size_bytes}"

    def max_num_tokens(self, max_model_len: int) -> int:
        """Most tokens of one request this layer ever holds at once."""
        raise NotImplementedError

    def max_num_blocks(self, max_model_len: int) -> int:
        """Most blocks of one request this layer ever holds at once."""
        if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 0:
            raise InvalidSpecError(f"max_model_len must be a non-negative int, got {max_model_len!r}")
        return cdiv(self.max_num_tokens(max_model_len), self.block_size)

    def max_memory_usage_bytes(self, max_model_len: int) -> int:
        """Upper bound of the bytes one request of ``max_model_len`` tokens needs in this layer."""
        return self.max_num_blocks(max_model_len) * self.page_size_bytes

    @classmethod
    def merge(cls: type[S], specs: Iterable[S]) -> S:
        """One spec for a set of layers; they must all be identical."""
        specs = list(specs)
        if not specs:
            raise InvalidSpecError("cannot merge an empty list of specs")
        first = specs[0]
        for other in specs[1:]:
            if other != first:
                raise InvalidSpecError(f"cannot merge different specs: {first} and {other}")
        return first


@dataclass(frozen=True, slots=True, kw_only=True)
class FullAttentionSpec(KVCacheSpec):
    """Every token attends to every earlier token: a request holds all its blocks."""

    kind: ClassVar[str] = "full_attention"

    def max_num_tokens(self, max_model_len: int) -> int:
        return max_model_len


@dataclass(frozen=True, slots=True, kw_only=True)
class SlidingWindowSpec(KVCacheSpec):
    """Token i attends to tokens (i - sliding_window, i].

    The next token needs the previous ``sliding_window - 1`` tokens; they can straddle
    one more block than they fill, hence ``sliding_window - 1 + block_size`` tokens:
    window 1024, block 16 → min(1039, L) tokens → 65 blocks.
    """

    sliding_window: int
    kind: ClassVar[str] = "sliding_window"

    def __post_init__(self) -> None:
        KVCacheSpec.__post_init__(self)
        _check_positive_int("sliding_window", self.sliding_window)

    @property
    def type_id(self) -> str:
        return f"sliding_window_{self.sliding_window}_{self.block_size}_{self.page_size_bytes}"

    def max_num_tokens(self, max_model_len: int) -> int:
        return min(self.sliding_window - 1 + self.block_size, max_model_len)


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkedLocalAttentionSpec(KVCacheSpec):
    """Token i attends to tokens [floor(i / C) * C, i], C = attention_chunk_size.

    A request holds at most one chunk plus the block that straddles its start:
    chunk 8192, block 16 → min(8208, L) tokens → 513 blocks.
    """

    attention_chunk_size: int
    kind: ClassVar[str] = "chunked_local_attention"

    def __post_init__(self) -> None:
        KVCacheSpec.__post_init__(self)
        _check_positive_int("attention_chunk_size", self.attention_chunk_size)

    @property
    def type_id(self) -> str:
        return f"chunked_local_attention_{self.attention_chunk_size}_{self.block_size}_{self.page_size_bytes}"

    def max_num_tokens(self, max_model_len: int) -> int:
        return min(self.attention_chunk_size + self.block_size, max_model_len)

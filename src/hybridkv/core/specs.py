"""KV cache specs: what one layer's KV cache looks like, per attention type.

A spec is a frozen, slotted dataclass of plain ints and a dtype name. Layers with
equal specs can share one KV cache group. All arithmetic here is in tokens, blocks
and bytes; nothing imports torch.

The spec owns the one per-request block bound, :meth:`KVCacheSpec.max_num_blocks`:
the most blocks one request of ``max_model_len`` tokens holds in this layer at any
moment, when a scheduler computes at most ``max_num_batched_tokens`` tokens of it per
step (chunked prefill). The planner, the engine's default pool and the scheduler's
admission all ask it. During a prefill chunk a windowed layer holds the window it
already had *and* the whole chunk before the tokens that fall out are freed, so the
budget is part of the bound (as in vLLM's ``max_memory_usage_bytes``).

Worked example (Llama-4-Scout, bf16, 8 KV heads of 128, block 16, chunk 8192,
budget 2048)::

    page_size_bytes = 2 (K and V) * 16 tokens * 8 heads * 128 dims * 2 bytes = 65536
    FullAttentionSpec.max_num_blocks(1_000_000, 2048) = cdiv(1_000_000, 16) = 62500
    ChunkedLocalAttentionSpec(chunk 8192).max_num_blocks(1_000_000, 2048)
        = up to 8191 computed tokens of the current chunk + 2048 new = 10239 tokens,
          starting at a chunk start (a multiple of 16: aligned) -> cdiv(10239, 16) = 640
    SlidingWindowSpec(window 1024).max_num_blocks(1_000_000, 1024)
        = 1023 kept + 1024 new = 2047 tokens starting anywhere in a block
          -> (2047 - 1) // 16 + 2 = 129
    SlidingWindowSpec(window 1024, tail_only=True).max_num_blocks(1_000_000, 1024)
        = the 1023 tokens before the chunk + the chunk's last 1023 (the rest is never stored)
          -> 2 * cdiv(1023 + 15, 16) = 130 (the budget no longer counts: 130 at any budget)

``tail_only`` (sliding window and chunked local): a step stores only the K/V that later
tokens read; see :func:`tail_only_blocks` and :class:`~hybridkv.core.managers.base.AttentionManager`.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd
from typing import ClassVar, Iterable, TypeVar

from hybridkv.errors import InvalidSpecError

__all__ = [
    "DTYPE_BYTES",
    "DTYPE_ALIASES",
    "canonical_dtype",
    "kv_cache_dtype",
    "dtype_bytes",
    "cdiv",
    "span_blocks",
    "tail_only_blocks",
    "CacheSpec",
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

#: short names of dtypes (the one table of them: the engine's ``torch_dtype`` reads it too)
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}


def canonical_dtype(dtype: object) -> object:
    """``"bf16"`` -> ``"bfloat16"``: an alias of :data:`DTYPE_ALIASES` resolved, anything else as given."""
    return DTYPE_ALIASES.get(dtype, dtype) if isinstance(dtype, str) else dtype


def kv_cache_dtype(kv_cache_dtype: str, model_dtype: str | None) -> str | None:
    """The KV cache's dtype (vLLM's ``--kv-cache-dtype`` rule, the one place it lives):
    ``"auto"`` stores the model's dtype (``model_dtype``: the engine's ``--dtype``, or in ``plan``
    the config's, None meaning "the config's, not known here"); any other name (aliases resolved)
    is stored as such, whatever the weights are: ``("auto", "float32") -> "float32"``,
    ``("bf16", "float32") -> "bfloat16"``. An unknown name raises InvalidSpecError."""
    if kv_cache_dtype == "auto":
        return None if model_dtype is None else canonical_dtype(model_dtype)
    dtype_bytes(kv_cache_dtype)  # a known dtype, or InvalidSpecError
    return canonical_dtype(kv_cache_dtype)


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``dtype`` (a name such as ``"bfloat16"``)."""
    name = canonical_dtype(dtype)
    try:
        return DTYPE_BYTES[name]
    except (KeyError, TypeError):
        raise InvalidSpecError(
            f"unknown dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}"
        ) from None


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints: cdiv(17, 16) == 2."""
    return -(-a // b)


def span_blocks(num_tokens: int, block_size: int, alignment: int = 1) -> int:
    """Most blocks ``num_tokens`` consecutive tokens can touch when their first token's
    position is a multiple of ``alignment``.

    The first token sits at offset ``r`` in its block, ``r`` a multiple of
    ``g = gcd(alignment, block_size)``, so at most ``block_size - g``; the span then
    touches ``(r + num_tokens - 1) // block_size + 1`` blocks. Block 16: 16 tokens touch
    1 block when aligned to 16 (a chunk start of chunk 8192), 2 when they may start
    anywhere (alignment 1: offset up to 15); 0 tokens touch none.
    """
    if num_tokens <= 0:
        return 0
    return (block_size - gcd(alignment, block_size) + num_tokens - 1) // block_size + 1


def tail_only_blocks(span: int, block_size: int, alignment: int = 1) -> int:
    """Most blocks one request holds in a ``tail_only`` layer reading ``span`` tokens back
    (sliding window W, chunk C) whose skipped prefix starts at multiples of ``alignment``
    (sliding 1, chunked C), at any step budget.

    A step computing tokens ``[s, e)`` holds the blocks before ``s`` that later tokens still
    read (its *history*: tokens from the block holding ``num_skipped_tokens(s)`` to ``s``)
    and, of its own, only the blocks from the one holding ``num_skipped_tokens(e)`` (its
    *tail*; the block of its last token at least): each at most ``h = cdiv(span - 1 + block
    - gcd(alignment, block), block)`` blocks. So ``h + max(h, 1)``: sliding 512, block 16:
    h = cdiv(526, 16) = 33 -> 66; chunked 8192, block 16: h = 512 -> 1024.
    """
    h = cdiv(span - 1 + block_size - gcd(alignment, block_size), block_size)
    return h + max(h, 1)


def _held_tokens(span: int, tail_only: bool, max_model_len: int, max_num_batched_tokens: int | None) -> int:
    """Most tokens of one request a windowed layer holds: the ``span - 1`` before a step and the
    step's new ones (``tail_only``: only its last ``span - 1``, its last token at least)."""
    new = _budget(max_model_len, max_num_batched_tokens)
    if tail_only:
        new = min(new, max(span - 1, 1))
    return min(span - 1 + new, max_model_len)


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise InvalidSpecError(f"{name} must be a bool, got {value!r}")


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidSpecError(f"{name} must be a positive int, got {value!r}")


def _budget(max_model_len: int, max_num_batched_tokens: int | None) -> int:
    """Tokens of one request computed in one step at most: no budget means all of them."""
    return max_model_len if max_num_batched_tokens is None else max_num_batched_tokens


def _check_count(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidSpecError(f"{name} must be an int >= {minimum}, got {value!r}")


S = TypeVar("S", bound="CacheSpec")


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheSpec:
    """What every group spec shares: attention KV (:class:`KVCacheSpec`) and recurrent
    state (:class:`~hybridkv.core.state_spec.StateSpec`). Not used directly.

    ``block_size`` is the tokens one block position stands for: the hash chain's unit,
    equal in every group of a pool.
    """

    block_size: int

    #: short name of the cache type, used in events and reports
    kind: ClassVar[str] = "abstract"

    def __post_init__(self) -> None:
        _check_positive_int("block_size", self.block_size)

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer."""
        raise NotImplementedError

    @property
    def type_id(self) -> str:
        """Equal for specs whose blocks are interchangeable (same type, window/chunk, page)."""
        raise NotImplementedError

    @property
    def attention_span(self) -> int | None:
        """Most earlier tokens one token attends to (window / chunk); None: unbounded (full)
        or not attention (state)."""
        return None

    def covers(self, other: "CacheSpec") -> bool:
        """True when a layer whose own spec is ``other`` may keep its cache in a group of
        this spec (see :meth:`KVCacheSpec.covers`)."""
        raise NotImplementedError

    def max_num_tokens(self, max_model_len: int, max_num_batched_tokens: int | None = None) -> int:
        """Most tokens of one request whose blocks this layer holds at once (see :meth:`max_num_blocks`)."""
        raise NotImplementedError

    def _max_blocks(self, max_model_len: int, budget: int) -> int:
        raise NotImplementedError

    def max_num_blocks(self, max_model_len: int, max_num_batched_tokens: int | None = None) -> int:
        """Most blocks one request of up to ``max_model_len`` tokens holds at once in this layer.

        ``max_num_batched_tokens`` is the most tokens of the request computed in one
        step (the scheduler's budget); None means no chunked prefill: the whole request
        may be computed in one step. Null blocks are not counted. The one bound every
        caller (planner, engine pool, scheduler admission) asks; never re-derive it.
        """
        _check_count("max_model_len", max_model_len, minimum=0)
        if max_num_batched_tokens is not None:
            _check_count("max_num_batched_tokens", max_num_batched_tokens, minimum=1)
        budget = _budget(max_model_len, max_num_batched_tokens)
        return min(cdiv(max_model_len, self.block_size), self._max_blocks(max_model_len, budget))

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int | None = None) -> int:
        """Upper bound of the bytes one request of ``max_model_len`` tokens needs in this layer."""
        return self.max_num_blocks(max_model_len, max_num_batched_tokens) * self.page_size_bytes

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
class KVCacheSpec(CacheSpec):
    """Fields shared by every attention spec. Not used directly."""

    num_kv_heads: int
    head_size: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        CacheSpec.__post_init__(self)
        _check_positive_int("num_kv_heads", self.num_kv_heads)
        _check_positive_int("head_size", self.head_size)
        canonical = canonical_dtype(self.dtype)
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

    def covers(self, other: CacheSpec) -> bool:
        """True when a layer whose own spec is ``other`` may keep its KV in a group of this
        spec: this spec never frees a block that layer's attention still reads.

        The one rule for mixing attention types in a group (the runner asks it; the
        ``--no-hybrid`` layout puts every attention layer in full groups). Full covers
        every attention kind (not recurrent state); sliding window W covers any layer
        reading at most W keys back (sliding w <= W, chunked c <= W: a chunk reaches at
        most c - 1 tokens back); chunked C covers chunked c when C is a multiple of c
        (each c-chunk lies inside one C-chunk), and a layer that reads only its own key
        (window or chunk 1).
        Full in sliding 512: False; sliding 512 in full: True; chunked 256 in chunked
        8192: True; chunked 8192 in chunked 256: False.
        """
        raise NotImplementedError


@dataclass(frozen=True, slots=True, kw_only=True)
class FullAttentionSpec(KVCacheSpec):
    """Every token attends to every earlier token: a request holds all its blocks."""

    kind: ClassVar[str] = "full_attention"

    def covers(self, other: CacheSpec) -> bool:
        return isinstance(other, KVCacheSpec)

    def max_num_tokens(self, max_model_len: int, max_num_batched_tokens: int | None = None) -> int:
        return max_model_len

    def _max_blocks(self, max_model_len: int, budget: int) -> int:
        return cdiv(max_model_len, self.block_size)


@dataclass(frozen=True, slots=True, kw_only=True)
class SlidingWindowSpec(KVCacheSpec):
    """Token i attends to tokens (i - sliding_window, i].

    With ``n`` tokens computed, blocks wholly before ``n - W + 1`` are freed before a
    step's ``b <= budget`` new tokens are allocated, so a request holds at most the
    ``W - 1`` kept tokens plus ``budget`` new ones, starting anywhere in a block:
    window 1024, block 16, budget 1024 → 2047 tokens → (2047 - 1) // 16 + 2 = 129
    blocks (vLLM: cdiv(2047, 16) + 1 = 129); decode only (budget 1) → 65.

    ``tail_only``: a step's tokens that no later token reads (all but its last W - 1) get
    no block: the step attends to them where they were computed. At most
    :func:`tail_only_blocks` (W 1024, block 16: 130) at any budget; prefix hits then end
    where a stored run of W - 1 tokens ends (a step's end, or decoded tokens).
    """

    sliding_window: int
    tail_only: bool = False
    kind: ClassVar[str] = "sliding_window"

    def __post_init__(self) -> None:
        KVCacheSpec.__post_init__(self)
        _check_positive_int("sliding_window", self.sliding_window)
        _check_bool("tail_only", self.tail_only)

    @property
    def type_id(self) -> str:
        return f"sliding_window_{self.sliding_window}_{self.block_size}_{self.page_size_bytes}"

    @property
    def attention_span(self) -> int:
        return self.sliding_window

    def covers(self, other: CacheSpec) -> bool:
        span = other.attention_span
        return span is not None and span <= self.sliding_window

    def max_num_tokens(self, max_model_len: int, max_num_batched_tokens: int | None = None) -> int:
        return _held_tokens(self.sliding_window, self.tail_only, max_model_len, max_num_batched_tokens)

    def _max_blocks(self, max_model_len: int, budget: int) -> int:
        every = span_blocks(self.sliding_window - 1 + budget, self.block_size)
        return min(every, tail_only_blocks(self.sliding_window, self.block_size)) if self.tail_only else every


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkedLocalAttentionSpec(KVCacheSpec):
    """Token i attends to tokens [floor(i / C) * C, i], C = attention_chunk_size.

    With ``n`` tokens computed, blocks wholly before the chunk start ``floor(n/C)*C``
    are freed before a step's new tokens are allocated, so a request holds at most
    ``C - 1`` tokens of the current chunk plus ``budget`` new ones, starting at a chunk
    start (block-aligned when C is a multiple of the block): chunk 256, block 16,
    budget 512 → 767 tokens → 48 blocks (vLLM: cdiv(256 + 512, 16) = 48); chunk 5,
    block 4, budget 1 → 5 tokens from offset 0..3 (gcd 1) → 2 blocks.

    ``tail_only``: a step's tokens before the chunk its last token is in get no block (no
    later token reads them): at most :func:`tail_only_blocks` (chunk 8192, block 16: 1024)
    at any budget; prefix hits then end in the chunk where a step ended.
    """

    attention_chunk_size: int
    tail_only: bool = False
    kind: ClassVar[str] = "chunked_local_attention"

    def __post_init__(self) -> None:
        KVCacheSpec.__post_init__(self)
        _check_positive_int("attention_chunk_size", self.attention_chunk_size)
        _check_bool("tail_only", self.tail_only)

    @property
    def type_id(self) -> str:
        return f"chunked_local_attention_{self.attention_chunk_size}_{self.block_size}_{self.page_size_bytes}"

    @property
    def attention_span(self) -> int:
        return self.attention_chunk_size

    def covers(self, other: CacheSpec) -> bool:
        span = other.attention_span  # a layer reading only its own key (span 1) fits any group
        return span == 1 or (other.kind == self.kind and self.attention_chunk_size % span == 0)

    def max_num_tokens(self, max_model_len: int, max_num_batched_tokens: int | None = None) -> int:
        return _held_tokens(self.attention_chunk_size, self.tail_only, max_model_len, max_num_batched_tokens)

    def _max_blocks(self, max_model_len: int, budget: int) -> int:
        chunk = self.attention_chunk_size
        every = span_blocks(chunk - 1 + budget, self.block_size, chunk)
        return min(every, tail_only_blocks(chunk, self.block_size, chunk)) if self.tail_only else every

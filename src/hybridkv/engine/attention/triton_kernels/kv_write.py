"""The KV write of a step in Triton: token ``t``'s K and V of every KV head go to slot
``slot_mapping[t]`` (``block * block_size + offset``) of one layer's caches, cast to the
cache dtype. A negative slot (a padded row of a CUDA-graph batch) writes nothing.

Shapes: key / value [T, Hkv, D] (any strides with a unit last dim); caches
[Hkv, num_blocks, block_size, D]; slot_mapping [T] int. Grid (T, Hkv).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["write_kv"]


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ch, stride_cb, stride_co, stride_dh, stride_db, stride_do,
    HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, PAGE: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    d = tl.arange(0, HEAD_PAD)
    ok = (d < HEAD) & ((d * 0 + slot) >= 0)  # a block mask (the interpreter refuses a scalar one)
    blk = slot // PAGE
    off = slot % PAGE
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=ok)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=ok)
    tl.store(k_cache_ptr + h * stride_ch + blk * stride_cb + off * stride_co + d,
             k.to(k_cache_ptr.dtype.element_ty), mask=ok)
    tl.store(v_cache_ptr + h * stride_dh + blk * stride_db + off * stride_do + d,
             v.to(v_cache_ptr.dtype.element_ty), mask=ok)


def write_kv(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key`` / ``value`` [T, Hkv, D] at ``slot_mapping`` [T] (negative: skip)."""
    num_tokens, num_kv, head = key.shape
    if num_tokens == 0:
        return
    page = key_cache.shape[2]
    _write_kv_kernel[(num_tokens, num_kv)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        HEAD=head, HEAD_PAD=max(16, 1 << max(0, (head - 1).bit_length())), PAGE=page,
    )

"""Merging two attentions of the same queries over disjoint key sets (cascade attention's prefix
and suffix passes), each normalised and given with its rows' log-sum-exp.

Shapes: a / b / out [T, Hq, D]; lse_a / lse_b [T, Hq] fp32; sinks [Hq] (joins the denominator once).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["merge_attention"]


@triton.jit
def _merge_two_kernel(
    out_ptr, a_ptr, lse_a_ptr, b_ptr, lse_b_ptr, sinks_ptr,
    stride_ot, stride_oh, stride_at, stride_ah, stride_bt, stride_bh,
    NUM_HEADS: tl.constexpr, HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """out = softmax-weighted mix of two attentions over disjoint keys (each normalised, with its LSE)."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    lse_a = tl.load(lse_a_ptr + row * NUM_HEADS + head)
    lse_b = tl.load(lse_b_ptr + row * NUM_HEADS + head)
    m = tl.maximum(lse_a, lse_b)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.exp(lse_a - m)
    w_b = tl.exp(lse_b - m)
    total = w_a + w_b
    if HAS_SINKS:
        total += tl.exp(sink - m)
    d = tl.arange(0, HEAD_PAD)
    ok = d < HEAD
    a = tl.load(a_ptr + row * stride_at + head * stride_ah + d, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + row * stride_bt + head * stride_bh + d, mask=ok, other=0.0).to(tl.float32)
    out = (a * w_a + b * w_b) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=ok)


def merge_attention(out: torch.Tensor, a: torch.Tensor, lse_a: torch.Tensor, b: torch.Tensor, lse_b: torch.Tensor,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Merge two attentions of the same queries over disjoint key sets: a / b / out [T, Hq, D],
    lse_a / lse_b [T, Hq] fp32 (their rows' log-sum-exp); ``sinks`` [Hq] join the denominator once."""
    num_tokens, num_heads, head = out.shape
    if num_tokens:
        _merge_two_kernel[(num_tokens, num_heads)](
            out, a, lse_a, b, lse_b, sinks if sinks is not None else lse_a,
            out.stride(0), out.stride(1), a.stride(0), a.stride(1), b.stride(0), b.stride(1),
            NUM_HEADS=num_heads, HEAD=head, HEAD_PAD=max(16, 1 << max(0, (head - 1).bit_length())),
            HAS_SINKS=sinks is not None,
        )
    return out

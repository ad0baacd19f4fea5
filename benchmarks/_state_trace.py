"""A Qwen3-Next-shaped trace for state groups (no vLLM needed; ``vs_vllm.py --state`` and
``tests/test_state_trace.py`` use it).

Layout: 1 full-attention group + 3 Gated DeltaNet state groups (Qwen3-Next-80B-A3B:
48 layers, every 4th full attention, groups of 12 layers), one page for all: at block 544
the real state shapes ((3, 8192), (32, 128, 128)) bf16 padded to the attention page
(2 KV heads x 256, bf16: 1,114,112 bytes); at a smaller block a small state padded the same
way (the managers read only the page size).

Workload (:func:`chat_doc_stream`), lengths in blocks so every block size sees the same
shape: multi-turn chats (turn k's prompt = a Zipf-popular system prompt + the earlier turns'
user messages and answers + a new message) and questions on a few long documents
(chunked prefill). Prefill chunks are clipped as a scheduler for state groups in "align"
mode clips them: each lane uses its own side's rule (hybridkv's
``KVCacheManager.align_num_new_tokens`` with the step budget, vLLM 0.33's
``Scheduler._mamba_block_aligned_split``), both with the request's shared-prefix junction
set by its ``get_computed_blocks``. :func:`vllm_align` transcribes vLLM's rule (plain path)
for lanes without one of their own; :func:`ours_align` is ours on the same arguments.
"""

from __future__ import annotations

import functools
import random
from typing import Iterator

from _traces import GroupDesc, RequestSpec, TraceSpec, _tokens

__all__ = ["qwen3next_groups", "chat_doc_stream", "vllm_align", "ours_align",
           "make_state_trace", "STATE_TRACES", "GDN_SHAPES"]

#: Qwen3-Next's Gated DeltaNet state per layer, tp=1: conv (K-1, conv_dim), ssm (v_heads, v_dim, k_dim)
GDN_SHAPES = ((3, 8192), (32, 128, 128))
SMALL_SHAPES = ((3, 64), (2, 16, 16))  # fits a block-16 page of 2 x 256 bf16 heads


def qwen3next_groups() -> tuple[GroupDesc, ...]:
    """Qwen3-Next as vLLM and our planner group it: 12 full-attention layers + 3 x 12 GDN layers."""
    return (GroupDesc("full"),) + (GroupDesc("state"),) * 3


def chat_doc_stream(seed: int, bs: int, num_system: int = 6, num_docs: int = 4, active: int = 24,
                    doc_share: float = 0.15) -> callable:
    """Requests of multi-turn chats and long-document questions (lengths in blocks of ``bs``).

    Chats: ``active`` conversations at a time, each 2-6 turns; turn k = system prompt
    (Zipf over ``num_system``, 2-8 blocks) + earlier turns (user 0.1-1.2 blocks, answer the
    request's outputs) + a new user message. Docs: one of ``num_docs`` documents (Zipf,
    16-48 blocks) + a question (0.05-0.4 blocks), short answers.
    """

    def blocks(rng, lo, hi):
        return max(1, int(rng.uniform(lo, hi) * bs))

    def gen() -> Iterator[RequestSpec]:
        rng = random.Random(seed)
        systems = [_tokens(rng, blocks(rng, 2, 8)) for _ in range(num_system)]
        docs = [_tokens(rng, blocks(rng, 16, 48)) for _ in range(num_docs)]
        sw = [1.0 / (k + 1) for k in range(num_system)]
        dw = [1.0 / (k + 1) for k in range(num_docs)]
        convs: list[list] = []  # [id, history tokens, turns left, turn index]
        nconv = ndoc = 0
        while True:
            if rng.random() < doc_share:
                prompt = rng.choices(docs, dw)[0] + _tokens(rng, blocks(rng, 0.05, 0.4))
                yield RequestSpec(f"doc{ndoc}", prompt, _tokens(rng, blocks(rng, 0.02, 0.3)))
                ndoc += 1
                continue
            while len(convs) < active:
                convs.append([nconv, list(rng.choices(systems, sw)[0]), rng.randint(2, 6), 0])
                nconv += 1
            c = convs[rng.randrange(len(convs))]
            prompt = c[1] + _tokens(rng, blocks(rng, 0.1, 1.2))
            out = _tokens(rng, blocks(rng, 0.05, 0.8))
            yield RequestSpec(f"c{c[0]}t{c[3]}", prompt, out)
            c[1] = prompt + out
            c[2] -= 1
            c[3] += 1
            if not c[2]:
                convs.remove(c)

    return gen


def vllm_align(req, num_prompt: int, num_tokens: int, start: int, n: int, *, bs: int, max_prefill: int) -> int:
    """vLLM 0.33's ``Scheduler._mamba_block_aligned_split``, plain path (no EAGLE, no partial
    hash hits, no prefill checkpoints; ``mamba_shared_prefix_checkpoint`` off, its default):
    a chunk that is not the prefill's last ends on a block boundary, rounded down even to 0
    when ``bs <= max_prefill`` (the request waits for a step with budget for a whole block);
    it stops at the next boundary when it starts inside a block, at the prompt's last
    checkpoint ``(T - 1) // B * B`` and at the request's junction
    (``req.shared_prefix_boundary``, floored to a whole number of blocks from ``start``).

    Block 16, budget 256, prompt 78: (0, 40) -> 32; (0, 5) -> 0; junction 48: (0, 78) -> 48.
    """
    prefill_end = max(num_prompt, num_tokens - 1)
    if start >= prefill_end:
        return n
    end = start + n
    if end < prefill_end:
        aligned = end // bs * bs
        if aligned > start or bs <= max_prefill:
            end = aligned
    junction = getattr(req, "shared_prefix_boundary", 0) if req is not None else 0
    stops = ((start // bs + 1) * bs if start % bs else 0, (num_tokens - 1) // bs * bs,
             start + (junction - start) // bs * bs if start < junction < end else 0)
    end = min((s for s in stops if start < s < end), default=end)
    return max(end - start, 0)


def ours_align(req, num_prompt: int, num_tokens: int, start: int, n: int, *, bs: int, max_prefill: int) -> int:
    """hybridkv's rule (``KVCacheManager.align_num_new_tokens``: the step budget and the
    request's junction) on the same arguments as :func:`vllm_align`."""
    from hybridkv.core.managers.state import aligned_num_new_tokens

    junction = getattr(req, "shared_prefix_boundary", 0) if req is not None else 0
    return aligned_num_new_tokens(start, n, num_prompt, num_tokens, bs, max_prefill, junction)


STATE_TRACES = ("q0", "qn", "q0s", "qns")


def make_state_trace(name: str, quick: bool = False) -> TraceSpec:
    """``q0`` / ``qn``: block 544 (the real page), retention 0 (vLLM's default) / None (dense);
    ``q0s`` / ``qns``: the same at block 16 (small pool and state). ``align`` is
    :func:`vllm_align` (hybridkv's and vLLM's lanes bring their own rules)."""
    if name not in STATE_TRACES:
        raise KeyError(name)
    small = name.endswith("s")
    bs = 16 if small else 544
    retention = 0 if name.startswith("q0") else None
    budget = 8192 if not small else 256
    rule = functools.partial(vllm_align, bs=bs, max_prefill=budget)
    return TraceSpec(
        name=name,
        description=(f"Qwen3-Next (1 full + 3 GDN state), block {bs}, retention "
                     f"{'None (dense)' if retention is None else retention}, multi-turn chats on 6 system prompts "
                     f"+ 15% questions on 4 long documents, 64 running, budget {budget}, eviction pressure"),
        groups=qwen3next_groups(),
        num_blocks=500 if small else 650,
        max_running=64,
        token_budget=budget,
        warmup_steps=0 if quick else 40,
        num_steps=150 if quick else 500,
        requests=chat_doc_stream(7, bs),
        block_size=bs,
        num_kv_heads=2,
        head_size=256,
        max_model_len=1 << 20,
        state_shapes=SMALL_SHAPES if small else GDN_SHAPES,
        retention=retention,
        align=rule,
    )

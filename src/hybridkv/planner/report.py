"""A plan as text (aligned plain-text tables) and as a JSON-ready dict.

For a model with state layers (Qwen3-Next, Nemotron-H, ...) the report adds what the
state costs: one line per state shape, the page unification (the block size the
states raised and their padding), and KV vs state bytes per request, per group and in
total. The "full only" layout keeps states as states (a recurrent layer has no KV);
only the attention layers turn into full attention.
"""

from __future__ import annotations

from typing import Any, Sequence

from hybridkv.core.specs import CacheSpec, KVCacheSpec
from hybridkv.core.state_spec import StateSpec
from hybridkv.planner.architectures import ModelLayers
from hybridkv.planner.plan import LayoutPlan, MemoryPlan
from hybridkv.planner.sizes import format_bytes, format_tokens

__all__ = ["render_plan", "plan_to_dict", "format_table"]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], align: str) -> list[str]:
    """Columns padded to their widest cell; ``align`` has one "l" or "r" per column."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        parts = [str(c).ljust(w) if a == "l" else str(c).rjust(w) for c, w, a in zip(cells, widths, align)]
        return "  ".join(parts).rstrip()

    return [line(headers)] + [line(r) for r in rows]


def _attention(spec: CacheSpec) -> str:
    if isinstance(spec, StateSpec):
        return f"{spec.state_type} state"
    tail = ", tail" if getattr(spec, "tail_only", False) else ""  # --kv-store tail
    if hasattr(spec, "sliding_window"):
        return f"sliding_window ({spec.sliding_window}{tail})"
    if hasattr(spec, "attention_chunk_size"):
        return f"chunked_local ({spec.attention_chunk_size}{tail})"
    return spec.kind


def _layer_ids(layers: Sequence[int]) -> str:
    if len(layers) <= 5:
        return ", ".join(map(str, layers))
    return f"{layers[0]}, {layers[1]}, {layers[2]}, ..., {layers[-1]}"


def _context(tokens: int | None) -> str:
    return "unbounded" if tokens is None else format_tokens(tokens)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _layer_descriptions(m: ModelLayers) -> list[str]:
    """Per layer: its caches ("full_attention", "gated_delta_net state", both joined by " + ") or "no cache"."""
    out: list[list[str]] = [[] for _ in range(m.num_layers)]
    for i, spec in zip(m.cache_layers, m.specs):
        out[i].append(_attention(spec))
    return [" + ".join(d) if d else "no cache" for d in out]


def _shape(spec: StateSpec) -> str:
    """``conv (3, 8192) bfloat16 + ssm (32, 128, 128) bfloat16`` (the two states' order in every spec)."""
    names = ("conv ", "ssm ") if len(spec.shapes) == 2 else ("",) * len(spec.shapes)
    return " + ".join(f"{n}{sh} {d}" for n, sh, d in zip(names, spec.shapes, spec.dtypes))


def _state_lines(m: ModelLayers) -> list[str]:
    """One line per distinct state, then the page unification."""
    states = list(dict.fromkeys(s for s in m.state_specs))
    if not states:
        return []
    lines = [f"state       {s.state_type}: {_shape(s)} = {format_tokens(s.real_page_size_bytes)} B per layer"
             for s in states]
    page = states[0].page_size_bytes
    largest = max(states, key=lambda s: s.real_page_size_bytes)
    pad = largest.padding_bytes
    kv = m.attention_specs
    if kv:
        raised = "" if m.block_size == m.requested_block_size else f"{m.requested_block_size} -> "
        how = (f"block size {raised}{m.block_size}: the smallest multiple of 16 whose KV page "
               f"({m.block_size} x {format_tokens(kv[0].page_size_bytes // m.block_size)} B) holds a state")
    else:
        how = f"block size {m.block_size}: no attention layer, one state per page"
    lines.append(f"page        {how}; page {format_tokens(page)} B, the state padded by {format_tokens(pad)} B "
                 f"(+{100 * pad / largest.real_page_size_bytes:.2f}%)")
    return lines


def _model_lines(plan: MemoryPlan) -> list[str]:
    m = plan.model
    counts: dict[str, int] = {}
    for d in _layer_descriptions(m):
        counts[d] = counts.get(d, 0) + 1
    kinds = ", ".join(f"{n} {k}" for k, n in counts.items())
    page = m.specs[0].page_size_bytes
    max_pos = "" if m.max_position_embeddings is None else f" (model max {format_tokens(m.max_position_embeddings)})"
    return [
        f"model       {m.name} ({m.architecture})",
        f"layers      {m.num_layers}: {kinds}",
        f"kv cache    {m.num_kv_heads} KV heads x head_dim {m.head_dim}, {m.dtype}, "
        f"block size {m.block_size} -> {format_bytes(page)} per layer per block",
        *_state_lines(m),
        f"budget      {format_bytes(plan.memory_bytes)} ({format_tokens(plan.memory_bytes)} bytes), "
        f"max model len {format_tokens(plan.max_model_len)} tokens{max_pos}, "
        f"{format_tokens(plan.layout.grouping.max_num_batched_tokens)} tokens per step (max_num_batched_tokens)",
    ]


def _group_lines(layout: LayoutPlan) -> list[str]:
    g = layout.grouping
    title = (
        f"KV cache groups ({layout.name} layout: group size {g.group_size}, "
        f"padding {g.padding_layers} slots = {format_bytes(layout.padding_bytes_per_request)} per request)"
    )
    rows = [
        [
            str(i),
            _attention(grp.spec),
            str(len(grp.layers)),
            str(grp.padding),
            format_tokens(grp.spec.max_num_blocks(layout.max_model_len, g.max_num_batched_tokens)),
            format_tokens(grp.spec.max_num_tokens(layout.max_model_len, g.max_num_batched_tokens)),
            format_bytes(grp.bytes_per_request(layout.max_model_len, g.max_num_batched_tokens)),
            _layer_ids(grp.layers),
        ]
        for i, grp in enumerate(g.groups)
    ]
    headers = ["group", "attention", "layers", "padding", "blocks/request", "tokens/request", "bytes/request",
               "layer ids"]
    lines = [title] + format_table(headers, rows, "llrrrrrl")
    if any(grp.is_state for grp in g.groups):
        b = g.request_bytes(layout.max_model_len)
        lines.append(f"per request @ {format_tokens(layout.max_model_len)} tokens: KV {format_bytes(b.kv)} + "
                     f"state {format_bytes(b.state)} + padded slots {format_bytes(b.padding)}")
    return lines


def _layout_row(label: str, layout: LayoutPlan) -> list[str]:
    g = layout.grouping
    return [
        label,
        str(g.num_groups),
        str(g.group_size),
        format_bytes(layout.bytes_per_block),
        format_tokens(layout.num_blocks),
        format_tokens(layout.blocks_per_request),
        f"{layout.max_concurrency:.2f}x",
        _context(layout.max_context_tokens),
    ]


def render_plan(plan: MemoryPlan) -> str:
    """The human-readable report ``hybridkv plan`` prints."""
    layout = plan.layout
    lines = _model_lines(plan) + [""] + _group_lines(layout) + [""]
    headers = ["layout", "groups", "layers/group", "bytes/block", "blocks", "blocks/request",
               f"concurrency @ {format_tokens(plan.max_model_len)}", "largest context"]
    rows = [_layout_row("hybrid", plan.hybrid), _layout_row("full only", plan.full)]
    rows.append(["hybrid / full", "", "", "", "", "", _ratio(plan.concurrency_ratio), _ratio(plan.context_ratio)])
    lines += format_table(headers, rows, "lrrrrrrr")
    lines.append("")
    every = "every attention layer" if plan.model.state_specs else "every layer"
    state = "hybrid" if plan.hybrid_enabled else f"full only (--no-hybrid: {every} as full attention)"
    lines.append(
        f"in use: {state}: {format_tokens(layout.num_blocks)} blocks (block 0 is the null block), "
        f"{layout.grouping.group_size} tensors of {format_bytes(layout.num_blocks * layout.grouping.page_size_bytes)}"
        f" = {format_tokens(layout.kv_cache_bytes)} bytes"
    )
    max_pos = plan.model.max_position_embeddings
    if max_pos is not None and plan.max_model_len > max_pos:
        lines.append(
            f"note: max model len {format_tokens(plan.max_model_len)} exceeds the model's "
            f"max_position_embeddings ({format_tokens(max_pos)})"
        )
    if layout.max_num_requests < 1:
        lines.append(
            f"warning: one request of {format_tokens(plan.max_model_len)} tokens needs "
            f"{format_tokens(layout.blocks_per_request)} blocks but {format_tokens(layout.usable_blocks)} are usable; "
            f"the largest that fits is {_context(layout.max_context_tokens)} tokens"
        )
    return "\n".join(lines)


def _spec_dict(spec: CacheSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": spec.kind}
    if isinstance(spec, StateSpec):
        out.update(state_type=spec.state_type, block_size=spec.block_size, shapes=[list(sh) for sh in spec.shapes],
                   dtypes=list(spec.dtypes), real_page_size_bytes=spec.real_page_size_bytes,
                   page_size_bytes=spec.page_size_bytes, padding_bytes=spec.padding_bytes)
        return out
    assert isinstance(spec, KVCacheSpec)
    for key in ("sliding_window", "attention_chunk_size"):
        if hasattr(spec, key):
            out[key] = getattr(spec, key)
    if getattr(spec, "tail_only", False):  # --kv-store tail (absent: every computed token stored)
        out["tail_only"] = True
    out.update(block_size=spec.block_size, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
               dtype=spec.dtype, page_size_bytes=spec.page_size_bytes)
    return out


def _layout_dict(layout: LayoutPlan) -> dict[str, Any]:
    g = layout.grouping
    n = layout.max_model_len
    request = g.request_bytes(n)
    return {
        "group_size": g.group_size,
        "num_groups": g.num_groups,
        "page_size_bytes": g.page_size_bytes,
        "bytes_per_block": layout.bytes_per_block,
        "num_blocks": layout.num_blocks,
        "usable_blocks": layout.usable_blocks,
        "kv_cache_bytes": layout.kv_cache_bytes,
        "blocks_per_request": layout.blocks_per_request,
        "max_concurrency": layout.max_concurrency,
        "max_num_requests": layout.max_num_requests,
        "max_context_tokens": layout.max_context_tokens,
        "padding_layers": g.padding_layers,
        "padding_bytes_per_request": layout.padding_bytes_per_request,
        "kv_bytes_per_request": request.kv,
        "state_bytes_per_request": request.state,
        "groups": [
            {
                "spec": _spec_dict(grp.spec),
                "layers": list(grp.layers),
                "padding": grp.padding,
                "blocks_per_request": grp.spec.max_num_blocks(n, g.max_num_batched_tokens),
                "tokens_per_request": grp.spec.max_num_tokens(n, g.max_num_batched_tokens),
                "bytes_per_request": grp.bytes_per_request(n, g.max_num_batched_tokens),
            }
            for grp in g.groups
        ],
        "tensors": [
            {"position": t.position, "layers": list(t.layer_names), "size_bytes": t.size_bytes} for t in layout.tensors
        ],
    }


def _layer_types(m: ModelLayers) -> list[str]:
    """Per layer, its caches' spec kinds joined by "+" ("full_attention", "mamba",
    "full_attention+mamba"), or "none"."""
    out: list[list[str]] = [[] for _ in range(m.num_layers)]
    for i, spec in zip(m.cache_layers, m.specs):
        out[i].append(spec.kind)
    return ["+".join(kinds) or "none" for kinds in out]


def plan_to_dict(plan: MemoryPlan) -> dict[str, Any]:
    """Everything in the report, as plain JSON types (``max_context_tokens`` null: unbounded)."""
    m = plan.model
    return {
        "model": {
            "name": m.name,
            "family": m.family,
            "architecture": m.architecture,
            "num_layers": m.num_layers,
            "num_kv_heads": m.num_kv_heads,
            "head_dim": m.head_dim,
            "dtype": m.dtype,
            "block_size": m.block_size,
            "requested_block_size": m.requested_block_size,
            "max_position_embeddings": m.max_position_embeddings,
            "layer_types": _layer_types(m),
            "states": [_spec_dict(s) for s in dict.fromkeys(m.state_specs)],
        },
        "memory_bytes": plan.memory_bytes,
        "max_model_len": plan.max_model_len,
        "max_num_batched_tokens": plan.layout.grouping.max_num_batched_tokens,
        "hybrid_enabled": plan.hybrid_enabled,
        "layout_in_use": plan.layout.name,
        "hybrid": _layout_dict(plan.hybrid),
        "full": _layout_dict(plan.full),
        "concurrency_ratio": plan.concurrency_ratio,
        "context_ratio": plan.context_ratio,
    }

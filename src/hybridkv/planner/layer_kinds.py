"""Layer kinds: what cache each layer of a model keeps, and the one reader of HF's layer type names.

A layer keeps attention KV (full, sliding window, chunked local), a recurrent state
(linear attention / state-space: Gated DeltaNet, Mamba-2), both (Falcon-H1: attention
and a Mamba mixer side by side), or nothing (Nemotron-H's MoE and MLP blocks)::

    kind       attention KV         recurrent state   HF layer type names
    full       full attention       -                 full_attention, attention (legacy)
    sliding    window (size)        -                 sliding_attention
    chunked    chunk (size)         -                 chunked_attention
    linear     -                    yes               linear_attention, mamba (legacy)
    hybrid     full attention       yes               hybrid
    none       -                    -                 moe, mlp

transformers 5.24 remaps the legacy names ("mamba", "attention") of every config's
``layer_types`` (``remap_legacy_layer_types``); so do we. Each family says which
kinds it has (:func:`kinds_from_names`' ``allowed``): "sliding_attention" in a Llama 4
config, or "moe" in a Qwen3-Next one, is an error naming the index.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

from hybridkv.errors import InvalidConfigError
from hybridkv.planner.config_reader import ConfigReader

__all__ = [
    "LayerKind", "FULL", "FULL_KIND", "SLIDING_KIND", "CHUNKED_KIND", "LINEAR_KIND", "HYBRID_KIND", "NONE_KIND",
    "HF_LAYER_TYPES", "kinds_from_names", "read_layer_types",
]

#: the layer kinds, as the planner and the engine (``AttentionType.kind``) name them
FULL_KIND, SLIDING_KIND, CHUNKED_KIND = "full", "sliding", "chunked"
LINEAR_KIND, HYBRID_KIND, NONE_KIND = "linear", "hybrid", "none"

#: HF layer type name -> our kind (with transformers' legacy remapping)
HF_LAYER_TYPES: Mapping[str, str] = {
    "full_attention": FULL_KIND,
    "attention": FULL_KIND,
    "sliding_attention": SLIDING_KIND,
    "chunked_attention": CHUNKED_KIND,
    "linear_attention": LINEAR_KIND,
    "mamba": LINEAR_KIND,
    "hybrid": HYBRID_KIND,
    "moe": NONE_KIND,
    "mlp": NONE_KIND,
}
#: windowed kind -> the config key that sizes it
_SIZE_KEYS = {SLIDING_KIND: "sliding_window", CHUNKED_KIND: "attention_chunk_size"}
#: kind -> the attention kind of its KV cache (None: no KV)
_ATTENTION = {FULL_KIND: FULL_KIND, SLIDING_KIND: SLIDING_KIND, CHUNKED_KIND: CHUNKED_KIND, HYBRID_KIND: FULL_KIND}


class LayerKind(NamedTuple):
    """One layer: ``kind`` (see the module table), ``size`` its window or chunk in tokens
    (None unless sliding / chunked)."""

    kind: str
    size: int | None = None

    @property
    def attention(self) -> str | None:
        """The kind of this layer's attention KV cache (``"full"`` for a hybrid layer); None: no KV."""
        return _ATTENTION.get(self.kind)

    @property
    def has_state(self) -> bool:
        """Whether the layer keeps a recurrent state (linear attention, Mamba)."""
        return self.kind in (LINEAR_KIND, HYBRID_KIND)


FULL = LayerKind(FULL_KIND)


def kinds_from_names(
    cfg: ConfigReader,
    names: Sequence[str],
    allowed: Mapping[str, int | None],
    source: str | None = None,
    hint: str = "",
    key: str = "layer_types",
) -> list[LayerKind]:
    """HF layer type names -> kinds. ``allowed``: the kinds the family has besides full
    attention -> their size (windows and chunks; None for the others).

    ``key`` is the config key the names are read from, ``source`` where they came from
    (default: ``key``; a family's derivation otherwise), ``hint`` why a size
    may be off. A windowed layer whose size is null is an :class:`InvalidConfigError`:
    transformers builds that config but fails on its first forward
    (``create_sliding_window_causal_mask`` / ``create_chunked_causal_mask`` find no size).
    """
    source = key if source is None else source
    out: list[LayerKind] = []
    for i, name in enumerate(names):
        kind = HF_LAYER_TYPES.get(name)
        if kind is None or (kind != FULL_KIND and kind not in allowed):
            expected = sorted(n for n, k in HF_LAYER_TYPES.items() if k == FULL_KIND or k in allowed)
            raise cfg.fail(f"{key}[{i}]", f"is {name!r}; expected one of {expected}")
        size = allowed.get(kind)
        if kind in _SIZE_KEYS:
            if size is None:
                raise InvalidConfigError(
                    f"{cfg.label}: layer {i} is {name} ({source}) but {cfg.where(_SIZE_KEYS[kind])} is null{hint}; "
                    "transformers cannot run such a layer"
                )
            out.append(LayerKind(kind, size))
        else:
            out.append(FULL if kind == FULL_KIND else LayerKind(kind))
    return out


def read_layer_types(
    cfg: ConfigReader, n: int, allowed: Mapping[str, int | None], hint: str = "", key: str = "layer_types"
) -> list[LayerKind] | None:
    """The config's ``key`` (``layer_types``) as kinds; None when absent (the family derives them)."""
    names = cfg.list_of(key, str, n)
    return None if names is None else kinds_from_names(cfg, names, allowed, hint=hint, key=key)

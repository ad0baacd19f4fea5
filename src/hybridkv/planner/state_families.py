"""Layer kinds of the families with recurrent state layers (the attention-only ones are in
:mod:`~hybridkv.planner.architectures`); names go through :func:`~hybridkv.planner.layer_kinds.kinds_from_names`.

* Qwen3-Next / Qwen3.5: ``layer_types``, else every ``full_attention_interval``-th layer
  (transformers' default 4) full, the others Gated DeltaNet.
* Nemotron-H: ``layers_block_type`` / ``layer_types`` / the legacy ``hybrid_override_pattern``
  (M Mamba, * attention, E MoE, - MLP); the list's length is the layer count.
* Granite 4: ``layer_types``, else every layer Mamba-2.
* Falcon-H1: every layer "hybrid" (attention and Mamba-2).
"""

from __future__ import annotations

from hybridkv.planner.config_reader import LIMITS, ConfigReader
from hybridkv.planner.layer_kinds import (
    HYBRID_KIND, LINEAR_KIND, NONE_KIND, LayerKind, kinds_from_names, read_layer_types,
)

__all__ = ["qwen_linear_kinds", "nemotron_count", "nemotron_kinds", "granite_kinds", "falcon_h1_kinds"]

_LINEAR = {LINEAR_KIND: None}


def qwen_linear_kinds(cfg: ConfigReader, n: int) -> list[LayerKind]:
    kinds = read_layer_types(cfg, n, _LINEAR)
    if kinds is not None:
        return kinds
    interval = cfg.positive_int("full_attention_interval")
    names = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    return kinds_from_names(cfg, names, _LINEAR, f"every {interval}th layer full, by full_attention_interval")


#: Nemotron-H's legacy ``hybrid_override_pattern`` letters (transformers' ``_pattern_to_list``)
_NEMOTRON_PATTERN = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}


def _nemotron_names(cfg: ConfigReader) -> tuple[list[str], str]:
    """(the layer type names, the key they came from): ``layers_block_type``, its alias
    ``layer_types``, then the legacy pattern; transformers' own default list (4 layers)
    describes no model, so one of them is required."""
    for key in ("layers_block_type", "layer_types"):
        value = cfg.get(key, None)
        if value is not None:
            if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
                raise cfg.fail(key, f"must be a non-empty list of layer type names, got {value!r}")
            return value, key
    pattern = cfg.get("hybrid_override_pattern", None)
    if pattern is None:
        raise cfg.fail("layers_block_type", "is missing (nor layer_types or hybrid_override_pattern given)")
    if not isinstance(pattern, str) or not pattern:
        raise cfg.fail("hybrid_override_pattern", f"must be a non-empty string of M, *, E, -; got {pattern!r}")
    bad = sorted(set(pattern) - set(_NEMOTRON_PATTERN))
    if bad:
        raise cfg.fail("hybrid_override_pattern", f"has {bad}; expected only M, *, E, - (Mamba, attention, MoE, MLP)")
    return [_NEMOTRON_PATTERN[c] for c in pattern], "hybrid_override_pattern"


def nemotron_count(cfg: ConfigReader) -> int:
    names, key = _nemotron_names(cfg)
    if len(names) > LIMITS["num_hidden_layers"]:
        limit = LIMITS["num_hidden_layers"]
        raise cfg.fail(key, f"has {len(names):,} layers; more than {limit:,} is not a model config")
    return len(names)


def nemotron_kinds(cfg: ConfigReader, n: int) -> list[LayerKind]:
    names, key = _nemotron_names(cfg)
    return kinds_from_names(cfg, names, {LINEAR_KIND: None, NONE_KIND: None}, key=key)


def granite_kinds(cfg: ConfigReader, n: int) -> list[LayerKind]:
    kinds = read_layer_types(cfg, n, _LINEAR)
    return [LayerKind(LINEAR_KIND)] * n if kinds is None else kinds


def falcon_h1_kinds(cfg: ConfigReader, n: int) -> list[LayerKind]:
    return [LayerKind(HYBRID_KIND)] * n  # FalconH1Config.layers_block_type: "hybrid" for every layer

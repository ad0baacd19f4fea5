"""Per-layer cache specs (attention KV, recurrent state) from a Hugging Face ``config.json``, one function per family.

This module is the one reader of a model's layer layout: the planner plans from
:func:`model_layers` and the engine builds each attention layer from the same
:class:`LayerKind` list (``engine/models/base.py`` asks :func:`model_layers`), so the
two cannot disagree.

A family is picked by the config's ``architectures`` entries, then its ``model_type``
(top level, then ``text_config``). Each family reads the keys transformers 5.24's
config class reads and, for a key that is absent, uses that class's default
(:mod:`~hybridkv.planner.hf_defaults`). Each family's layer rule (which key wins,
what an absent list means, a worked layout per family) is README.md's table
"Layer layouts by model family" (under "Reference tables"); the rule itself is the
family's function below (``_llama4``, ``_gemma3``, ...; state families in
:mod:`~hybridkv.planner.state_families`).

What a caller may rely on:

* Layer type names are read in :func:`~hybridkv.planner.layer_kinds.kinds_from_names`
  only (the table in :mod:`~hybridkv.planner.layer_kinds`).
* A local layer whose size is null (a sliding or chunked layer without
  ``sliding_window`` / ``attention_chunk_size``, named or derived) is an
  :class:`~hybridkv.errors.InvalidConfigError`: transformers builds that config but
  fails on its first forward, so no plan or engine pretends to run it.
* ``num_hidden_layers`` is required (Nemotron-H ignores it, as transformers does: its
  layer list's length is the count); ``num_key_value_heads`` null means ``num_attention_heads``; ``head_dim`` null (or
  absent where the class has no default) means ``hidden_size // num_attention_heads``;
  the dtype is ``torch_dtype`` / ``dtype`` (default bfloat16). State shapes and dtypes:
  :mod:`~hybridkv.planner.state_layers`.
* When a model has state layers, one page holds a state: the attention block size
  grows to the smallest multiple of 16 (and of the requested block size) whose KV page
  holds the largest state, and the state pages are padded to it
  (:func:`~hybridkv.core.state_spec.unify_page_sizes`, vLLM's rule). Qwen3-Next-80B-A3B,
  bf16, block 16: states of 1,097,728 bytes, 2,048 KV bytes a token -> block 544, page
  1,114,112 bytes, each state padded by 16,384 bytes (1.49%).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import lcm
from typing import Any, Callable, Mapping

from hybridkv.core.specs import DTYPE_BYTES, canonical_dtype, CacheSpec, ChunkedLocalAttentionSpec, FullAttentionSpec
from hybridkv.core.specs import KVCacheSpec, SlidingWindowSpec, dtype_bytes
from hybridkv.core.state_spec import StateSpec, unify_page_sizes
from hybridkv.errors import InvalidArgumentError, InvalidConfigError, InvalidSpecError, UnknownArchitectureError
from hybridkv.planner import state_layers
from hybridkv.planner.state_families import (
    falcon_h1_kinds, granite_kinds, nemotron_count, nemotron_kinds, qwen_linear_kinds,
)
from hybridkv.planner.config_reader import ConfigReader
from hybridkv.planner.hf_defaults import MULTIMODAL_DEFAULTS, TEXT_DEFAULTS
from hybridkv.planner.layer_kinds import (
    CHUNKED_KIND, FULL, FULL_KIND, HF_LAYER_TYPES, HYBRID_KIND, LINEAR_KIND, NONE_KIND, SLIDING_KIND, LayerKind,
    kinds_from_names, read_layer_types,
)

__all__ = [
    "LayerKind", "FULL", "FULL_KIND", "SLIDING_KIND", "CHUNKED_KIND", "LINEAR_KIND", "HYBRID_KIND", "NONE_KIND",
    "HF_LAYER_TYPES", "ModelLayers", "Family", "FAMILIES", "supported_architectures", "find_family", "family_named",
    "language_model_config", "model_layers", "layer_name", "cache_name", "STATE_ALIGNMENT",
]

#: attention kernels' block-size multiple (vLLM's FlashAttention: 16); a raised block is one
STATE_ALIGNMENT = 16

DEFAULT_DTYPE = "bfloat16"


def layer_name(index: int) -> str:
    """The name a planned layer's attention KV gets in a :class:`~hybridkv.core.config.KVCacheGroup`."""
    return f"layers.{index}"


def cache_name(index: int, spec: CacheSpec) -> str:
    """The name of layer ``index``'s cache of ``spec``: ``layers.3`` (attention KV), ``layers.3.state``."""
    return f"layers.{index}.state" if isinstance(spec, StateSpec) else layer_name(index)


@dataclass(frozen=True, slots=True)
class ModelLayers:
    """A model's caches as specs, with the numbers they came from.

    ``specs[k]`` is a cache of layer ``layer_ids[k]`` (empty ``layer_ids``: cache k is
    layer k). An attention-only model has one spec per layer; a Falcon-H1 layer has
    two (its KV, then its state); a Nemotron-H MoE / MLP layer none. ``dtype`` is the
    KV dtype; ``block_size`` the one in use, ``requested_block_size`` the one asked for
    (they differ when a state page raised it; see the module docstring).
    """

    name: str
    family: str
    architecture: str
    specs: tuple[CacheSpec, ...]
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    max_position_embeddings: int | None = None
    #: per layer, the kind the specs were made from
    kinds: tuple[LayerKind, ...] = ()
    layer_ids: tuple[int, ...] = ()
    requested_block_size: int | None = None

    @property
    def num_layers(self) -> int:
        return len(self.kinds) if self.kinds else len(self.specs)

    @property
    def cache_layers(self) -> tuple[int, ...]:
        """The layer of each spec."""
        return self.layer_ids or tuple(range(len(self.specs)))

    @property
    def state_specs(self) -> tuple[StateSpec, ...]:
        return tuple(s for s in self.specs if isinstance(s, StateSpec))

    @property
    def attention_specs(self) -> tuple[KVCacheSpec, ...]:
        return tuple(s for s in self.specs if isinstance(s, KVCacheSpec))


@dataclass(frozen=True, slots=True)
class Family:
    """An architecture family: what selects it, its config defaults, its layer rule."""

    name: str
    display: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    defaults: Mapping[str, Any]
    layer_kinds: Callable[[ConfigReader, int], list[LayerKind]]
    #: the shape of its state layers (None: attention only)
    state: state_layers.StateReader | None = None
    #: its layer count (None: ``num_hidden_layers``)
    num_layers: Callable[[ConfigReader], int] | None = None


def _llama4(cfg: ConfigReader, n: int) -> list[LayerKind]:
    chunk = cfg.optional_positive_int("attention_chunk_size")
    kinds = read_layer_types(cfg, n, {CHUNKED_KIND: chunk})
    if kinds is not None:
        return kinds
    interval = cfg.positive_int("no_rope_layer_interval")
    uses_rope = cfg.list_of("no_rope_layers", int, n)
    if uses_rope is None:
        uses_rope = [int((i + 1) % interval != 0) for i in range(n)]
    return [LayerKind(CHUNKED_KIND, chunk) if rope and chunk is not None else FULL for rope in uses_rope]


def _gemma3(cfg: ConfigReader, n: int) -> list[LayerKind]:
    sizes = {SLIDING_KIND: cfg.optional_positive_int("sliding_window")}
    kinds = read_layer_types(cfg, n, sizes)
    if kinds is not None:
        return kinds
    pattern = cfg.positive_int("sliding_window_pattern")
    names = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    return kinds_from_names(cfg, names, sizes, f"every layer but each {pattern}th, by sliding_window_pattern")


def _mistral(cfg: ConfigReader, n: int) -> list[LayerKind]:
    window = cfg.optional_positive_int("sliding_window")
    names = cfg.list_of("layer_types", str, n)  # checked as transformers checks it, then unused
    if names is not None:
        kinds_from_names(cfg, names, {SLIDING_KIND: 1})
    return [LayerKind(SLIDING_KIND, window) if window is not None else FULL] * n


def _qwen(cfg: ConfigReader, n: int) -> list[LayerKind]:
    use = cfg.boolean("use_sliding_window")
    window = cfg.optional_positive_int("sliding_window") if use else None
    hint = "" if use else " (use_sliding_window is false: transformers sets sliding_window to None)"
    kinds = read_layer_types(cfg, n, {SLIDING_KIND: window}, hint)
    if kinds is not None:
        return kinds
    first_sliding = cfg.non_negative_int("max_window_layers")
    return [LayerKind(SLIDING_KIND, window) if window is not None and i >= first_sliding else FULL for i in range(n)]


def _gpt_oss(cfg: ConfigReader, n: int) -> list[LayerKind]:
    sizes = {SLIDING_KIND: cfg.optional_positive_int("sliding_window")}
    kinds = read_layer_types(cfg, n, sizes)
    if kinds is not None:
        return kinds
    names = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    return kinds_from_names(cfg, names, sizes, "even layers, as GptOssConfig derives them")


def _all_full(cfg: ConfigReader, n: int) -> list[LayerKind]:
    return [FULL] * n




FAMILIES: tuple[Family, ...] = (
    Family("llama4", "Llama 4", ("Llama4ForConditionalGeneration", "Llama4ForCausalLM"), ("llama4", "llama4_text"),
           TEXT_DEFAULTS["llama4"], _llama4),
    Family("gemma3", "Gemma 3", ("Gemma3ForConditionalGeneration", "Gemma3ForCausalLM"), ("gemma3", "gemma3_text"),
           TEXT_DEFAULTS["gemma3"], _gemma3),
    Family("mistral", "Mistral", ("MistralForCausalLM",), ("mistral",), TEXT_DEFAULTS["mistral"], _mistral),
    Family("qwen2", "Qwen2", ("Qwen2ForCausalLM",), ("qwen2",), TEXT_DEFAULTS["qwen2"], _qwen),
    Family("qwen3", "Qwen3", ("Qwen3ForCausalLM",), ("qwen3",), TEXT_DEFAULTS["qwen3"], _qwen),
    Family("gpt_oss", "GPT-OSS", ("GptOssForCausalLM",), ("gpt_oss",), TEXT_DEFAULTS["gpt_oss"], _gpt_oss),
    Family("llama", "Llama", ("LlamaForCausalLM",), ("llama",), TEXT_DEFAULTS["llama"], _all_full),
    Family("qwen3_next", "Qwen3-Next", ("Qwen3NextForCausalLM",), ("qwen3_next",), TEXT_DEFAULTS["qwen3_next"],
           qwen_linear_kinds, state_layers.gated_delta_net),
    Family("qwen3_5", "Qwen3.5", ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"), ("qwen3_5", "qwen3_5_text"),
           TEXT_DEFAULTS["qwen3_5"], qwen_linear_kinds, state_layers.gated_delta_net),
    Family("qwen3_5_moe", "Qwen3.5 MoE", ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"),
           ("qwen3_5_moe", "qwen3_5_moe_text"), TEXT_DEFAULTS["qwen3_5_moe"], qwen_linear_kinds,
           state_layers.gated_delta_net),
    Family("nemotron_h", "Nemotron-H", ("NemotronHForCausalLM",), ("nemotron_h",), TEXT_DEFAULTS["nemotron_h"],
           nemotron_kinds, state_layers.nemotron_h, nemotron_count),
    Family("granitemoehybrid", "Granite 4 (GraniteMoeHybrid)", ("GraniteMoeHybridForCausalLM",), ("granitemoehybrid",),
           TEXT_DEFAULTS["granitemoehybrid"], granite_kinds, state_layers.granite_moe_hybrid),
    Family("falcon_h1", "Falcon-H1", ("FalconH1ForCausalLM",), ("falcon_h1",), TEXT_DEFAULTS["falcon_h1"],
           falcon_h1_kinds, state_layers.falcon_h1),
)

_BY_NAME = {f.name: f for f in FAMILIES}
_BY_ARCHITECTURE = {arch: f for f in FAMILIES for arch in f.architectures}
_BY_MODEL_TYPE = {mt: f for f in FAMILIES for mt in f.model_types}


def family_named(name: str) -> Family:
    """The family called ``name`` (``"gemma3"``, ...)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise UnknownArchitectureError(f"unknown model family {name!r}; known: {', '.join(_BY_NAME)}") from None


def supported_architectures() -> list[str]:
    """Every ``architectures`` name a family accepts, sorted."""
    return sorted(_BY_ARCHITECTURE)


def find_family(config: Mapping[str, Any], label: str = "config") -> tuple[Family, str]:
    """The family of ``config`` and the name that selected it (an architecture or model_type)."""
    archs = config.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    if not isinstance(archs, list):
        raise InvalidConfigError(f"{label}: architectures must be a list of names, got {archs!r}")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    model_types = [config.get("model_type"), text.get("model_type")]
    for arch in archs:
        if isinstance(arch, str) and arch in _BY_ARCHITECTURE:
            return _BY_ARCHITECTURE[arch], arch
    for mt in model_types:
        if isinstance(mt, str) and mt in _BY_MODEL_TYPE:
            return _BY_MODEL_TYPE[mt], mt
    named = [repr(a) for a in archs] + [f"model_type {mt!r}" for mt in model_types if mt is not None]
    what = ", ".join(named) if named else "no architectures or model_type"
    raise UnknownArchitectureError(
        f"{label}: unsupported architecture ({what}); supported: {', '.join(supported_architectures())}"
    )


def _check_dtype(dtype: str, error: type[Exception], what: str) -> None:
    try:
        dtype_bytes(dtype)
    except InvalidSpecError:
        raise error(f"{what} {dtype!r} is not supported; expected one of {sorted(DTYPE_BYTES)}") from None


def _spec(kind: LayerKind, tail_only: bool = False, **common: Any) -> KVCacheSpec:
    """The core spec of a layer kind: the one map from our kinds to the core's spec classes."""
    if kind.kind == SLIDING_KIND:
        return SlidingWindowSpec(sliding_window=kind.size, tail_only=tail_only, **common)
    if kind.kind == CHUNKED_KIND:
        return ChunkedLocalAttentionSpec(attention_chunk_size=kind.size, tail_only=tail_only, **common)
    return FullAttentionSpec(**common)


def _unified(specs: list[CacheSpec], block_size: int) -> tuple[CacheSpec, ...]:
    """``specs`` with one page size: unchanged without states, else at the block size
    :func:`~hybridkv.core.state_spec.unify_page_sizes` picks (a multiple of
    :data:`STATE_ALIGNMENT` and of ``block_size``)."""
    states = [s for s in specs if isinstance(s, StateSpec)]
    if not states:
        return tuple(specs)
    attention = [s for s in specs if isinstance(s, KVCacheSpec)]
    _, new_attention, new_states = unify_page_sizes(
        attention, states, block_size=block_size, alignment=lcm(STATE_ALIGNMENT, block_size))
    it_a, it_s = iter(new_attention), iter(new_states)
    return tuple(next(it_s) if isinstance(s, StateSpec) else next(it_a) for s in specs)


def language_model_config(
    config: Mapping[str, Any], *, family: str | None = None, label: str = "config"
) -> dict[str, Any]:
    """The language model's config as one flat dict, every absent key filled as transformers fills it.

    The keys of ``text_config`` when the config nests one (multimodal checkpoints such as
    ``Gemma3ForConditionalGeneration``), else of ``config``; an absent key takes the
    family's default (:data:`~hybridkv.planner.hf_defaults.TEXT_DEFAULTS`). From a
    multimodal wrapper it keeps what transformers reads there: ``tie_word_embeddings``
    (the top-level flag ties ``lm_head``; Gemma3Config's default is true), and the
    ``eos_token_id`` and dtype when given at the top. ``family``: a family name, when
    the caller knows it (else :func:`find_family` picks it).

    >>> cfg = language_model_config({"architectures": ["Gemma3ForConditionalGeneration"],
    ...                              "text_config": {"num_hidden_layers": 34, "hidden_size": 2560}})
    >>> cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["tie_word_embeddings"]
    (8, 4, 256, True)
    """
    fam = family_named(family) if family is not None else find_family(config, label)[0]
    reader = ConfigReader(config, label)  # checks that a text_config is an object
    out = {**fam.defaults, **reader.text}
    if reader.text is not config:
        wrapper = MULTIMODAL_DEFAULTS.get(fam.name, {})
        out["tie_word_embeddings"] = config.get(
            "tie_word_embeddings", wrapper.get("tie_word_embeddings", out.get("tie_word_embeddings"))
        )
        if config.get("eos_token_id") is not None:
            out["eos_token_id"] = config["eos_token_id"]
        for key in ("dtype", "torch_dtype"):
            if out.get(key) is None and config.get(key) is not None:
                out[key] = config[key]
    return out


def model_layers(
    config: Mapping[str, Any],
    *,
    label: str = "config",
    name: str | None = None,
    block_size: int = 16,
    dtype: str | None = None,
    family: str | None = None,
    tail_only: bool = False,
) -> ModelLayers:
    """Every layer's KV cache spec for ``config`` (a parsed ``config.json``).

    ``dtype`` overrides the config's (e.g. ``"fp8"`` for an 8-bit KV cache); ``family``
    names the family when the caller knows it (the engine's model classes do), else
    :func:`find_family` picks it from the config. ``tail_only``: sliding-window and
    chunked-local layers store only what later tokens read (the specs' ``tail_only``).

    >>> from hybridkv.planner.presets import load_model_config
    >>> m = model_layers(load_model_config("llama4-scout").config)
    >>> m.num_layers, sum(s.kind == "full_attention" for s in m.specs), m.specs[0].page_size_bytes
    (48, 12, 65536)
    >>> m.kinds[2:4]
    (LayerKind(kind='chunked', size=8192), LayerKind(kind='full', size=None))
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise InvalidArgumentError(f"block size must be a positive integer, got {block_size!r}")
    if dtype is not None:
        _check_dtype(dtype, InvalidArgumentError, "KV cache dtype")
    if family is None:
        fam, selected_by = find_family(config, label)
    else:
        fam = family_named(family)
        archs = config.get("architectures")
        selected_by = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else fam.name
    cfg = ConfigReader(config, label, fam.defaults)
    num_layers = cfg.positive_int("num_hidden_layers") if fam.num_layers is None else fam.num_layers(cfg)
    num_heads = cfg.positive_int("num_attention_heads")
    kv_heads = cfg.optional_positive_int("num_key_value_heads")
    kv_heads = num_heads if kv_heads is None else kv_heads
    head_dim = cfg.optional_positive_int("head_dim")
    if head_dim is None:
        hidden = cfg.positive_int("hidden_size")
        if hidden % num_heads:
            raise cfg.fail("hidden_size", f"({hidden}) is not a multiple of num_attention_heads ({num_heads})")
        head_dim = hidden // num_heads
    model_dtype = cfg.dtype() or DEFAULT_DTYPE
    if dtype is None:
        _check_dtype(model_dtype, InvalidConfigError, f"{label}: torch_dtype")
    kv_dtype = dtype or model_dtype
    max_pos = cfg.optional_positive_int("max_position_embeddings")
    kinds = tuple(fam.layer_kinds(cfg, num_layers))
    common = dict(block_size=block_size, num_kv_heads=kv_heads, head_size=head_dim, dtype=kv_dtype)
    state = None
    if fam.state is not None and any(k.has_state for k in kinds):
        _check_dtype(model_dtype, InvalidConfigError, f"{label}: torch_dtype")
        state = fam.state(cfg, block_size, model_dtype)
    caches: list[tuple[int, CacheSpec]] = []
    for i, kind in enumerate(kinds):
        if kind.attention is not None:
            caches.append((i, _spec(LayerKind(kind.attention, kind.size), tail_only, **common)))
        if kind.has_state:
            caches.append((i, state))
    if not caches:
        raise InvalidConfigError(
            f"{label}: no layer keeps a KV cache or a state ({num_layers} layers); nothing to plan")
    specs = _unified([s for _, s in caches], block_size)
    return ModelLayers(
        name=name or label,
        family=fam.name,
        architecture=selected_by,
        specs=specs,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=next((s.dtype for s in specs if isinstance(s, KVCacheSpec)), canonical_dtype(kv_dtype)),
        block_size=specs[0].block_size,
        max_position_embeddings=max_pos,
        kinds=kinds,
        layer_ids=() if [i for i, _ in caches] == list(range(len(caches))) else tuple(i for i, _ in caches),
        requested_block_size=block_size,
    )

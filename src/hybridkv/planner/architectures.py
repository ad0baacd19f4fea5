"""Per-layer KV cache specs from a Hugging Face ``config.json``, one function per family.

A family is picked by the config's ``architectures`` entries, then its ``model_type``
(top level, then ``text_config``). Each family reads the keys transformers 5.24's
config class reads and, for a key that is absent, uses that class's default:

* **Llama 4** (iRoPE): ``no_rope_layers[i] == 1`` means layer i uses RoPE and is
  chunked local attention over ``attention_chunk_size`` (8192) tokens; 0 means a
  NoPE layer with full attention. An empty or absent list means every 4th layer
  (``(i + 1) % no_rope_layer_interval == 0``) is NoPE. ``layer_types``
  ("chunked_attention" / "full_attention") wins when present.
  Scout: 48 layers -> layers 3, 7, ..., 47 full (12), the other 36 chunked.
* **Gemma 3**: ``layer_types`` ("sliding_attention" / "full_attention"), else layer i
  is full when ``(i + 1) % sliding_window_pattern == 0`` (pattern 6), sliding otherwise.
  27B: 62 layers -> layers 5, 11, ..., 59 full (10), 52 sliding over 1024 tokens.
* **Mistral**: every layer slides over ``sliding_window`` (null: full attention);
  ``layer_types`` picks the sliding layers when present, as vLLM reads it.
* **Qwen2 / Qwen3**: sliding only when ``use_sliding_window`` is true, and then on
  layers ``i >= max_window_layers`` (28); ``layer_types`` wins when present, but
  a "sliding_attention" layer without ``use_sliding_window`` is full (transformers
  sets the window to None).
* **GPT-OSS**: ``layer_types``, else alternating: even layers slide over
  ``sliding_window`` (128), odd layers are full.
* **Llama** and plain decoders: every layer full.

Shared keys: ``num_hidden_layers`` and ``num_attention_heads`` are required;
``num_key_value_heads`` null means ``num_attention_heads``; ``head_dim`` null (or
absent in a family whose class has no default) means ``hidden_size //
num_attention_heads``; the dtype is ``torch_dtype`` / ``dtype`` (default bfloat16).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from hybridkv.core.specs import (
    DTYPE_BYTES,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    dtype_bytes,
)
from hybridkv.errors import InvalidArgumentError, InvalidConfigError, InvalidSpecError, UnknownArchitectureError
from hybridkv.planner.config_reader import ConfigReader

__all__ = [
    "ModelLayers",
    "Family",
    "FAMILIES",
    "supported_architectures",
    "find_family",
    "model_layers",
    "layer_name",
]

#: per layer: ("full", None), ("sliding", window) or ("chunked", chunk size)
LayerKind = tuple[str, "int | None"]
FULL: LayerKind = ("full", None)

DEFAULT_DTYPE = "bfloat16"


def layer_name(index: int) -> str:
    """The name a planned layer gets in a :class:`~hybridkv.core.config.KVCacheGroup`."""
    return f"layers.{index}"


@dataclass(frozen=True, slots=True)
class ModelLayers:
    """A model's attention layers as KV cache specs, with the numbers they came from."""

    name: str
    family: str
    architecture: str
    specs: tuple[KVCacheSpec, ...]
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    max_position_embeddings: int | None = None

    @property
    def num_layers(self) -> int:
        return len(self.specs)

    def layers_by_type(self) -> dict[str, list[int]]:
        """``type_id`` -> the indices of the layers with that spec, in first-seen order."""
        out: dict[str, list[int]] = {}
        for i, spec in enumerate(self.specs):
            out.setdefault(spec.type_id, []).append(i)
        return out


@dataclass(frozen=True, slots=True)
class Family:
    """An architecture family: what selects it, its config defaults, its layer rule."""

    name: str
    display: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    defaults: Mapping[str, Any]
    layer_kinds: Callable[[ConfigReader, int], list[LayerKind]]


def _from_layer_types(
    cfg: ConfigReader, n: int, names: Mapping[str, str], sizes: Mapping[str, int | None]
) -> list[LayerKind] | None:
    """``layer_types`` mapped through ``names`` (HF name -> kind) and ``sizes`` (kind -> window).

    A windowed kind whose size is None (window or chunk turned off) becomes full attention.
    """
    types = cfg.list_of("layer_types", str, n)
    if types is None:
        return None
    out: list[LayerKind] = []
    for i, t in enumerate(types):
        if t not in names:
            raise cfg.fail(f"layer_types[{i}]", f"is {t!r}; expected one of {sorted(names)}")
        kind = names[t]
        if kind != "full" and sizes[kind] is None:
            out.append(FULL)
        else:
            out.append((kind, sizes.get(kind)))
    return out


def _llama4(cfg: ConfigReader, n: int) -> list[LayerKind]:
    chunk = cfg.optional_positive_int("attention_chunk_size")
    names = {"chunked_attention": "chunked", "full_attention": "full"}
    kinds = _from_layer_types(cfg, n, names, {"chunked": chunk})
    if kinds is not None:
        return kinds
    interval = cfg.positive_int("no_rope_layer_interval")
    uses_rope = cfg.list_of("no_rope_layers", int, n)
    if uses_rope is None:
        uses_rope = [int((i + 1) % interval != 0) for i in range(n)]
    return [("chunked", chunk) if rope and chunk is not None else FULL for rope in uses_rope]


def _gemma3(cfg: ConfigReader, n: int) -> list[LayerKind]:
    window = cfg.optional_positive_int("sliding_window")
    names = {"sliding_attention": "sliding", "full_attention": "full"}
    kinds = _from_layer_types(cfg, n, names, {"sliding": window})
    if kinds is not None:
        return kinds
    pattern = cfg.positive_int("sliding_window_pattern")
    sliding = ("sliding", window) if window is not None else FULL
    return [sliding if (i + 1) % pattern else FULL for i in range(n)]


def _mistral(cfg: ConfigReader, n: int) -> list[LayerKind]:
    window = cfg.optional_positive_int("sliding_window")
    kinds = _from_layer_types(cfg, n, {"sliding_attention": "sliding", "full_attention": "full"}, {"sliding": window})
    if kinds is not None:
        return kinds
    return [("sliding", window) if window is not None else FULL] * n


def _qwen(cfg: ConfigReader, n: int) -> list[LayerKind]:
    window = cfg.optional_positive_int("sliding_window") if cfg.boolean("use_sliding_window") else None
    kinds = _from_layer_types(cfg, n, {"sliding_attention": "sliding", "full_attention": "full"}, {"sliding": window})
    if kinds is not None:
        return kinds
    first_sliding = cfg.non_negative_int("max_window_layers")
    return [("sliding", window) if window is not None and i >= first_sliding else FULL for i in range(n)]


def _gpt_oss(cfg: ConfigReader, n: int) -> list[LayerKind]:
    window = cfg.optional_positive_int("sliding_window")
    kinds = _from_layer_types(cfg, n, {"sliding_attention": "sliding", "full_attention": "full"}, {"sliding": window})
    if kinds is not None:
        return kinds
    sliding = ("sliding", window) if window is not None else FULL
    return [sliding if (i + 1) % 2 else FULL for i in range(n)]


def _all_full(cfg: ConfigReader, n: int) -> list[LayerKind]:
    return [FULL] * n


#: defaults are transformers 5.24's config class defaults for the keys each family reads
FAMILIES: tuple[Family, ...] = (
    Family("llama4", "Llama 4", ("Llama4ForConditionalGeneration", "Llama4ForCausalLM"), ("llama4", "llama4_text"),
           {"head_dim": 128, "num_key_value_heads": 8, "attention_chunk_size": 8192,
            "no_rope_layer_interval": 4, "max_position_embeddings": 4096 * 32}, _llama4),
    Family("gemma3", "Gemma 3", ("Gemma3ForConditionalGeneration", "Gemma3ForCausalLM"), ("gemma3", "gemma3_text"),
           {"head_dim": 256, "num_key_value_heads": 4, "sliding_window": 4096,
            "sliding_window_pattern": 6, "max_position_embeddings": 131_072}, _gemma3),
    Family("mistral", "Mistral", ("MistralForCausalLM",), ("mistral",),
           {"head_dim": None, "num_key_value_heads": 8, "sliding_window": 4096,
            "max_position_embeddings": 4096 * 32}, _mistral),
    Family("qwen2", "Qwen2", ("Qwen2ForCausalLM",), ("qwen2",),
           {"head_dim": None, "num_key_value_heads": 32, "use_sliding_window": False, "sliding_window": 4096,
            "max_window_layers": 28, "max_position_embeddings": 32768}, _qwen),
    Family("qwen3", "Qwen3", ("Qwen3ForCausalLM",), ("qwen3",),
           {"head_dim": 128, "num_key_value_heads": 32, "use_sliding_window": False, "sliding_window": 4096,
            "max_window_layers": 28, "max_position_embeddings": 32768}, _qwen),
    Family("gpt_oss", "GPT-OSS", ("GptOssForCausalLM",), ("gpt_oss",),
           {"head_dim": 64, "num_key_value_heads": 8, "sliding_window": 128,
            "max_position_embeddings": 131072}, _gpt_oss),
    Family("llama", "Llama", ("LlamaForCausalLM",), ("llama",),
           {"head_dim": None, "num_key_value_heads": None, "max_position_embeddings": 2048}, _all_full),
)

_BY_ARCHITECTURE = {arch: f for f in FAMILIES for arch in f.architectures}
_BY_MODEL_TYPE = {mt: f for f in FAMILIES for mt in f.model_types}


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


def _spec(kind: LayerKind, **common: Any) -> KVCacheSpec:
    name, size = kind
    if name == "sliding":
        return SlidingWindowSpec(sliding_window=size, **common)
    if name == "chunked":
        return ChunkedLocalAttentionSpec(attention_chunk_size=size, **common)
    return FullAttentionSpec(**common)


def model_layers(
    config: Mapping[str, Any],
    *,
    label: str = "config",
    name: str | None = None,
    block_size: int = 16,
    dtype: str | None = None,
) -> ModelLayers:
    """Every layer's KV cache spec for ``config`` (a parsed ``config.json``).

    ``dtype`` overrides the config's (e.g. ``"fp8"`` for an 8-bit KV cache).

    >>> from hybridkv.planner.presets import load_model_config
    >>> m = model_layers(load_model_config("llama4-scout").config)
    >>> m.num_layers, sum(s.kind == "full_attention" for s in m.specs), m.specs[0].page_size_bytes
    (48, 12, 65536)
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise InvalidArgumentError(f"block size must be a positive integer, got {block_size!r}")
    if dtype is not None:
        _check_dtype(dtype, InvalidArgumentError, "KV cache dtype")
    family, selected_by = find_family(config, label)
    cfg = ConfigReader(config, label, family.defaults)
    num_layers = cfg.positive_int("num_hidden_layers")
    num_heads = cfg.positive_int("num_attention_heads")
    kv_heads = cfg.optional_positive_int("num_key_value_heads")
    kv_heads = num_heads if kv_heads is None else kv_heads
    head_dim = cfg.optional_positive_int("head_dim")
    if head_dim is None:
        hidden = cfg.positive_int("hidden_size")
        if hidden % num_heads:
            raise cfg.fail("hidden_size", f"({hidden}) is not a multiple of num_attention_heads ({num_heads})")
        head_dim = hidden // num_heads
    kv_dtype = dtype
    if kv_dtype is None:
        kv_dtype = cfg.dtype() or DEFAULT_DTYPE
        _check_dtype(kv_dtype, InvalidConfigError, f"{label}: torch_dtype")
    max_pos = cfg.optional_positive_int("max_position_embeddings")
    kinds = family.layer_kinds(cfg, num_layers)
    common = dict(block_size=block_size, num_kv_heads=kv_heads, head_size=head_dim, dtype=kv_dtype)
    specs = tuple(_spec(k, **common) for k in kinds)
    return ModelLayers(
        name=name or label,
        family=family.name,
        architecture=selected_by,
        specs=specs,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=specs[0].dtype,
        block_size=block_size,
        max_position_embeddings=max_pos,
    )


"""What the engine is built with: :class:`EngineConfig`, flat as vLLM's ``EngineArgs``, torch-free.

One default per field, here: the CLI's ``generate`` / ``serve`` flags read their defaults
from :data:`ENGINE_DEFAULTS` (no torch import to print ``--help``), and the engine's parts
get their own small configs from it, :meth:`EngineConfig.scheduler_config` and
:meth:`EngineConfig.cache_manager_config`, whose fields default to the same named
constants (``scheduler.config``, ``core.config``) where the parts have one.

    config = EngineConfig(block_size=16, kv_cache_memory="256MiB", quantization="int8")
    LLMEngine("gemma-3-270m", config)
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from hybridkv.core.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_RETENTION_INTERVAL, CacheManagerConfig
from hybridkv.core.specs import kv_cache_dtype
from hybridkv.errors import InvalidConfigError
from hybridkv.scheduler.config import (
    DEFAULT_ADMISSION,
    DEFAULT_QUEUED_PREFIX,
    ENGINE_MAX_NUM_SEQS,
    SchedulerConfig,
)

__all__ = ["DEFAULT_ATTENTION_BACKEND", "DTYPES", "ENGINE_DEFAULTS", "EngineConfig", "KV_CACHE_DTYPES", "KV_STORES", "QUANTIZATIONS",
           "QUANTIZATION_CHOICES"]

#: the engine dtypes (model weights and KV cache), the default first
DTYPES = ("float32", "bfloat16", "float16")
#: ``kv_cache_dtype`` values: "auto" (the engine's ``dtype``: :func:`~hybridkv.core.specs.kv_cache_dtype`) or a dtype
KV_CACHE_DTYPES = ("auto", *DTYPES)
#: ``attention_backend`` by default: the ``auto`` rule. Backend names and the rule live in the
#: attention registry (:mod:`hybridkv.engine.attention.registry`), which checks a name when the engine is built
DEFAULT_ATTENTION_BACKEND = "auto"
#: ``kv_store`` values: "all" (every computed token's K/V gets a slot, as vLLM) or "tail" (sliding-window
#: and chunked-local layers store only what later tokens read: the specs' ``tail_only``)
KV_STORES = ("all", "tail")
#: the weight forms a loaded model can be in (weight-only, on a CPU); None is the exact weights: "int8" /
#: "int4" quantize the loaded weights, "gguf" runs a GGUF file's quantized blocks as they are stored
QUANTIZATIONS = ("int8", "int4", "gguf")
#: ``quantization`` values: "auto" (a GGUF checkpoint's own blocks on a CPU in float32, else the exact
#: weights: :func:`~hybridkv.engine.models.resolve_quantization`), "none" (the exact weights, as None) or a form
QUANTIZATION_CHOICES = ("auto", "none", *QUANTIZATIONS)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How to build the engine. Give the pool as ``num_blocks`` or ``kv_cache_memory``."""

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | str | None = None
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = ENGINE_MAX_NUM_SEQS
    admission: str = DEFAULT_ADMISSION  # SchedulerConfig.admission
    enable_prefix_caching: bool = True
    group_size: int | None = None  # default: the planner's choice
    dtype: str = DTYPES[0]
    #: the KV cache's dtype: "auto" (``dtype``) or one of :data:`DTYPES`, whatever the weights (``kv_dtype``)
    kv_cache_dtype: str = "auto"
    #: which K/V windowed layers store: one of :data:`KV_STORES` (``tail_only``: True for "tail")
    kv_store: str = "all"
    device: str = "cpu"
    seed: int = 0
    debug_checks: bool = False  # check every KV write for null-block slots
    hybrid: bool = True  # False: every layer's KV kept as full attention (the all-full layout)
    enable_kv_events: bool = False  # record KV cache events (drained by engine.kv.take_events())
    queued_prefix: str = DEFAULT_QUEUED_PREFIX  # SchedulerConfig.queued_prefix ("refresh" is the server's)
    #: state checkpoints cached (CacheManagerConfig's): None every block, 0 the prompt's last, k every k tokens
    prefix_cache_retention_interval: int | None = DEFAULT_RETENTION_INTERVAL
    #: "auto" or a registered backend's name (checked by the registry when the engine is built)
    attention_backend: str = DEFAULT_ATTENTION_BACKEND
    #: True: no CUDA graphs (decode steps run eagerly)
    enforce_eager: bool = False
    #: the weights' form: one of :data:`QUANTIZATION_CHOICES` ("auto" by default; None is "none")
    quantization: str | None = "auto"

    def __post_init__(self) -> None:
        if self.num_blocks is not None and self.kv_cache_memory is not None:
            raise InvalidConfigError("give num_blocks or kv_cache_memory, not both")
        if not isinstance(self.hybrid, bool):
            raise InvalidConfigError(f"hybrid must be a bool, got {self.hybrid!r}")
        if not isinstance(self.enforce_eager, bool):
            raise InvalidConfigError(f"enforce_eager must be a bool, got {self.enforce_eager!r}")
        if not isinstance(self.attention_backend, str) or not self.attention_backend:
            raise InvalidConfigError(f"attention_backend must be one of the attention backends' names, got {self.attention_backend!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_CHOICES:
            raise InvalidConfigError(f"quantization must be one of {list(QUANTIZATION_CHOICES)} or None, "
                                     f"got {self.quantization!r}")
        if self.kv_store not in KV_STORES:
            raise InvalidConfigError(f"kv_store must be one of {list(KV_STORES)}, got {self.kv_store!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidConfigError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if not self.hybrid and self.group_size is not None:
            raise InvalidConfigError("group_size applies to the hybrid layout; with hybrid off all layers are one group")

    @property
    def tail_only(self) -> bool:
        """Windowed layers store only what later tokens read (``kv_store`` "tail")."""
        return self.kv_store == "tail"

    @property
    def kv_dtype(self) -> str:
        """The KV cache's dtype in force: ``kv_cache_dtype``, "auto" being ``dtype``."""
        return kv_cache_dtype(self.kv_cache_dtype, self.dtype)

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The scheduler's limits and policies (``max_model_len``: the one in force, resolved from the model)."""
        return SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_model_len=max_model_len,
            admission=self.admission,
            queued_prefix=self.queued_prefix,
        )

    def cache_manager_config(self, max_model_len: int) -> CacheManagerConfig:
        """The KV cache manager's switches."""
        return CacheManagerConfig(
            max_model_len=max_model_len,
            enable_caching=self.enable_prefix_caching,
            enable_kv_events=self.enable_kv_events,
            prefix_cache_retention_interval=self.prefix_cache_retention_interval,
        )


#: field -> default (what the CLI's flags default to)
ENGINE_DEFAULTS: dict[str, object] = {f.name: f.default for f in fields(EngineConfig)}

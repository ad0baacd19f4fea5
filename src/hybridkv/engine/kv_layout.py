"""The engine's cache layout: the planner's layers and groups at the engine's dtypes, and the pool.

One reading of the config for the engine and ``hybridkv generate``'s checks before the
model loads (torch-free, though it sits in the engine package):

* the caches: :func:`~hybridkv.planner.model_layers` with the engine's dtypes (:func:`engine_layers`):
  attention KV in the KV cache dtype (``kv_dtype``, by default the engine's ``dtype``), conv
  states in the engine's ``dtype``, recurrent states in float32
  (the engine's Gated DeltaNet keeps them so), so a state page counts what the engine stores;
* the block size: the planner's, which a state page may raise above the requested one
  (:func:`~hybridkv.core.state_spec.unify_page_sizes`);
* the groups: the planner's hybrid grouping of every cache (state groups included), or
  with ``hybrid=False`` its all-full one (attention layers as full attention, state layers
  still states: :func:`~hybridkv.planner.full_attention_grouping`);
* the pool: ``num_blocks`` as given, or what a byte budget holds at ``bytes_per_block``
  (every group's pages of one block id), or by default room for ``max_num_seqs`` requests.

What the engine allocates (:meth:`KVLayout.allocation_bytes`) is more than the pool's
accounting when there are states: they live in pools of their own beside the KV tensors
(see :mod:`hybridkv.engine.state_runner`), one slot per block id.

Worked example (the tests' tiny Qwen3-Next: layers linear, full, linear, linear; 2 KV
heads of 16; Gated DeltaNet 2 key heads of 16, 4 value heads of 8, kernel 4; fp32;
block 4 asked)::

    KV a token   = 2 * 2 * 16 * 4                        =   256 bytes
    state        = conv 3 * (2*2*16 + 4*8) * 4 + ssm 4 * 16 * 8 * 4 = 1152 + 2048 = 3200 bytes
    block        = 16 * cdiv(3200, 16 * 256) = 16 tokens (lcm(16, 4) = 16), page 4096 bytes
    groups       = full [1], state [0], [2], [3] (size 1: no padded slot); 4096 bytes a block id
    a request of 512 tokens: 32 + 3 * 2 = 38 block ids = 155,648 bytes
    allocated a block id: 4096 (KV) + 3200 (one state pool shared by the 3 groups) = 7296 bytes
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from hybridkv.core.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, KVCacheConfig, KVCacheGroup
from hybridkv.core.state_spec import StateSpec
from hybridkv.errors import InvalidConfigError
from hybridkv.planner.architectures import ModelLayers, cache_name, find_family, language_model_config, model_layers
from hybridkv.planner.grouping import Grouping, LayerGroup, group_layers
from hybridkv.planner.hf_defaults import DEFAULT_MAX_POSITION_EMBEDDINGS
from hybridkv.planner.plan import full_attention_grouping

__all__ = ["ENGINE_SSM_DTYPE", "KVLayout", "engine_layers"]

#: the dtype of the engine's recurrent states, whatever the model's (sums of every token's update)
ENGINE_SSM_DTYPE = "float32"

#: the default pool's bytes at most (see :meth:`KVLayout.num_blocks`)
DEFAULT_POOL_CAP_BYTES = 1 << 30


def engine_layers(config: Mapping[str, Any], *, family: str, block_size: int, dtype: str,
                  label: str = "config", kv_dtype: str | None = None, tail_only: bool = False) -> ModelLayers:
    """The planner's caches of a language model's flat ``config`` as the engine stores them: the
    model at ``dtype`` (conv states), attention KV at ``kv_dtype`` (None: ``dtype``); ``tail_only``:
    windowed layers store only what later tokens read (``EngineConfig.kv_store`` "tail")."""
    stored = {**config, "dtype": dtype, "mamba_ssm_dtype": ENGINE_SSM_DTYPE}
    stored.pop("torch_dtype", None)
    return model_layers(stored, family=family, label=label, block_size=block_size, dtype=kv_dtype or dtype,
                        tail_only=tail_only)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The layers, the grouping in use (``grouping``), the all-full one it is compared with
    (``full_grouping``) and the request length they are planned for.

        layout = KVLayout.plan(config, block_size=16, dtype="float32", max_model_len=4096)
        KVCacheManager(layout.kv_cache_config(layout.num_blocks(max_num_seqs=8)), ...)
    """

    layers: ModelLayers
    grouping: Grouping
    full_grouping: Grouping
    max_model_len: int

    @classmethod
    def plan(
        cls,
        config: Mapping[str, Any],
        *,
        block_size: int,
        dtype: str,
        family: str | None = None,
        label: str = "config",
        max_model_len: int | None = None,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        hybrid: bool = True,
        group_size: int | None = None,
        memory_bytes: int | None = None,
        kv_dtype: str | None = None,
        tail_only: bool = False,
    ) -> "KVLayout":
        """``config``: a ``config.json`` (``family`` None: found from it, multimodal ones
        flattened) or a model's flat config with its ``family``. ``max_model_len`` None:
        the config's ``max_position_embeddings``. ``kv_dtype``: the attention KV's dtype
        (None: ``dtype``, the engine's). ``tail_only``: see :func:`engine_layers`."""
        if family is None:
            family = find_family(config, label)[0].name
            config = language_model_config(config, family=family, label=label)
        layers = engine_layers(config, family=family, block_size=block_size, dtype=dtype, label=label, kv_dtype=kv_dtype,
                               tail_only=tail_only)
        max_len = max_model_len or layers.max_position_embeddings or DEFAULT_MAX_POSITION_EMBEDDINGS
        budget = max_num_batched_tokens
        full = full_attention_grouping(layers, max_len, budget, memory_bytes=memory_bytes)
        grouping = full
        if hybrid:
            grouping = group_layers(layers.specs, max_len, group_size=group_size, max_num_batched_tokens=budget,
                                    memory_bytes=memory_bytes, layer_ids=layers.cache_layers)
        return cls(layers, grouping, full, max_len)

    # ------------------------------------------------------------------ shape
    @property
    def block_size(self) -> int:
        """Tokens per block: the planner's (at least the requested size)."""
        return self.layers.block_size

    @property
    def bytes_per_block(self) -> int:
        """The pool's bytes of one block id: every group's pages (``group_size * page``)."""
        return self.grouping.bytes_per_block

    @property
    def attention_groups(self) -> dict[int, LayerGroup]:
        """Group id -> group, for the groups of attention KV."""
        return {g: group for g, group in enumerate(self.grouping.groups) if not group.is_state}

    @property
    def state_groups(self) -> dict[int, LayerGroup]:
        """Group id -> group, for the groups of recurrent states."""
        return {g: group for g, group in enumerate(self.grouping.groups) if group.is_state}

    # ------------------------------------------------------------------- pool
    def num_blocks(self, num_blocks: int | None = None, memory_bytes: int | None = None, max_num_seqs: int = 64) -> int:
        """The pool: ``num_blocks`` as given, or what ``memory_bytes`` holds, or by default
        room for ``max_num_seqs`` requests of ``max_model_len`` (the specs' per-request bound
        at the grouping's budget), capped at 1 GiB but never below one whole request and
        the null block."""
        if num_blocks is not None and memory_bytes is not None:
            raise InvalidConfigError("give num_blocks or kv_cache_memory, not both")
        if num_blocks is not None:
            return num_blocks
        if memory_bytes is not None:
            return memory_bytes // self.bytes_per_block
        per_request = self.grouping.blocks_per_request(self.max_model_len)
        cap = DEFAULT_POOL_CAP_BYTES // self.bytes_per_block
        return max(per_request + 1, min(max_num_seqs * per_request + 1, cap))

    def kv_cache_config(self, num_blocks: int) -> KVCacheConfig:
        """The core's config: every group (states too), caches named ``model.layers.3`` (KV)
        and ``model.layers.0.state``."""
        return KVCacheConfig(num_blocks, tuple(
            KVCacheGroup(g.spec, tuple(f"model.{cache_name(i, g.spec)}" for i in g.layers))
            for g in self.grouping.groups
        ))

    def allocation_bytes(self, num_blocks: int) -> int:
        """Bytes the engine allocates for a pool of ``num_blocks``: the KV tensors (one per
        attention position) and the state pools (one per state position, unpadded states)."""
        attention = self.attention_groups.values()
        states = self.state_groups.values()
        kv = max((len(g.layers) for g in attention), default=0) * self.grouping.page_size_bytes
        state = max((len(g.layers) for g in states), default=0) * max(
            (g.spec.real_page_size_bytes for g in states if isinstance(g.spec, StateSpec)), default=0)
        return num_blocks * (kv + state)

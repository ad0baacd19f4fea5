"""Recurrent state of a model's linear-attention / Mamba layers, read from ``config.json``.

One function per family, each the shape vLLM 0.33 allocates at tensor parallel 1
(``model_executor/layers/mamba/mamba_utils.py``; conv state ``(kernel - 1, conv_dim)``)
with the keys transformers 5.24's config class reads (absent keys: its defaults,
:mod:`~hybridkv.planner.hf_defaults`):

* **Gated DeltaNet** (Qwen3-Next, Qwen3.5): ``linear_num_key_heads`` / ``linear_num_value_heads``
  heads of ``linear_key_head_dim`` / ``linear_value_head_dim``, kernel ``linear_conv_kernel_dim``.
  Qwen3-Next-80B-A3B: conv (3, 2*16*128 + 32*128 = 8192), recurrent (32, 128, 128).
* **Nemotron-H**: Mamba-2 with ``mamba_num_heads`` x ``mamba_head_dim`` (intermediate =
  their product, as vLLM's ``nemotron_h.py``), ``n_groups``, ``ssm_state_size``, ``conv_kernel``
  (the kwargs ``mamba_n_groups`` / ``mamba_d_conv`` win, as transformers renames them).
  Defaults: conv (3, 8192 + 2*8*128 = 10240), ssm (128, 64, 128).
* **Granite 4 (GraniteMoeHybrid)**: intermediate = ``mamba_expand * hidden_size``,
  ``mamba_d_head`` "auto" = intermediate // ``mamba_n_heads``. Defaults: conv (3, 8704), ssm (128, 64, 256).
* **Falcon-H1**: intermediate = ``mamba_d_ssm`` (null: ``mamba_expand * hidden_size``), same
  "auto" head. Defaults: conv (3, 1536), ssm (128, 8, 256).

Dtypes (vLLM's ``_mamba_state_dtype`` with ``mamba_cache_dtype`` "auto"): the conv state
takes the model's dtype (``torch_dtype`` / ``dtype``, as attention KV does unless a KV
dtype is given: vLLM's ``--kv-cache-dtype fp8`` leaves states alone); the recurrent
state takes the config's own setting where the family has one (Nemotron-H
``mamba_ssm_cache_dtype``, default float32; Qwen3.5 ``mamba_ssm_dtype``), else the conv
state's dtype.
"""

from __future__ import annotations

from typing import Callable

from hybridkv.core.specs import DTYPE_BYTES, dtype_bytes
from hybridkv.core.state_spec import StateSpec, gated_delta_net_state, mamba2_state
from hybridkv.errors import InvalidSpecError
from hybridkv.planner.config_reader import ConfigReader

__all__ = ["StateReader", "gated_delta_net", "nemotron_h", "granite_moe_hybrid", "falcon_h1"]

#: (config, block size, model dtype) -> one state layer's spec
StateReader = Callable[[ConfigReader, int, str], StateSpec]


def _dtype(cfg: ConfigReader, key: str, default: str) -> str:
    """The dtype name at ``key`` (absent: the family's default; null or no default: ``default``), checked."""
    value = cfg.get(key, cfg.defaults.get(key))
    if value is None:
        return default
    try:
        if not isinstance(value, str):
            raise InvalidSpecError(value)
        dtype_bytes(value)
    except InvalidSpecError:
        raise cfg.fail(key, f"is {value!r}; expected one of {sorted(DTYPE_BYTES)}") from None
    return value


def _auto_head_dim(cfg: ConfigReader, intermediate: int, heads: int) -> int:
    """``mamba_d_head``: an int, or "auto" = intermediate // heads (transformers refuses a
    split that does not divide, or that does not multiply back to the intermediate size)."""
    head = cfg.get("mamba_d_head")
    if intermediate % heads:
        raise cfg.fail("mamba_n_heads", f"({heads}) does not divide the Mamba intermediate size ({intermediate})")
    if head == "auto":
        return intermediate // heads
    head = cfg.positive_int("mamba_d_head", head)
    if head * heads != intermediate:
        raise cfg.fail("mamba_d_head",
                       f"({head}) x mamba_n_heads ({heads}) is not the intermediate size {intermediate}")
    return head


def gated_delta_net(cfg: ConfigReader, block_size: int, dtype: str) -> StateSpec:
    return gated_delta_net_state(
        block_size=block_size,
        num_k_heads=cfg.positive_int("linear_num_key_heads"),
        num_v_heads=cfg.positive_int("linear_num_value_heads"),
        head_k_dim=cfg.positive_int("linear_key_head_dim"),
        head_v_dim=cfg.positive_int("linear_value_head_dim"),
        conv_kernel=_kernel(cfg, "linear_conv_kernel_dim"),
        dtype=dtype,
        ssm_dtype=_dtype(cfg, "mamba_ssm_dtype", dtype),
    )


def _kernel(cfg: ConfigReader, key: str, default: object = None) -> int:
    kernel = cfg.positive_int(key) if default is None else cfg.positive_int(key, default)
    if kernel < 2:
        raise cfg.fail(key, f"is {kernel}; a causal convolution keeps kernel - 1 >= 1 inputs")
    return kernel


def nemotron_h(cfg: ConfigReader, block_size: int, dtype: str) -> StateSpec:
    heads, head_dim = cfg.positive_int("mamba_num_heads"), cfg.positive_int("mamba_head_dim")
    groups = cfg.positive_int("mamba_n_groups", cfg.get("n_groups"))
    return mamba2_state(
        block_size=block_size,
        intermediate_size=heads * head_dim,
        n_groups=groups,
        state_size=cfg.positive_int("ssm_state_size"),
        num_heads=heads,
        head_dim=head_dim,
        conv_kernel=_kernel(cfg, "mamba_d_conv", cfg.get("conv_kernel")),
        dtype=dtype,
        ssm_dtype=_dtype(cfg, "mamba_ssm_cache_dtype", dtype),
    )


def _mamba2_d_ssm(cfg: ConfigReader, block_size: int, dtype: str, intermediate: int) -> StateSpec:
    heads = cfg.positive_int("mamba_n_heads")
    return mamba2_state(
        block_size=block_size,
        intermediate_size=intermediate,
        n_groups=cfg.positive_int("mamba_n_groups"),
        state_size=cfg.positive_int("mamba_d_state"),
        num_heads=heads,
        head_dim=_auto_head_dim(cfg, intermediate, heads),
        conv_kernel=_kernel(cfg, "mamba_d_conv"),
        dtype=dtype,
    )


def granite_moe_hybrid(cfg: ConfigReader, block_size: int, dtype: str) -> StateSpec:
    intermediate = cfg.positive_int("mamba_expand") * cfg.positive_int("hidden_size")
    return _mamba2_d_ssm(cfg, block_size, dtype, intermediate)


def falcon_h1(cfg: ConfigReader, block_size: int, dtype: str) -> StateSpec:
    d_ssm = cfg.optional_positive_int("mamba_d_ssm")
    intermediate = d_ssm if d_ssm is not None else cfg.positive_int("mamba_expand") * cfg.positive_int("hidden_size")
    return _mamba2_d_ssm(cfg, block_size, dtype, intermediate)

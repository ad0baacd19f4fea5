"""Typed reads from a Hugging Face ``config.json`` dict, with one-line errors.

Multimodal configs nest the language model under ``text_config`` (Llama 4, Gemma 3);
:class:`ConfigReader` reads keys from there when it exists (the dtype alone falls
back to the top level; ``architectures`` / ``model_type`` are read by
:func:`~hybridkv.planner.architectures.find_family`). A key that is absent
takes the default of transformers' own config class (passed in as ``defaults``);
a key with no such default is required, and its absence is an
:class:`~hybridkv.errors.InvalidConfigError` naming the key and the file::

    preset gemma-3-27b: text_config.num_hidden_layers is missing

Integers are also bounded above (:data:`LIMITS`, else :data:`DEFAULT_LIMIT`), so a
config with ``"num_hidden_layers": 1000000000`` is refused in one line instead of
building a billion layer specs::

    model/config.json: num_hidden_layers is 1,000,000,000; more than 10,000 is not a model config
"""

from __future__ import annotations

from typing import Any, Mapping

from hybridkv.errors import InvalidConfigError
from hybridkv.planner.sizes import MAX_TOKENS

__all__ = ["ConfigReader", "REQUIRED", "LIMITS", "DEFAULT_LIMIT"]

#: the largest value a key may hold (real models: <= 200 layers, <= 256 heads, head_dim <= 512)
LIMITS: dict[str, int] = {
    "num_hidden_layers": 10_000,
    "num_attention_heads": 65_536,
    "num_key_value_heads": 65_536,
    "head_dim": 65_536,
    "hidden_size": 2**24,
    # recurrent state dimensions (linear attention, Mamba)
    **dict.fromkeys(("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                     "linear_conv_kernel_dim", "mamba_num_heads", "mamba_head_dim", "mamba_n_heads", "mamba_d_head",
                     "n_groups", "mamba_n_groups", "ssm_state_size", "mamba_d_state", "conv_kernel", "mamba_d_conv",
                     "mamba_expand", "full_attention_interval"), 65_536),
    "mamba_d_ssm": 2**24,
}
#: the bound of every other integer key (token counts: windows, chunks, positions)
DEFAULT_LIMIT = MAX_TOKENS


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


#: marks a key without a default
REQUIRED: Any = _Required()


class ConfigReader:
    """Reads the language-model keys of ``config`` (its ``text_config`` if there is one)."""

    def __init__(self, config: Mapping[str, Any], label: str, defaults: Mapping[str, Any] | None = None):
        self.config = config
        self.label = label
        self.defaults = dict(defaults or {})
        text = config.get("text_config")
        if text is not None and not isinstance(text, dict):
            raise InvalidConfigError(f"{label}: text_config must be a JSON object, got {type(text).__name__}")
        self.text: Mapping[str, Any] = text if text is not None else config
        self.prefix = "text_config." if text is not None else ""

    def where(self, key: str) -> str:
        """The key as a message names it: ``text_config.sliding_window``."""
        return f"{self.prefix}{key}"

    def fail(self, key: str, problem: str) -> InvalidConfigError:
        return InvalidConfigError(f"{self.label}: {self.where(key)} {problem}")

    def get(self, key: str, default: Any = REQUIRED) -> Any:
        """The value of ``key``; else ``default``; else the family default; else an error."""
        if key in self.text:
            return self.text[key]
        if default is not REQUIRED:
            return default
        if key in self.defaults:
            return self.defaults[key]
        raise self.fail(key, "is missing")

    def _bounded(self, key: str, value: int) -> int:
        limit = LIMITS.get(key, DEFAULT_LIMIT)
        if value > limit:
            raise self.fail(key, f"is {value:,}; more than {limit:,} is not a model config")
        return value

    def positive_int(self, key: str, default: Any = REQUIRED) -> int:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise self.fail(key, f"must be a positive integer, got {value!r}")
        return self._bounded(key, value)

    def optional_positive_int(self, key: str, default: Any = REQUIRED) -> int | None:
        """Like :meth:`positive_int`, but JSON ``null`` is allowed and gives None."""
        value = self.get(key, default)
        if value is None:
            return None
        return self.positive_int(key, value)

    def non_negative_int(self, key: str, default: Any = REQUIRED) -> int:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self.fail(key, f"must be a non-negative integer, got {value!r}")
        return self._bounded(key, value)

    def boolean(self, key: str, default: Any = REQUIRED) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, f"must be true or false, got {value!r}")
        return value

    def list_of(self, key: str, item_type: type, length: int, default: Any = None) -> list | None:
        """A list of ``length`` items of ``item_type``; None (or ``[]``) when absent or null."""
        value = self.get(key, default)
        if value is None or value == []:
            return None
        if not isinstance(value, list) or not all(
            isinstance(v, item_type) and not (item_type is int and isinstance(v, bool)) for v in value
        ):
            raise self.fail(key, f"must be a list of {item_type.__name__}, got {value!r}")
        if len(value) != length:
            raise self.fail(key, f"has {len(value)} entries but the model has {length} layers")
        return value

    def dtype(self) -> str | None:
        """``torch_dtype`` / ``dtype`` from text_config, then the top level; None when absent."""
        for scope in (self.text, self.config):
            for key in ("dtype", "torch_dtype"):
                value = scope.get(key)
                if value is not None:
                    if not isinstance(value, str):
                        raise InvalidConfigError(f"{self.label}: {key} must be a string, got {value!r}")
                    return value
        return None

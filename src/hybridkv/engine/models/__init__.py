"""Model families for HF checkpoints, one module each, and the registry that picks one.

``load_model(source)`` takes a model directory, a ``.gguf`` file or an installed model's
name (``gemma-3-270m``, see :mod:`hybridkv.checkpoint`), reads its config (``config.json``
or the GGUF metadata), picks the class by ``architectures[0]`` (falling back to
``model_type``) and loads the weights by HF name. Each class serves one planner family
(:data:`~hybridkv.planner.architectures.FAMILIES`), whose names select it: a
multimodal ``Gemma3ForConditionalGeneration`` / ``Llama4ForConditionalGeneration``
checkpoint loads its language model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from hybridkv.checkpoint.config import as_model_source, read_model_config
from hybridkv.checkpoint.installed import ModelSource
from hybridkv.engine.models.base import CausalLM
from hybridkv.engine.models.gemma3 import Gemma3ForCausalLM
from hybridkv.engine.models.gpt_oss import GptOssForCausalLM
from hybridkv.engine.models.llama import LlamaForCausalLM
from hybridkv.engine.models.llama4 import Llama4ForCausalLM
from hybridkv.engine.models.mistral import MistralForCausalLM
from hybridkv.engine.models.qwen2 import Qwen2ForCausalLM
from hybridkv.engine.models.qwen3 import Qwen3ForCausalLM
from hybridkv.engine.models.qwen3_next import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM
from hybridkv.engine.layers.quantized_linear import check_quantization
from hybridkv.errors import InvalidArgumentError, InvalidConfigError, UnknownArchitectureError

__all__ = [
    "CausalLM",
    "MODEL_CLASSES",
    "ARCHITECTURES",
    "MODEL_TYPES",
    "model_class_for",
    "load_model",
    "resolve_quantization",
    "LlamaForCausalLM",
    "Llama4ForCausalLM",
    "Gemma3ForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "GptOssForCausalLM",
]

MODEL_CLASSES: tuple[type[CausalLM], ...] = (
    LlamaForCausalLM,
    Llama4ForCausalLM,
    Gemma3ForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    Qwen3NextForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    GptOssForCausalLM,
)

#: HF ``architectures[0]`` -> class
ARCHITECTURES: dict[str, type[CausalLM]] = {a: cls for cls in MODEL_CLASSES for a in cls.architectures}
#: HF ``model_type`` -> class
MODEL_TYPES: dict[str, type[CausalLM]] = {t: cls for cls in MODEL_CLASSES for t in cls.model_types}


def model_class_for(config: Mapping[str, Any]) -> type[CausalLM]:
    """The class for ``config``: by ``architectures[0]``, else by ``model_type``."""
    archs = config.get("architectures") or []
    if archs and archs[0] in ARCHITECTURES:
        return ARCHITECTURES[archs[0]]
    model_type = config.get("model_type")
    if not archs and model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    named = archs[0] if archs else model_type
    raise UnknownArchitectureError(
        f"unsupported architecture {named!r}; supported architectures: {sorted(ARCHITECTURES)} "
        f"(model types {sorted(MODEL_TYPES)})"
    )


def resolve_quantization(quantization: str | None, source: str | Path | ModelSource, dtype: str = "float32",
                         device: str = "cpu") -> str | None:
    """The weight form a ``quantization`` choice gives for ``source`` (None: the exact weights).

    ``"auto"``: ``"gguf"`` (the file's quantized blocks run as stored) for a GGUF checkpoint on a
    CPU in ``float32`` where the C kernels build; else None (a safetensors checkpoint, ``--device
    cuda``, another dtype: the weights dequantized to ``dtype``). ``"none"`` / None: None. Any other
    choice as it is (``"gguf"`` for a non-GGUF checkpoint is an InvalidConfigError).
    """
    if quantization in (None, "none"):
        return None
    if quantization not in ("auto", "gguf"):
        return quantization
    try:
        kind = as_model_source(source).kind
    except InvalidArgumentError:  # not a model: the load says so (the other settings are checked first)
        return None if quantization == "auto" else quantization
    if quantization == "auto":
        from hybridkv.engine.layers.gguf_linear import native_available

        cpu = torch.device(device).type == "cpu"
        return "gguf" if kind == "gguf" and cpu and str(dtype) == "float32" and native_available() else None
    if quantization == "gguf" and kind != "gguf":
        raise InvalidConfigError(f"quantization gguf runs a GGUF file's own blocks; {source} is not a GGUF checkpoint")
    return quantization


def load_model(
    source: str | Path | ModelSource, dtype: str = "float32", device: str = "cpu", prepack: bool = True,
    quantization: str | None = None,
) -> CausalLM:
    """Build the model of ``source`` (a directory, a .gguf file, a name) and load its weights
    (``prepack``: CausalLM.prepack_weights; ``quantization``: a choice :func:`resolve_quantization`
    resolves: "int8" / "int4" CausalLM.quantize_weights, "gguf" the file's blocks as stored)."""
    source = as_model_source(source)
    config = read_model_config(source)
    quantization = resolve_quantization(quantization, source, dtype, device)
    check_quantization(quantization, device)
    return model_class_for(config).from_config(config, source, dtype=dtype, device=device, prepack=prepack,
                                               quantization=quantization)

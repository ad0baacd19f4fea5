"""Memory planner: from a Hugging Face ``config.json`` and a byte budget to a KV cache layout.

    config.json ──architectures──► per-layer specs ──grouping──► groups of equal size
                                                            └──budget──► blocks, concurrency

* :mod:`~hybridkv.planner.sizes`: "80GiB", "1M" and friends.
* :mod:`~hybridkv.planner.presets`: bundled configs, reading ``config.json``.
* :mod:`~hybridkv.planner.architectures`: each layer's spec, one function per family.
* :mod:`~hybridkv.planner.grouping`: layers into groups that share tensors by position.
* :mod:`~hybridkv.planner.plan`: blocks for a budget; hybrid vs all-full side by side.
* :mod:`~hybridkv.planner.report`: the text table and the JSON form.

Torch-free: importing this package never imports torch.

>>> plan = plan_model("llama4-scout", memory="80GiB", max_model_len="1M")
>>> plan.kv_cache_config.num_blocks, len(plan.kv_cache_config.groups)
(109226, 4)
"""

from hybridkv.planner.architectures import FAMILIES, ModelLayers, find_family, model_layers, supported_architectures
from hybridkv.planner.grouping import GroupSizeOption, Grouping, LayerGroup, group_layers, group_size_options
from hybridkv.planner.plan import (
    LayoutPlan,
    MemoryPlan,
    SharedTensor,
    full_attention_grouping,
    layout_plan,
    max_context_tokens,
    plan_memory,
    plan_model,
)
from hybridkv.planner.presets import PRESETS, ModelSource, Preset, find_preset, load_model_config, preset_names
from hybridkv.planner.report import plan_to_dict, render_plan
from hybridkv.planner.sizes import format_bytes, format_tokens, parse_bytes, parse_tokens

__all__ = [
    "FAMILIES",
    "GroupSizeOption",
    "Grouping",
    "LayerGroup",
    "LayoutPlan",
    "MemoryPlan",
    "ModelLayers",
    "ModelSource",
    "PRESETS",
    "Preset",
    "SharedTensor",
    "find_family",
    "find_preset",
    "format_bytes",
    "format_tokens",
    "full_attention_grouping",
    "group_layers",
    "group_size_options",
    "layout_plan",
    "load_model_config",
    "max_context_tokens",
    "model_layers",
    "parse_bytes",
    "parse_tokens",
    "plan_memory",
    "plan_model",
    "plan_to_dict",
    "preset_names",
    "render_plan",
    "supported_architectures",
]

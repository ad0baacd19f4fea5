"""The torch side of hybridkv: paged KV storage, reference paged attention, models, runner.

Needs the ``[engine]`` extra (torch, safetensors). Nothing outside this package
imports torch.

    storage = PagedKVStorage(groups, block_size, num_blocks, num_kv_heads, head_size)
    model = load_model("path/to/hf_checkpoint")
    runner = PagedModelRunner(model, storage)
    tokens = runner.execute(scheduler_output)      # {request_id: token}
"""

from hybridkv.engine.attention import AttentionMetadata, AttentionType, paged_attention
from hybridkv.engine.kv_storage import PagedKVStorage
from hybridkv.engine.model_runner import PagedModelRunner
from hybridkv.engine.models import load_model

__all__ = ["AttentionMetadata", "AttentionType", "PagedKVStorage", "PagedModelRunner", "load_model", "paged_attention"]

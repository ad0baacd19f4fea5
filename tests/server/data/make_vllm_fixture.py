"""Write the golden KV event batches with vLLM's own classes (run once, in the bench venv).

    /work/.venv-vllm/bin/python tests/server/data/make_vllm_fixture.py

Writes ``vllm_<name>.bin`` (vLLM 0.33's ``msgspec.msgpack.encode(KVEventBatch(...))``) next
to this file for every batch in :data:`BATCHES`. CI never runs this (it needs vLLM); it
only reads the .bin files and imports :data:`BATCHES` (plain data, no vLLM import) to
know what they hold (tests/server/test_kv_events.py).
"""

from __future__ import annotations

from pathlib import Path

H = [bytes([i]) * 32 for i in range(1, 8)]  # stand-in 32-byte block hashes

#: name -> (ts, data_parallel_rank, [(event class name, keyword arguments)])
BATCHES = {
    # what hybridkv publishes for a step of a full + sliding (12) + chunked (8) model
    "hybridkv_step": (1700000000.25, 0, [
        ("BlockStored", dict(block_hashes=[H[0], H[1]], parent_block_hash=None, token_ids=list(range(1, 9)),
                             block_size=4, lora_id=None, medium="GPU", lora_name=None, group_idx=0,
                             kv_cache_spec_kind="full_attention")),
        ("BlockStored", dict(block_hashes=[H[2]], parent_block_hash=H[1], token_ids=[9, 10, 11, 12], block_size=4,
                             lora_id=None, medium="GPU", lora_name=None, group_idx=1,
                             kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=12)),
        ("BlockStored", dict(block_hashes=[H[0], H[1], H[2]], parent_block_hash=None, token_ids=list(range(1, 13)),
                             block_size=4, lora_id=None, medium="GPU", lora_name=None, group_idx=2,
                             kv_cache_spec_kind="chunked_local_attention", kv_cache_spec_sliding_window=8)),
        ("BlockRemoved", dict(block_hashes=[H[3]], medium="GPU", group_idx=1)),
        ("AllBlocksCleared", {}),
    ]),
    # vLLM-only fields and int hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES): our decoder must read them
    "extras": (1700000001.5, 2, [
        ("BlockStored", dict(block_hashes=[123456789, 2**63 + 5], parent_block_hash=42, token_ids=[5, 6, 7, 8],
                             block_size=2, lora_id=3, medium="CPU", lora_name="adapter",
                             extra_keys=[("adapter", "salt"), None], group_idx=0,
                             kv_cache_spec_kind="mla_attention", locality="LOCAL", ownership="tier2",
                             session_id="sess-1", lookahead_token_ids=[[7], [9]])),
        ("BlockRemoved", dict(block_hashes=[123456789, H[4]], medium=None, group_idx=0, locality="REMOTE",
                              ownership="tier2")),
    ]),
    # a batch with no events and no data-parallel rank
    "empty": (0.5, None, []),
}


def main() -> None:
    import msgspec
    from vllm.distributed import kv_events as v

    out = Path(__file__).parent
    for name, (ts, rank, events) in BATCHES.items():
        batch = v.KVEventBatch(ts=ts, events=[getattr(v, cls)(**kw) for cls, kw in events], data_parallel_rank=rank)
        data = msgspec.msgpack.encode(batch)
        (out / f"vllm_{name}.bin").write_bytes(data)
        print(f"vllm_{name}.bin: {len(data)} bytes")


if __name__ == "__main__":
    main()

"""The two real GGUF checkpoints, loaded by us and by transformers 5.24 from the same file.

- state: our dequantized fp32 weights equal transformers' exactly (``torch.equal``; both
  call ``gguf.quants.dequantize`` and undo llama.cpp's layouts the same way), and the config
  we build from the metadata is the one transformers builds;
- Gemma 3 270M (sliding window 512, every 6th layer full): greedy tokens through
  ``LLMEngine`` (block 16) equal HF ``generate`` for prompts of 640-1,500 tokens (past the
  window, several windows deep), the second request hitting the prefix cache on 1,024
  tokens the first one left, in a pool tight enough that a request is preempted;
- SmolLM2-135M-Instruct: greedy tokens equal HF ``generate`` for chat prompts rendered by
  HF's tokenizer (its chat template from the GGUF).

Each model loads once per session (ours through a private tensor cache).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.support.hf_tiny import hf_generate  # noqa: E402

from hybridkv.checkpoint import GGUFFile, read_model_config  # noqa: E402
from hybridkv.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from hybridkv.scheduler import SamplingParams  # noqa: E402

pytestmark = [pytest.mark.real, pytest.mark.slow]

NEW = 16
#: fp32 logits of ours vs HF generate's (measured 2.7e-4, 3.7e-4, 7.6e-5 for A, B, C)
LOGIT_TOL = 1e-3


def _assert_same_state(ours, hf):
    mine, theirs = ours.state_dict(), hf.state_dict()
    assert set(mine) == set(theirs)
    for name, want in theirs.items():
        got = mine[name]
        assert got.dtype == want.dtype == torch.float32, name
        assert torch.equal(got, want), f"{name}: max diff {(got - want).abs().max().item():.3g}"


def _assert_same_config(path: Path, hf_config):
    theirs = hf_config.to_dict()
    for key, value in read_model_config(path).items():
        if key == "architectures":
            continue
        assert theirs[key] == value, key


def test_gemma_state_and_config_equal_transformers(our_gemma, hf_gemma, gemma_gguf, real_cache):
    _assert_same_state(our_gemma, hf_gemma)
    _assert_same_config(gemma_gguf, hf_gemma.config)
    kinds = our_gemma.layer_attention_types()
    assert kinds == [("full", None) if i % 6 == 5 else ("sliding", 512) for i in range(18)]
    assert our_gemma.source.name == "gemma-3-270m" or our_gemma.source.path == gemma_gguf
    assert len(list(real_cache.glob("gguf-*.safetensors"))) >= 1  # written on the way


def test_smollm_state_and_config_equal_transformers(our_smollm, hf_smollm, smollm_gguf):
    _assert_same_state(our_smollm, hf_smollm)
    _assert_same_config(smollm_gguf, hf_smollm.config)
    assert our_smollm.eos_token_ids == (2,) and our_smollm.tie_word_embeddings


# ------------------------------------------------------------------ Gemma: long prompts
def _gemma_prompts(path: Path) -> dict[str, list[int]]:
    """Token ids of seeded English-like sentences (words looked up in the GGUF vocabulary):
    A = P + 476 tokens, B = P + 300 others (P: 1,024 shared tokens), C = 640 tokens of its own."""
    vocab = {t: i for i, t in enumerate(GGUFFile.open(path).metadata["tokenizer.ggml.tokens"])}
    names, places = ["▁Alice", "▁Bob", "▁Carol"], ["▁market", "▁garden", "▁house"]
    counts, colors = ["▁two", "▁three", "▁five"], ["▁red", "▁green"]
    rng = random.Random(11)

    def text(n: int) -> list[int]:
        ids: list[int] = []
        while len(ids) < n:
            words = [rng.choice(names), "▁went", "▁to", "▁the", rng.choice(places), "▁and", "▁bought",
                     rng.choice(counts), rng.choice(colors), "▁apples", "."]
            ids += [vocab[w] for w in words]
        return ids[:n]

    bos = 2
    prefix = [bos] + text(1023)
    return {"A": prefix + text(476), "B": prefix + text(300), "C": [bos] + text(639)}


@pytest.fixture(scope="session")
def gemma_refs(hf_gemma, gemma_gguf):
    prompts = _gemma_prompts(gemma_gguf)
    return prompts, {k: hf_generate(hf_gemma, p, NEW) for k, p in prompts.items()}


def _run(engine: LLMEngine, prompts: dict[str, list[int]]) -> tuple[dict, dict]:
    """Step ``engine`` through ``prompts`` (greedy, NEW tokens); outputs and per-request sampled logits."""
    sp = SamplingParams(max_tokens=NEW)
    for rid, prompt in prompts.items():
        engine.add_request(prompt, sp, request_id=rid)
    logits: dict[str, list[torch.Tensor]] = {rid: [] for rid in prompts}
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
        for rid, row in engine.last_logits.items():
            logits[rid].append(row.reshape(-1))
        engine.scheduler.check_invariants()
    return outs, {rid: torch.stack(rows) for rid, rows in logits.items() if rows}


def test_gemma_long_prompts_prefix_hit_and_preemption_match_hf_generate(our_gemma, gemma_refs):
    prompts, refs = gemma_refs
    assert [len(prompts[k]) for k in "ABC"] == [1500, 1324, 640]
    # 460 blocks of 16: A alone, then B (1,024 tokens from A's cached blocks) and C together do not
    # fit as they grow (first-chunk admission, 512-token steps): one of them is preempted
    engine = LLMEngine(our_gemma, EngineConfig(block_size=16, num_blocks=460, max_num_batched_tokens=512,
                                               admission="first_chunk", max_num_seqs=4))
    outs, logits = _run(engine, {"A": prompts["A"]})
    more, more_logits = _run(engine, {"B": prompts["B"], "C": prompts["C"]})
    outs.update(more)
    logits.update(more_logits)
    for rid, (tokens, hf_logits) in refs.items():
        assert list(outs[rid].output_token_ids) == tokens, rid
        diff = (logits[rid][-len(tokens):] - hf_logits).abs().max().item()
        print(f"Gemma request {rid}: {len(prompts[rid])} prompt tokens, max |logit diff| vs HF {diff:.2e}")
        assert diff < LOGIT_TOL, rid
    assert outs["B"].num_cached_tokens >= 1024
    assert sum(o.num_preemptions for o in outs.values()) >= 1


# ------------------------------------------------------------------ SmolLM2: chat
def test_smollm_chat_matches_hf_generate(our_smollm, hf_smollm, hf_smollm_tokenizer):
    chats = [
        [{"role": "user", "content": "What is the capital of Germany?"}],
        [{"role": "system", "content": "Answer in one short sentence."},
         {"role": "user", "content": "Name a colour of the sky."}],
    ]
    prompts = [hf_smollm_tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True) for c in chats]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    refs = [hf_generate(hf_smollm, p, 24)[0] for p in prompts]
    engine = LLMEngine(our_smollm, EngineConfig(block_size=16, num_blocks=256, max_num_seqs=2))
    outs = engine.generate(prompts, SamplingParams(max_tokens=24))
    for out, want in zip(outs, refs):
        got = list(out.output_token_ids)
        stop = want.index(2) + 1 if 2 in want else len(want)  # HF pads after EOS; we stop at it
        assert got == want[:stop]
    assert "Berlin" in hf_smollm_tokenizer.decode(outs[0].output_token_ids)

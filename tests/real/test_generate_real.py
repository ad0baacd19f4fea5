"""Text in, text out on the two real GGUF models, against transformers loading the same files.

- Gemma 3 270M (sliding window 512, every 6th layer full): a ~1,500-token text prompt (three
  windows deep) through :class:`LLM` gives transformers' greedy tokens and text, with the
  hybrid layout and with ``hybrid=False`` (every layer's KV as full attention), which hold
  different blocks and give the same tokens;
- SmolLM2-135M-Instruct: a chat through :class:`LLM` (the GGUF's tokenizer and chat
  template) gives transformers' greedy chat answer, "The capital of Germany is Berlin.";
- ``hybridkv generate gemma-3-270m --prompt ...`` (one subprocess: it loads the model)
  streams the text and ends with the one summary line.

Our models and transformers' come from the session fixtures (tests/real/conftest.py), each loaded once.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from tests.support.hf_tiny import hf_generate  # noqa: E402

from hybridkv.engine.engine import EngineConfig  # noqa: E402
from hybridkv.engine.llm import LLM  # noqa: E402
from hybridkv.scheduler import SamplingParams  # noqa: E402

pytestmark = [pytest.mark.real, pytest.mark.slow]

NEW = 8
WORDS = ("river stone lantern harbor meadow copper falcon willow orchard signal ember canyon "
         "marble thistle beacon glacier saffron timber violet quarry").split()


def long_text(tokenizer, n_tokens: int, seed: int = 0) -> str:
    """Seeded sentences until the text holds about ``n_tokens`` tokens."""
    rng = random.Random(seed)
    sentences = []
    while True:
        sentences.append(f"On day {len(sentences) + 1} the {rng.choice(WORDS)} met the {rng.choice(WORDS)} "
                         f"near the {rng.choice(WORDS)}.")
        if len(sentences) % 2 == 0 and len(tokenizer(" ".join(sentences)).input_ids) >= n_tokens:
            return " ".join(sentences) + " The last thing the falcon saw was"


# first in the module: the subprocess loads Gemma while this process holds none of our models yet
def test_cli_streams_gemma_text_and_one_summary_line():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, "-m", "hybridkv", "generate", "gemma-3-270m", "--prompt", "The capital of France is",
         "--max-tokens", "8"], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(" the capital of the country of France")
    lines = [ln for ln in proc.stderr.splitlines() if not ln.startswith("hybridkv: building the CPU kernels once")]
    assert len(lines) == 1, proc.stderr  # the summary (and the kernels' one-time build line, on a cold cache)
    summary = lines[0]
    assert summary.startswith("1 prompt: 6 prompt + 8 output tokens; TTFT ")
    assert "; weights gguf; " in summary  # the default runs the GGUF's own blocks
    assert "KV blocks peak full 1, sliding(512) 5x1" in summary and "prefix hits 0 tokens" in summary
    assert "KV/request at 32,768 tokens 267.47 MiB hybrid vs 1.12 GiB all-full (all-full / hybrid 4.31x)" in summary


@pytest.fixture(scope="module")
def gemma_llm(our_gemma):
    return lambda hybrid: LLM(our_gemma, EngineConfig(
        block_size=16, num_blocks=450, max_model_len=2048, max_num_batched_tokens=512, hybrid=hybrid))


def test_gemma_long_prompt_hybrid_and_no_hybrid_equal_transformers(gemma_llm, hf_gemma, hf_gemma_tokenizer):
    text = long_text(hf_gemma_tokenizer, 1500)
    ids = hf_gemma_tokenizer(text).input_ids
    assert 1500 <= len(ids) < 1560  # past the 512 window, about three windows deep
    want = hf_generate(hf_gemma, ids, NEW)[0]
    want_text = hf_gemma_tokenizer.decode(ids + want, skip_special_tokens=True)[len(
        hf_gemma_tokenizer.decode(ids, skip_special_tokens=True)):]
    sp = SamplingParams(max_tokens=NEW, ignore_eos=True)
    hybrid, full = gemma_llm(True), gemma_llm(False)
    [h] = hybrid.generate([text], sp)
    [f] = full.generate([text], sp)
    assert list(h.prompt_token_ids) == ids  # the GGUF's tokenizer encodes as transformers' (BOS first)
    assert list(h.token_ids) == list(f.token_ids) == want
    assert h.text == f.text == want_text
    hs, fs = hybrid.engine.kv_summary(), full.engine.kv_summary()
    sliding = [g for g in hs.groups if g.kind == "sliding_window"]
    assert sliding and all(g.size == 512 for g in sliding) and len(fs.groups) == 1
    assert hs.peak_bytes < fs.peak_bytes and hs.kv_bytes_per_request < fs.kv_bytes_per_request


def test_smollm_chat_through_llm_equals_transformers(our_smollm, hf_smollm, hf_smollm_tokenizer):
    llm = LLM(our_smollm, EngineConfig(block_size=16, num_blocks=64, max_model_len=512))
    chat = [{"role": "user", "content": "What is the capital of Germany?"}]
    want_ids = hf_smollm_tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    want_ids = list(want_ids["input_ids"] if hasattr(want_ids, "keys") else want_ids)
    assert llm.encode(chat) == want_ids
    want = hf_generate(hf_smollm, want_ids, 20)[0]
    [out] = llm.generate([chat], SamplingParams(max_tokens=20))
    assert out.text == "The capital of Germany is Berlin."
    assert list(out.token_ids) == want and out.finish_reason == "stop"  # both end at <|im_end|>

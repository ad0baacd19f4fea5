"""The text front ``LLM`` on a tiny Gemma 3 (sliding windows) with a character-level tokenizer.

The tokenizer is written with the ``tokenizers`` library (SentencePiece-style ``▁`` spaces,
multi-byte characters, special tokens, a chat template) into a copy of the tiny model's
directory, so the checkpoint carries it as a real one does. transformers, loading the same
files, is the reference: prompt ids, chat rendering, greedy tokens and the text they decode
to in context (``decode(prompt + output)`` minus ``decode(prompt)``, as vLLM streams it).
"""

from __future__ import annotations

import random
import shutil

import pytest
from tests.support.hf_tiny import hf_generate
from tests.support.tiers import slow_except
from tests.support.tiny_tokenizer import write_tokenizer

from hybridkv.engine.engine import EngineConfig
from hybridkv.engine.llm import LLM, CompletionOutput, TextDelta
from hybridkv.engine.models import load_model
from hybridkv.errors import ChatTemplateError, InvalidArgumentError, PromptTooLongError, TokenizerError
from hybridkv.scheduler import SamplingParams

pytest.importorskip("tokenizers")

NEW = 12


@pytest.fixture(scope="module")
def tiny(tiny_models, tmp_path_factory):
    """(model dir with a tokenizer, HF model, HF tokenizer, our loaded model)."""
    from transformers import AutoTokenizer

    src, hf = tiny_models("gemma3")
    path = tmp_path_factory.mktemp("gemma3-text")
    shutil.copytree(src, path, dirs_exist_ok=True)
    write_tokenizer(path)
    return path, hf, AutoTokenizer.from_pretrained(str(path)), load_model(path)


@pytest.fixture(scope="module")
def llm(tiny):
    path, _, _, model = tiny
    from hybridkv.tokenizer import load_tokenizer

    return LLM(model, EngineConfig(block_size=4, num_blocks=300, max_model_len=256, max_num_batched_tokens=24),
               tokenizer=load_tokenizer(path))


def reference(tiny, prompt_ids: list[int], n: int = NEW) -> tuple[list[int], str]:
    """HF's greedy tokens and their text in context."""
    _, hf, hf_tok, _ = tiny
    out = hf_generate(hf, prompt_ids, n)[0]
    full = hf_tok.decode(prompt_ids + out, skip_special_tokens=True)
    return out, full[len(hf_tok.decode(prompt_ids, skip_special_tokens=True)):]


PROMPTS = ["the quick brown fox jumps over", "héllo 世界, how are you?", "a", "Zebra crossing near the olive grove"]


def test_generate_text_equals_hf(tiny, llm):
    _, _, hf_tok, _ = tiny
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
    assert [o.prompt_token_ids for o in outs] == [tuple(hf_tok(p).input_ids) for p in PROMPTS]
    for p, o in zip(PROMPTS, outs):
        tokens, text = reference(tiny, hf_tok(p).input_ids)
        assert isinstance(o, CompletionOutput)
        assert list(o.token_ids) == tokens and o.text == text and o.finish_reason == "length"
        assert o.time_to_first_token is not None and o.time_to_first_token >= 0
    again = llm.generate([PROMPTS[3]], SamplingParams(max_tokens=2, ignore_eos=True))[0]
    assert again.num_cached_tokens >= 32  # the same prompt hits its cached blocks
    assert not llm.engine.has_unfinished_requests()


def test_stream_deltas_add_up_per_prompt(tiny, llm):
    deltas = list(llm.stream(PROMPTS[:3], SamplingParams(max_tokens=NEW, ignore_eos=True)))
    assert all(isinstance(d, TextDelta) for d in deltas)
    for i, p in enumerate(PROMPTS[:3]):
        mine = [d for d in deltas if d.index == i]
        assert sum(d.finished for d in mine) == 1 and mine[-1].finished
        assert "".join(d.text for d in mine) == mine[-1].output.text == reference(tiny, tiny[2](p).input_ids)[1]
        assert sum(len(d.token_ids) for d in mine) == NEW


def test_chat_prompt_is_rendered_and_encoded_as_transformers_does(tiny, llm):
    _, _, hf_tok, _ = tiny
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is up?"}]
    want = hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert llm.encode(messages) == list(want)
    out = llm.generate([messages], SamplingParams(max_tokens=NEW, ignore_eos=True))[0]
    assert (list(out.token_ids), out.text) == reference(tiny, list(want))


@pytest.mark.parametrize("seed", slow_except(range(6), 0))
def test_stop_strings_cut_the_text_and_abort_the_request(tiny, llm, seed):
    """A stop string taken from the reference text ends the output just before it; the request
    is aborted at once (blocks freed, fewer tokens than max_tokens when the stop comes early)."""
    rng = random.Random(seed)
    prompt = rng.choice(PROMPTS)
    ids = tiny[2](prompt).input_ids
    tokens, text = reference(tiny, ids, 20)
    if len(text) < 4:
        pytest.skip("reference text too short")
    start = rng.randrange(0, len(text) - 2)
    stop = text[start : start + rng.randint(1, 3)]
    cut = text.find(stop)
    out = llm.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True, stop=(stop, "never-in-it")))[0]
    assert out.text == text[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    assert list(out.token_ids) == tokens[: len(out.token_ids)]
    # the request stopped at the token that completed the stop string
    done = len(tiny[2].decode(ids + tokens[: len(out.token_ids)], skip_special_tokens=True))
    assert done - len(tiny[2].decode(ids, skip_special_tokens=True)) >= cut + len(stop)
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv.usage == 0.0
    llm.engine.scheduler.check_invariants()


def test_early_close_aborts_and_bad_prompts_change_nothing(tiny, llm):
    it = llm.stream(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
    next(it)
    it.close()
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv.usage == 0.0
    for prompts, err in [
        ([PROMPTS[0], "x" * 300], PromptTooLongError),  # the first was queued, then taken back
        ([PROMPTS[0], ""], InvalidArgumentError),
        ([PROMPTS[0], []], InvalidArgumentError),
        ([[{"role": "user"}]], InvalidArgumentError),
        ([[1, 2, 999]], InvalidArgumentError),
        ([b"bytes"], InvalidArgumentError),
    ]:
        with pytest.raises(err):
            llm.generate(prompts, SamplingParams(max_tokens=2))
        assert not llm.engine.has_unfinished_requests() and not llm.engine.scheduler.sequences
    with pytest.raises(InvalidArgumentError, match="2 sampling params for 1"):
        llm.generate(["a"], [SamplingParams(), SamplingParams()])


def test_eos_of_the_tokenizer_stops_unless_ignored(llm):
    assert 2 in llm.eos_token_ids  # "</s>" from tokenizer_config.json (the tiny model has no EOS)
    assert 2 in llm._sampling(SamplingParams()).stop_token_ids
    assert 2 not in llm._sampling(SamplingParams(ignore_eos=True)).stop_token_ids


def test_tokenizer_from_the_checkpoint_and_its_errors(tiny, tiny_models, tmp_path):
    path, _, _, model = tiny
    from hybridkv.tokenizer import ByteTokenizer

    with pytest.raises(TokenizerError, match="262"):  # ids past the model's 128
        LLM(model, EngineConfig(block_size=4, num_blocks=40), tokenizer=ByteTokenizer(vocab_size=262))
    no_tok = LLM(load_model(tiny_models("gemma3")[0]), EngineConfig(block_size=4, num_blocks=40, max_model_len=64))
    assert no_tok.tokenizer is None  # a directory without tokenizer.json, and 128 ids < 256: none
    with pytest.raises(TokenizerError, match="needs a tokenizer"):
        no_tok.generate(["hi"])
    with pytest.raises(TokenizerError, match="needs a tokenizer"):
        no_tok.generate([[1, 2]], SamplingParams(stop=("x",)))
    [out] = no_tok.generate([[5, 6, 7]], SamplingParams(max_tokens=3))
    assert out.text == "" and len(out.token_ids) == 3
    by_path = LLM(str(path), EngineConfig(block_size=4, num_blocks=40, max_model_len=64))
    assert by_path.tokenizer.vocab_size == 128 and by_path.encode("ab") == [1, 6, 7, 8]  # tokenizer.json: <s> ▁ a b
    raising = tmp_path / "raising"
    shutil.copytree(path, raising)
    write_tokenizer(raising, template="{{ raise_exception('no chats here') }}")
    from hybridkv.tokenizer import load_tokenizer

    bad = LLM(model, EngineConfig(block_size=4, num_blocks=40), tokenizer=load_tokenizer(raising))
    with pytest.raises(ChatTemplateError, match="no chats here"):
        bad.generate([[{"role": "user", "content": "hi"}]])
    assert not bad.engine.scheduler.sequences


def test_sampling_params_stop_is_checked():
    assert SamplingParams(stop="ab").stop == ("ab",)
    assert SamplingParams(stop=["a", "a", "b"]).stop == ("a", "b")
    for bad in ("", ("a", ""), (1,), 5):
        with pytest.raises(InvalidArgumentError, match="stop"):
            SamplingParams(stop=bad)

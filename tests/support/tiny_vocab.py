"""GGUF-shaped tokenizer metadata for tiny vocabularies (what ``GGUFFile.metadata`` gives)."""

from __future__ import annotations

from tests.support.texts import FRAGMENTS, texts

CHAT = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CORPUS = FRAGMENTS * 3 + texts(200, seed=1)


def bpe_metadata(vocab_size: int = 600) -> dict:
    """Byte-level BPE with merges, trained here (SmolLM2-like: control tokens first)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    import json

    model = json.loads(tok.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if t in specials else 1 for t in tokens],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.padding_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHAT,
    }


def spm_metadata(vocab_size: int = 700) -> dict:
    """Gemma-like: <pad> <eos> <bos> <unk> <mask>, a user-defined token, 256 byte tokens, then
    ▁-spelled pieces (trained here) in merge order, one '  ' (real spaces) token; no merges."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    import json

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, limit_alphabet=100, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    model = json.loads(tok.to_str())["model"]
    # Gemma's file order is its merge order: single characters first, then each merge's result
    pieces = [t for t in sorted(model["vocab"], key=model["vocab"].get) if len(t) == 1]
    for m in model["merges"]:
        left, right = m.split(" ") if isinstance(m, str) else m
        if left + right not in pieces:
            pieces.append(left + right)
    head = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "[multimodal]", "<start_of_turn>", "<end_of_turn>"]
    types = [3, 3, 3, 2, 3, 4, 3, 3]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    pieces = [p for p in pieces if p not in head and p not in byte_tokens]
    tokens = head + byte_tokens + pieces + ["  ", "<unused0>", "<unused1>"]
    types += [6] * 256 + [1] * len(pieces) + [1, 5, 5]
    return {
        "general.architecture": "gemma3",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [-1000.0 if t != 1 else 0.0 for t in types],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.ggml.add_space_prefix": False,
    }

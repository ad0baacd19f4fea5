"""Seeded realistic / nasty texts shared by the tokenizer tests (no model needed)."""

from __future__ import annotations

import random

FRAGMENTS = [
    "The capital of France is Paris.", "Hello, world!", "  leading spaces", "trailing spaces   ", "tabs\tand\ttabs",
    "line one\nline two\n\nline four", "\r\n windows \r\n", "def f(x):\n    return x ** 2  # square\n",
    "naïve café résumé", "Straße", "e\u0301 combining acute", "a\u0308\u0304 stacked marks", "日本語のテキスト",
    "中文文本，标点。", "한국어 문장", "emoji 😀🎉👍🏽 and 👨‍👩‍👧 family", "🇫🇷🇩🇪 flags", "Ελληνικά", "русский текст",
    "עברית", "العربية", "हिन्दी", "math ∑ ∫ √ ≤ ≥ ≠ ∞", "numbers 1234567890 3.14159 -42 1e-9", "https://example.com/a?b=c&d=e",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<bos>", "<eos>", "<pad>", "<start_of_turn>user", "<end_of_turn>",
    "<unused0>", "<mask>", "<0x41>", "<s>", "</s>", "[multimodal]", "<image_soft_token>", "<|im_start", "im_end|>",
    "\u2581word", "▁▁", "  ", "    ", "\n\n\n", " \n ", "\t", "'s 've 're n't", "CamelCaseIdentifier", "snake_case_name",
    "ALL CAPS TEXT", "punctuation!!! ??? ... ---", "\u00a0nbsp\u00a0", "zero\u200bwidth", "\ufeffbom", "\ufffd",
    "a" * 40, "ab" * 25, "\u3000ideographic space", "ｆｕｌｌｗｉｄｔｈ", "½ ¼ ¾", "℃ ™ ©",
]

RANGES = [(0x20, 0x7E), (0xA0, 0x24F), (0x300, 0x36F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x6FF), (0x900, 0x97F),
          (0x3040, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1FAFF), (0x2000, 0x206F), (0x10000, 0x1007F)]


def random_char(rng: random.Random) -> str:
    lo, hi = rng.choice(RANGES)
    return chr(rng.randint(lo, hi))


def random_text(rng: random.Random, max_parts: int = 6) -> str:
    parts = []
    for _ in range(rng.randint(1, max_parts)):
        r = rng.random()
        if r < 0.55:
            parts.append(rng.choice(FRAGMENTS))
        elif r < 0.8:
            parts.append("".join(random_char(rng) for _ in range(rng.randint(1, 12))))
        else:
            parts.append(rng.choice([" ", "  ", "\n", "\t", " \n", "\n\n ", "   "]))
    return rng.choice(["", " ", "\n"]).join(parts) if rng.random() < 0.5 else "".join(parts)


def texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [random_text(rng) for _ in range(n)]

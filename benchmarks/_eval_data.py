"""The eval set of ``eval_parity.py``: seeded, generated here (nothing downloaded), and its scorer.

RULER-style needle-in-a-haystack retrieval (Hsieh et al. 2024; the generator is ours)
plus a short-answer QA set. Every item is a function of ``(seed, task, length, index)``
and of the model's tokenizer, which sizes the haystack::

    items = make_items(["niah_single", "qa"], [1024, 2048], 4, seed=0,
                       count_tokens=lambda text: len(tok.encode(text)), render=completion_prompt)

Tasks (RULER's closest task in brackets):

- ``niah_single``  one needle "The special magic number for <key> is <7 digits>." in a
  repeated noise haystack ("The grass is green. ..."); ask it.  [niah_single_1]
- ``niah_multikey`` four needles with different keys in an essay-like haystack of
  generated sentences; each asked in turn: four items sharing one context, so a prefix
  cache serves the context of the last three (hybrid prefix hits get exercised too).
  [niah_multikey_1, which asks one]
- ``niah_multivalue`` four needles with one key and four values; ask all.  [niah_multivalue]
- ``qa`` a short passage (a made-up biography, a small sum, or real capitals) and a
  question whose answer is in it; ``length`` is 0.

Length: ``length`` bounds prompt plus answer, as RULER's ``max_seq_length``: the rendered
prompt (``render``, counted by ``count_tokens``, special tokens included) takes at most
``length - max_tokens`` tokens and is within one haystack sentence of it. Depth: the
asked needles of the n haystacks at one length (multikey: their 4n needles) sit at
``100 * i / (n - 1)`` percent of the haystack's sentences (0 = first, 100 = last),
shuffled over the items by the seed; other needles go at seeded random depths. Scoring (:func:`score`): the fraction of the
gold strings found, after SQuAD-style normalisation, as whole words in the first line of
the output (RULER's ``string_match_all``, on words rather than characters).
"""

from __future__ import annotations

import hashlib
import itertools
import random
import re
import string
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

__all__ = [
    "TASKS",
    "NIAH_TASKS",
    "Item",
    "make_items",
    "make_haystack_items",
    "make_qa_item",
    "completion_prompt",
    "chat_prompt",
    "normalize",
    "score",
    "exact_match",
]

NIAH_TASKS = ("niah_single", "niah_multikey", "niah_multivalue")
TASKS = NIAH_TASKS + ("qa",)
NUM_NEEDLES = 4  # distractor keys (multikey) / values (multivalue), as RULER's defaults
MAX_TOKENS = {"niah_single": 16, "niah_multikey": 16, "niah_multivalue": 96, "qa": 16}

NOISE = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
ADJECTIVES = (
    "amber ancient bitter brave brisk calm clever crimson curious dusty eager faint fierce gentle "
    "glossy golden hollow humble icy jolly kind lively lonely loud mellow misty modest narrow noble "
    "odd pale patient proud quick quiet rapid rough rustic sandy shy silent silver sleepy smooth "
    "steady sturdy swift tender tidy vivid wary wild witty young zesty"
).split()
NOUNS = (
    "anchor apple arrow badger barrel basket beacon bridge candle canyon castle cedar comet copper "
    "cottage crystal dolphin engine falcon feather forest garden glacier harbor helmet island jacket "
    "kettle ladder lantern meadow mirror needle orchard otter paddle pebble pepper pillow planet "
    "puzzle quarry rabbit ribbon saddle satchel shovel spruce teapot thimble tunnel violin walnut"
).split()
_SUBJECTS = (
    "The committee", "A young engineer", "The old librarian", "Our neighbour", "The museum curator",
    "A travelling merchant", "The village council", "The research team", "A retired sailor", "The head gardener",
)
_VERBS = ("reviewed", "described", "questioned", "praised", "repaired", "measured", "catalogued", "studied")
_OBJECTS = (
    "the annual report on river management", "a map of the northern valleys", "the plans for a new bridge",
    "an account of the winter harvest", "the records of the coastal lighthouse", "a collection of pressed flowers",
    "the budget for the town library", "a design for a quieter tram", "the history of the salt trade",
    "a survey of migrating birds",
)
_TAILS = (
    "before the spring meeting", "during a long afternoon", "with unusual care", "after some debate",
    "in front of a small audience", "while the rain kept falling", "without much enthusiasm", "for the third time",
)
_REMARKS = (
    "Nobody expected the discussion to last so long.", "Several people took careful notes.",
    "The weather had been mild for weeks.", "It was agreed to return to the matter later.",
    "Some details remained unclear.", "Everyone seemed pleased with the outcome.",
)
_TOWNS = "Velbridge Marrowgate Ostrelle Quenby Thistlow Carrowmere Dunhollow Farrowby Penmarch Wyndle".split()
_FIRST = "Mira Tobias Elena Rafael Ingrid Cassius Noor Dorian Selma Anton Priya Lucan".split()
_LAST = "Castell Varga Okafor Lindqvist Moreau Tanaka Brennan Halloway Petrov Sandoval".split()
_JOBS = ("lighthouse keeper", "clockmaker", "botanist", "ferry captain", "glassblower", "cartographer", "beekeeper")
_COLOURS = ("green", "orange", "purple", "yellow", "grey", "blue")
_ITEMS = ("marbles", "apples", "stamps", "pencils", "shells", "coins", "books")
CAPITALS = (
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo"),
    ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Norway", "Oslo"),
    ("Greece", "Athens"), ("Poland", "Warsaw"), ("Portugal", "Lisbon"), ("Austria", "Vienna"),
    ("Ireland", "Dublin"), ("Sweden", "Stockholm"), ("Russia", "Moscow"), ("China", "Beijing"),
)


@dataclass(frozen=True, slots=True)
class Item:
    """One question. ``context`` holds the haystack (NIAH) or passage (QA); ``needles`` the
    inserted needle sentences, the asked ones first; ``depths`` the asked needles' depths
    in percent; ``answers`` the gold strings (all must be found)."""

    id: str
    task: str
    length: int  # the bound on prompt + answer tokens; 0 for qa
    instruction: str
    context: str
    question: str
    answer_prefix: str  # the start of the answer, appended after the prompt (RULER's answer prefix)
    answers: tuple[str, ...]
    needles: tuple[str, ...] = ()
    depths: tuple[float, ...] = ()
    max_tokens: int = 16


# ----------------------------------------------------------------- rendering
def completion_prompt(item: Item) -> str:
    """A base model's plain completion prompt, ending in the answer prefix."""
    return f"{item.instruction}\n\n{item.context}\n\nQuestion: {item.question}\nAnswer: {item.answer_prefix}".rstrip()


def user_message(item: Item) -> str:
    return f"{item.instruction}\n\n{item.context}\n\nQuestion: {item.question}"


def chat_prompt(apply_chat_template: Callable[[list[dict]], str]) -> Callable[[Item], str]:
    """A chat model's prompt: the template's render of one user turn (with the generation
    prompt) followed by the answer prefix, as RULER does for chat models."""

    def render(item: Item) -> str:
        text = apply_chat_template([{"role": "user", "content": user_message(item)}])
        return f"{text}{item.answer_prefix}".rstrip()

    return render


# ------------------------------------------------------------------- scoring
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans({c: " " for c in string.punctuation})


def normalize(text: str) -> str:
    """SQuAD's answer normalisation: lower case, punctuation and articles out, spaces squeezed."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCT)).split())


def _answer_text(prediction: str, num_answers: int) -> str:
    """What is scored: the first non-empty line for one answer (a base model runs on past
    its answer, into text that may quote other needles); all of it for several (a chat
    model lists them over lines)."""
    stripped = prediction.strip()
    return stripped if num_answers > 1 else stripped.split("\n", 1)[0]


def score(prediction: str, answers: Sequence[str]) -> float:
    """Fraction of ``answers`` found as whole words in the prediction (see :func:`_answer_text`).

    >>> score(" 1234567.\\nQuestion: ...", ["1234567"]), score("12345678", ["1234567"])
    (1.0, 0.0)
    >>> score("Paris and 42", ["paris", "41"])
    0.5
    """
    words = f" {normalize(_answer_text(prediction, len(answers)))} "
    return sum(f" {normalize(a)} " in words for a in answers) / len(answers)


def exact_match(prediction: str, answers: Sequence[str]) -> bool:
    """The scored text, normalised, equals the answers joined (one answer: equals it)."""
    return normalize(_answer_text(prediction, len(answers))) == normalize(" ".join(answers))


# ---------------------------------------------------------------- generation
def _rng(seed: int, *parts: object) -> random.Random:
    """A generator for one item: stable across runs and Python versions (no ``hash()``)."""
    digest = hashlib.sha256(repr((seed,) + parts).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def _keys(rng: random.Random, n: int) -> list[str]:
    keys: list[str] = []
    while len(keys) < n:
        key = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
        if key not in keys:
            keys.append(key)
    return keys


def _values(rng: random.Random, n: int) -> list[str]:
    return [str(v) for v in rng.sample(range(1_000_000, 10_000_000), n)]


def _noise(rng: random.Random) -> Iterator[str]:
    """RULER's repeated noise haystack, one sentence at a time."""
    return itertools.cycle(NOISE)


def _essay(rng: random.Random) -> Iterator[str]:
    """An endless essay-like haystack of seeded generated sentences."""
    while True:
        if rng.random() < 0.2:
            yield rng.choice(_REMARKS)
        else:
            yield f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}."


def _needle(key: str, value: str) -> str:
    return f"The special magic number for {key} is {value}."


def _insert(filler: Sequence[str], needles: Sequence[tuple[float, str]]) -> str:
    """The filler with each needle placed before sentence ``round(depth% * len(filler))``
    (depth 100: after the last); needles at one place keep their order."""
    slots: dict[int, list[str]] = {}
    for depth, needle in needles:
        slots.setdefault(round(depth / 100 * len(filler)), []).append(needle)
    out: list[str] = []
    for i in range(len(filler) + 1):
        out.extend(slots.get(i, ()))
        if i < len(filler):
            out.append(filler[i])
    return " ".join(out)


def _niah_parts(task: str, rng: random.Random, depths: Sequence[float]):
    """(haystack maker, needles as (depth, text), [(asked key, answers, asked needle indices)], noun).

    ``depths``: the asked needles' depths (multikey: one per needle, each asked in turn)."""
    if task == "niah_single":
        (key,), (value,) = _keys(rng, 1), _values(rng, 1)
        return _noise, [(depths[0], _needle(key, value))], [(key, [value], [0])], "number"
    if task == "niah_multikey":
        keys, values = _keys(rng, NUM_NEEDLES), _values(rng, NUM_NEEDLES)
        needles = [(d, _needle(k, v)) for d, k, v in zip(depths, keys, values)]
        return _essay, needles, [(k, [v], [j]) for j, (k, v) in enumerate(zip(keys, values))], "number"
    if task == "niah_multivalue":
        (key,), values = _keys(rng, 1), _values(rng, NUM_NEEDLES)
        needles = [(depths[0], _needle(key, values[0]))] + [(rng.uniform(0, 100), _needle(key, v)) for v in values[1:]]
        return _essay, needles, [(key, values, list(range(NUM_NEEDLES)))], "numbers"
    raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")


def _niah_haystack(
    task: str, length: int, index: int, depths: Sequence[float], seed: int,
    count_tokens: Callable[[str], int], render: Callable[[Item], str],
) -> list[Item]:
    """The items of one haystack: one question, or (multikey) one per needle, sharing the context."""
    rng = _rng(seed, task, length, index)
    make_filler, needles, questions, noun = _niah_parts(task, rng, depths)
    plural = noun == "numbers"
    instruction = (
        "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the numbers afterwards."
    )
    what = "are all the special magic numbers" if plural else "is the special magic number"
    max_tokens = MAX_TOKENS[task]
    budget = length - max_tokens
    stream, filler = make_filler(rng), []

    def build(n: int) -> list[Item]:
        context = _insert(filler[:n], needles)
        items = []
        for q, (key, answers, asked) in enumerate(questions):
            order = asked + [j for j in range(len(needles)) if j not in asked]
            items.append(Item(
                id=f"{task}/{length}/{index}" + (f".{q}" if len(questions) > 1 else ""), task=task,
                length=length, instruction=instruction, context=context,
                question=f"What {what} for {key} mentioned in the provided text?",
                answer_prefix=f"The special magic {noun} for {key} mentioned in the provided text {'are' if plural else 'is'}",
                answers=tuple(answers), needles=tuple(needles[j][1] for j in order),
                depths=tuple(needles[j][0] for j in asked), max_tokens=max_tokens,
            ))
        return items

    def size(n: int) -> int:
        return max(count_tokens(render(item)) for item in build(n))

    if size(0) > budget:
        raise ValueError(f"{task}: a {length}-token item cannot hold the instruction, needles and answer")
    hi = 16
    filler.extend(itertools.islice(stream, hi))
    while size(hi) <= budget:  # grow until the haystack overflows, then bisect on the sentence count
        hi *= 2
        filler.extend(itertools.islice(stream, hi - len(filler)))
    lo = 0  # size(lo) <= budget < size(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if size(mid) <= budget else (lo, mid)
    return build(lo)


def _qa_item(index: int, seed: int) -> Item:
    rng = _rng(seed, "qa", index)
    kind = ("bio", "sum", "capital")[index % 3]
    instruction = "Read the passage and answer the question in a few words."
    if kind == "bio":
        name = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
        town, job, colour, year = rng.choice(_TOWNS), rng.choice(_JOBS), rng.choice(_COLOURS), rng.randint(1820, 1990)
        context = (
            f"{name} was born in the town of {town} in {year} and worked as a {job} for many years. "
            f"The favourite colour of {name} was {colour}, and the front door of the house was painted to match."
        )
        question, answer, prefix = rng.choice((
            (f"In which town was {name} born?", town, f"{name} was born in the town of"),
            (f"In which year was {name} born?", str(year), f"{name} was born in"),
            (f"What was the favourite colour of {name}?", colour, f"The favourite colour of {name} was"),
        ))
    elif kind == "sum":
        name, thing = rng.choice(_FIRST), rng.choice(_ITEMS)
        a, b = rng.randint(2, 20), rng.randint(2, 20)
        context = f"{name} had {a} {thing} in a box. Then a friend gave {name} {b} more {thing}. Nothing was lost."
        question, answer, prefix = f"How many {thing} does {name} have now?", str(a + b), f"{name} now has"
    else:
        pairs = rng.sample(CAPITALS, 4)
        context = " ".join(f"The capital of {c} is {cap}." for c, cap in pairs)
        country, answer = pairs[rng.randrange(4)]
        question, prefix = f"What is the capital of {country}?", f"The capital of {country} is"
    return Item(
        id=f"qa/{kind}/{index}", task="qa", length=0, instruction=instruction, context=context,
        question=question, answer_prefix=prefix, answers=(answer,), max_tokens=MAX_TOKENS["qa"],
    )


def _depths(n: int, rng: random.Random) -> list[float]:
    """n depths spread evenly over 0..100 (one item: 50), in a seeded order."""
    depths = [50.0] if n == 1 else [100 * i / (n - 1) for i in range(n)]
    rng.shuffle(depths)
    return depths


def make_haystack_items(
    task: str, length: int, index: int, seed: int, count_tokens: Callable[[str], int],
    render: Callable[[Item], str], depths: Sequence[float] | None = None,
) -> list[Item]:
    """The items of haystack ``index`` of a NIAH task at ``length``; ``depths``: the asked
    needles' (multikey: one per needle; default evenly spread), in percent."""
    if task not in NIAH_TASKS:
        raise ValueError(f"unknown NIAH task {task!r}; known: {', '.join(NIAH_TASKS)}")
    count = NUM_NEEDLES if task == "niah_multikey" else 1
    depths = list(depths) if depths is not None else [100 * i / max(count - 1, 1) for i in range(count)] if count > 1 else [50.0]
    if len(depths) != count or not all(0 <= d <= 100 for d in depths):
        raise ValueError(f"{task} needs {count} depth(s) in [0, 100], got {depths!r}")
    return _niah_haystack(task, length, index, depths, seed, count_tokens, render)


def make_qa_item(index: int, seed: int) -> Item:
    return _qa_item(index, seed)


def make_items(
    tasks: Sequence[str], lengths: Sequence[int], per_length: int, *, seed: int,
    count_tokens: Callable[[str], int], render: Callable[[Item], str], qa_items: int | None = None,
) -> list[Item]:
    """``per_length`` haystacks of each NIAH task at each length (multikey: one item per
    needle, the haystack shared) and ``qa_items`` (default ``per_length * len(lengths)``)
    QA items when ``"qa"`` is among the tasks. The asked depths at one length are spread
    evenly over 0..100 across the haystacks (multikey: across all its needles)."""
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; known: {', '.join(TASKS)}")
    if per_length < 1:
        raise ValueError(f"items per length must be >= 1, got {per_length}")
    items = []
    for task in tasks:
        if task == "qa":
            items += [_qa_item(i, seed) for i in range(per_length * len(lengths) if qa_items is None else qa_items)]
            continue
        per = NUM_NEEDLES if task == "niah_multikey" else 1
        for length in lengths:
            depths = _depths(per_length * per, _rng(seed, task, length, "depths"))
            for i in range(per_length):
                items += _niah_haystack(task, length, i, depths[i * per:(i + 1) * per], seed, count_tokens, render)
    return items

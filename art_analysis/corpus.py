"""Offline long texts and retrieval prompts with known answers.

Every text comes from files that ship with the Python interpreter, so nothing is
downloaded and the same `(name, seed)` gives the same text on the same Python version
(captures record the text's SHA-256 to pin it exactly):

* ``"stdlib"``: the standard library's ``.py`` sources, whole files in a seeded order;
* ``"docs"``: the language reference prose bundled as ``pydoc_data.topics``, whole topics in
  a seeded order.

Retrieval prompts hide a needle with a known answer inside a haystack at a chosen depth:

* `passkey_prompt`: the classic pass-key retrieval (repeated filler sentences, a 5-digit key);
* `niah_prompt`: needle in a haystack over the ``"docs"`` prose (a "special magic number").

Lengths are measured in tokens when a tokenizer is given (the prompt then carries its exact
``input_ids``) and in characters otherwise.  The needle is placed at the sentence boundary of
the haystack nearest to ``depth * haystack_length`` (depth 0: start, 1: end).
"""
from __future__ import annotations

import random
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from .checks import check_int

LONG_TEXT_SOURCES = ("stdlib", "docs")

PASSKEY_PREFIX = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                  "I will quiz you about the important information there.\n\n")
PASSKEY_FILLER = ("The grass is green. ", "The sky is blue. ", "The sun is yellow. ", "Here we go. ",
                  "There and back again. ")
NIAH_PREFIX = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
               "I will quiz you about the numbers afterwards.\n\n")
NIAH_KEYS = ("amber-falcon", "quiet-harbor", "silver-meadow", "crimson-lantern", "hollow-birch", "northern-tide",
             "velvet-comet", "granite-orchard", "copper-willow", "misty-canyon", "lunar-thistle", "ember-glade")


def stdlib_root() -> Path:
    """Folder of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_documents(rng: random.Random) -> Iterator[str]:
    root = stdlib_root()
    files = sorted(p for p in root.rglob("*.py")
                   if not {"site-packages", "dist-packages", "__pycache__"} & set(p.relative_to(root).parts))
    rng.shuffle(files)
    for path in files:
        try:
            body = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if body.strip():
            yield f"# File: {path.relative_to(root).as_posix()}\n{body}\n"


def _docs_documents(rng: random.Random) -> Iterator[str]:
    from pydoc_data.topics import topics

    names = sorted(topics)
    rng.shuffle(names)
    for name in names:
        yield topics[name].strip() + "\n\n"


_DOCUMENTS: dict[str, Callable[[random.Random], Iterator[str]]] = {
    "stdlib": _stdlib_documents,
    "docs": _docs_documents,
}


def _units(tokenizer) -> tuple[Callable[[str], list], Callable[[list], str], str]:
    """(encode, decode, unit name): token ids with a tokenizer, characters without."""
    if tokenizer is None:
        return list, "".join, "chars"
    return ((lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]),
            (lambda ids: tokenizer.decode(ids)), "tokens")


def long_text(name: str = "stdlib", *, seed: int = 0, length: int = 100_000, tokenizer=None) -> str:
    """Whole documents of source `name` in a `seed`-determined order, concatenated until the
    text holds at least `length` tokens (with `tokenizer`) or characters (without)."""
    if name not in _DOCUMENTS:
        raise ValueError(f"unknown text source {name!r}: expected one of {LONG_TEXT_SOURCES}")
    check_int(seed, "seed", 0)
    check_int(length, "length", 1)
    encode = _units(tokenizer)[0]
    parts, total = [], 0
    for doc in _DOCUMENTS[name](random.Random(seed)):
        parts.append(doc)
        total += len(encode(doc))
        if total >= length:
            return "".join(parts)
    raise ValueError(f"text source {name!r} holds only {total} units, fewer than length={length}")


@dataclass(frozen=True)
class Prompt:
    """A retrieval prompt with a known answer.

    Offsets (`needle_start`, `needle_end`, `haystack_start`, `haystack_end`) index the
    prompt in `unit`s ("tokens": positions in `input_ids`; "chars": positions in `text`).
    The haystack span includes the needle.
    """

    kind: str
    text: str
    answer: str
    depth: float
    seed: int
    length: int
    unit: str
    needle_start: int
    needle_end: int
    haystack_start: int
    haystack_end: int
    input_ids: tuple[int, ...] | None = None

    @property
    def achieved_depth(self) -> float:
        """Share of the haystack (needle excluded) that precedes the needle."""
        before = self.needle_start - self.haystack_start
        total = self.haystack_end - self.haystack_start - (self.needle_end - self.needle_start)
        return before / total if total else 0.0

    def metadata(self) -> dict:
        """Everything but the text and the ids, for capture metadata."""
        meta = asdict(self)
        del meta["text"], meta["input_ids"]
        meta["achieved_depth"] = self.achieved_depth
        return meta


def _build_prompt(kind: str, length: int, depth: float, seed: int, tokenizer, prefix: str,
                  sentences: Iterator[str], needle: str, question: str, answer: str) -> Prompt:
    check_int(length, "length", 1)
    if not isinstance(depth, (int, float)) or isinstance(depth, bool) or not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be a number in [0, 1], got {depth!r}")
    encode, decode, unit = _units(tokenizer)
    head = list(tokenizer(prefix)["input_ids"]) if tokenizer is not None else encode(prefix)
    needle_units, question_units = encode(needle), encode(question)
    budget = length - len(head) - len(needle_units) - len(question_units)
    if budget < 1:
        raise ValueError(f"length={length} {unit} is too short for a {kind} prompt: the instructions, needle "
                         f"and question alone take {length - budget} {unit}")
    haystack, boundaries = [], [0]
    for sentence in sentences:
        haystack.extend(encode(sentence))
        boundaries.append(len(haystack))
        if len(haystack) >= budget:
            break
    if len(haystack) < budget:
        raise ValueError(f"not enough haystack text for a {kind} prompt of {length} {unit}")
    haystack = haystack[:budget]
    boundaries = [b for b in boundaries if b <= budget]
    insert = min(boundaries, key=lambda b: (abs(b - depth * budget), b))
    units = head + haystack[:insert] + needle_units + haystack[insert:] + question_units
    start = len(head) + insert
    return Prompt(
        kind=kind, text=decode(units), answer=answer, depth=float(depth), seed=seed, length=len(units), unit=unit,
        needle_start=start, needle_end=start + len(needle_units), haystack_start=len(head),
        haystack_end=len(head) + budget + len(needle_units),
        input_ids=tuple(int(i) for i in units) if tokenizer is not None else None,
    )


def passkey_prompt(length: int, *, depth: float = 0.5, seed: int = 0, tokenizer=None) -> Prompt:
    """Pass-key retrieval: filler sentences with a 5-digit key hidden at `depth`; the prompt
    ends with "The pass key is" so the answer is the continuation."""
    check_int(seed, "seed", 0)
    rng = random.Random(seed)
    key = str(rng.randint(10_000, 99_999))

    def filler() -> Iterator[str]:
        while True:
            yield from PASSKEY_FILLER

    return _build_prompt("passkey", length, depth, seed, tokenizer, PASSKEY_PREFIX, filler(),
                         f"The pass key is {key}. Remember it. {key} is the pass key. ",
                         "\n\nWhat is the pass key? The pass key is", key)


def _sentences(text: str) -> Iterator[str]:
    """Split prose after sentence ends and line breaks, keeping every character."""
    start = 0
    for i, ch in enumerate(text):
        if ch == "\n" or (ch in ".?!" and i + 1 < len(text) and text[i + 1] == " "):
            yield text[start:i + 1]
            start = i + 1
    if start < len(text):
        yield text[start:]


def niah_prompt(length: int, *, depth: float = 0.5, seed: int = 0, tokenizer=None) -> Prompt:
    """Needle in a haystack over the ``"docs"`` prose: "The special magic number for KEY is:
    N." hidden at `depth`; the prompt ends by asking for it, so N is the continuation."""
    check_int(seed, "seed", 0)
    rng = random.Random(seed)
    key = rng.choice(NIAH_KEYS)
    number = str(rng.randint(1_000_000, 9_999_999))

    def prose() -> Iterator[str]:
        for doc in _docs_documents(random.Random(seed)):
            yield from _sentences(doc)

    return _build_prompt("niah", length, depth, seed, tokenizer, NIAH_PREFIX, prose(),
                         f" The special magic number for {key} is: {number}. ",
                         f"\n\nWhat is the special magic number for {key} mentioned in the provided text? "
                         f"The special magic number for {key} is:", number)


PROMPT_BUILDERS: dict[str, Callable[..., Prompt]] = {"passkey": passkey_prompt, "niah": niah_prompt}

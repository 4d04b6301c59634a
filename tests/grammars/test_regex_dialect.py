"""The portable regex keeps re.fullmatch's language (narrowing only positive \\d \\w \\s)."""

from __future__ import annotations

import random
import re

import pytest

from formcast.grammars.regex_dialect import literal, translate

ALPHABET = "ab xyz019_-.\n\t\"\\éΩ٣😀\u00a0\u2003"

EXACT = [r"(ab)+c?", r"[^ab]{1,3}", r".x.", r"a|b|", r"\.\-\\", r"[\D]+", r"\W\S", r"x{2,}",
         r"(?:a(?:b|c)*)?z", r"^[^\n]*$", r"[\]\[^-]", r"[^\W\d]", r"\Aab\Z", r"(?a)\w\d\s"]
# (pattern, a string Python matches but the narrowed translation does not)
NARROWED = [(r"\d+", "٣"), (r"\w{1,3}", "é"), (r"\s*x", "\u2003x"), (r"[\w.]+@[\w.]+", "é@a")]


def _strings(rng: random.Random, n: int) -> list[str]:
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 5))) for _ in range(n)]


@pytest.mark.parametrize("pattern", EXACT)
def test_exact_translation_keeps_the_language(pattern):
    ours = re.compile(translate(pattern))
    theirs = re.compile(pattern)
    for s in _strings(random.Random(pattern), 3000):
        assert bool(ours.fullmatch(s)) == bool(theirs.fullmatch(s)), (pattern, s)


@pytest.mark.parametrize("pattern,unicode_only", NARROWED)
def test_positive_classes_narrow_to_ascii(pattern, unicode_only):
    ours = re.compile(translate(pattern))
    theirs = re.compile(pattern)
    for s in _strings(random.Random(pattern), 3000):
        if ours.fullmatch(s):
            assert theirs.fullmatch(s), (pattern, s)
    assert theirs.fullmatch(unicode_only) and not ours.fullmatch(unicode_only)


def test_negated_categories_are_exact_over_all_code_points():
    ours = re.compile(translate(r"\D"))
    for cp in list(range(0, 0x3000)) + [0x1D7CE, 0x1F600, 0x10FFFF]:
        c = chr(cp)
        if 0xD800 <= cp <= 0xDFFF:
            continue
        assert bool(ours.fullmatch(c)) == bool(re.fullmatch(r"\D", c)), hex(cp)


def test_literal_escapes_everything():
    text = 'a.b*c(d)[e]{f}|g^h$i\\j"k\n\x01é😀'
    assert re.fullmatch(literal(text), text)
    assert not re.fullmatch(literal(text), text.replace(".", "x"))

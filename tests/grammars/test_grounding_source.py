"""Clause breaks: a grounded string crosses no clause of the text, a list item no "and"."""

from __future__ import annotations

import pytest

from formcast.grammars import JsonSchema, ground, grounding_plan
from formcast.grammars.grounding_source import clause_breaks, source_tables

DOC = {"type": "object", "required": ["title", "tags"], "additionalProperties": False,
       "properties": {"title": {"type": "string"},
                      "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}}}


def _blanked(text: str, items: bool) -> str:
    breaks = clause_breaks(text, items=items)
    return "".join("#" if k in breaks else ch for k, ch in enumerate(text))


@pytest.mark.parametrize("text, items, blanked", [
    ("Go, PostgreSQL, Kafka. Nice", False, "Go# PostgreSQL# Kafka# Nice"),
    ("37,980 yen; 4.99 each", False, "37,980 yen# 4.99 each"),          # digits keep theirs
    ("David L. Lawrence Center. Next", False, "David L. Lawrence Center# Next"),
    ("J.R.R. Tolkien wrote it!", False, "J.R.R. Tolkien wrote it#"),
    ("Serves: 8. Time: 70 min.", False, "Serves: 8# Time: 70 min#"),    # a digit is no initial
    ("Dr. Reyes and Mr. Smith", False, "Dr. Reyes and Mr. Smith"),
    ("Dr. Reyes and Mr. Smith", True, "Dr. Reyes ### Mr. Smith"),
    ("C and C++ or Rust & Go", True, "C ### C++ ## Rust # Go"),
    ("Brandon sells sand", True, "Brandon sells sand"),                  # words, not parts
    ("Title\nBody (draft) [v2] | x", False, "Title#Body #draft# #v2# # x"),
    ("Greek Salad - 4 servings – easy — 5-6", False, "Greek Salad # 4 servings # easy # 5-6"),
])
def test_clause_breaks(text, items, blanked):
    assert _blanked(text, items) == blanked


def test_breaks_are_nul_bytes_of_the_escaped_text():
    body, marks = source_tables("a,\nb", breaks=clause_breaks("a,\nb"))
    assert body == b"a\x00\x00\x00b"     # "," and the two bytes of the escape "\n"
    assert len(marks) == len(body) + 1


def _takes(compiler, vocab, text: str, document: str) -> bool:
    compiled = compiler.compile(JsonSchema(DOC), vocab)
    plan = grounding_plan(DOC, words=True, clauses=True)
    m = ground(compiled.matcher(), text, plan, vocab)
    ids = vocab.segment(document.encode("utf-8"))
    return m.valid_prefix(ids) == len(ids)


@pytest.mark.parametrize("document, taken", [
    ('{"title":"Python and Rust","tags":["Go"]}', True),      # "and" inside a plain field
    ('{"title":"Go, Python","tags":[]}', False),              # across a clause break
    ('{"title":"Go","tags":["Python"]}', True),
    ('{"title":"Go","tags":["Python and Rust"]}', False),     # a list item stops at "and"
    ('{"title":"Go","tags":["Python","Rust"]}', True),
    ('{"title":"Go","tags":["Go, Python"]}', False),
    ('{"title":"jobs","tags":[]}', True),
])
def test_list_items_end_at_the_texts_enumeration(compiler, tiny_vocab, document, taken):
    assert _takes(compiler, tiny_vocab, "Go, Python and Rust jobs", document) is taken


def test_without_clauses_a_span_may_cross_them(compiler, tiny_vocab):
    compiled = compiler.compile(JsonSchema(DOC), tiny_vocab)
    m = ground(compiled.matcher(), "Go, Python and Rust", grounding_plan(DOC, words=True),
               tiny_vocab)
    ids = tiny_vocab.segment(b'{"title":"Go","tags":["Python and Rust"]}')
    assert m.valid_prefix(ids) == len(ids)

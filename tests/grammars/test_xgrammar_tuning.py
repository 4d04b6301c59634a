"""XGrammarTuning: validated knobs that reach every grammar and matcher of a backend."""

from __future__ import annotations

import pytest

from formcast.grammars import JsonSchema, Regex
from formcast.grammars.backends.xgrammar import XGrammarTuning

from .cases import PERSON
from .spies import tuned


@pytest.mark.parametrize("fields,match", [
    ({"text_mask_rows": -1}, "text_mask_rows must be an int >= 0"),
    ({"known_min_rows": 0}, "known_min_rows must be an int >= 1"),
    ({"text_key_limit": 2.5}, "text_key_limit must be an int"),
    ({"fill_probe": 0}, "fill_probe must be an int >= 1"),
    ({"poll_pauses": -3}, "poll_pauses must be an int >= 0"),
    ({"fill_threads": 0}, "fill_threads must be None or an int >= 1"),
    ({"compile_threads": "4"}, "compile_threads must be None or an int >= 1"),
    ({"fill_parallel_us": -1.0}, "fill_parallel_us must be >= 0"),
])
def test_bad_tuning_is_a_value_error_that_names_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        XGrammarTuning(**fields)


@pytest.mark.parametrize("fields,threads", [({"fill_threads": 3}, 3), ({}, None)])
def test_fill_threads_resolve_for_this_machine(fields, threads):
    got = XGrammarTuning(**fields).fill_thread_count
    assert got == threads if threads is not None else 1 <= got <= 4


def test_a_backends_tuning_reaches_its_matchers(compiler, tiny_vocab):
    """``text_key_limit`` bounds the text a matcher keeps (then filled on its
    own); without ``text_masks`` a grammar learns no masks; with them it learns
    the masks its matchers fill."""
    digits = compiler.compile(Regex(r"[0-9]+"), tiny_vocab, backend="xgrammar")
    short = tuned(digits, text_key_limit=2)
    m = short.matcher()
    assert m.accept_text("12") and m.kept_text == b"12"
    assert m.accept_text("3") and m.kept_text is None
    person = compiler.compile(JsonSchema(PERSON), tiny_vocab, backend="xgrammar")
    for on in (False, True):
        grammar = tuned(person, text_masks=on, text_mask_rows=4)
        bitmask = grammar.allocate_bitmask(1)
        for _ in range(2):  # (a single fill keeps a text's mask the second time)
            grammar.matcher().fill_bitmask(bitmask, 0)
        assert bool(grammar.grammar.text_masks.slots) == on
        assert grammar.grammar.text_masks.capacity == 4

"""Grammars whose language is empty are refused before generation; the library's
native warnings come back as Python warnings, not as text on stderr."""

from __future__ import annotations

import os
import re
import threading
import warnings

import pytest

from formcast import ConstraintError
from formcast.grammars import Ebnf, GrammarCompiler, JsonSchema, Lark, Regex
from formcast.grammars.native_log import native_log

from .conftest import EOS, allowed_ids

EMPTY = [
    # (constraint, the rules the message must name, rules it must not name)
    (Ebnf("root ::= root"), ["rule 'root' never finishes"], []),
    (Ebnf('root ::= a\na ::= "x" a'), ["rules 'root', 'a' never finish"], []),
    (Ebnf('root ::= a b\na ::= a\nb ::= "x" | c\nc ::= c'), ["'root', 'a'"], ["'c'"]),
    (Ebnf('root ::= ("x" root)+'), ["rule 'root'"], []),
    (Ebnf('root ::= a{2,3}\na ::= "y" a'), ["'root', 'a'"], []),
    (Ebnf('root ::= [^\\x00-\\U0010FFFF] "b"'), ["rule 'root'", "character class"], []),
    (Ebnf('top ::= "a" top', root="top"), ["rule 'top'"], []),
    (Lark("start: start"), ["rule 'start' never finishes"], ["root"]),
    (Lark('start: a\na: "x" a'), ["rules 'start', 'a'"], []),
    (Lark('start: a+\na: "x" a'), ["rules 'start', 'a'"], []),
]


@pytest.mark.parametrize("constraint,named,not_named", EMPTY,
                         ids=[f"{i}-{type(c).__name__}" for i, (c, _, _) in enumerate(EMPTY)])
def test_empty_language_is_refused_naming_the_rules(constraint, named, not_named, compiler,
                                                     tiny_vocab):
    with pytest.raises(ConstraintError) as info:
        compiler.compile(constraint, tiny_vocab)
    message = str(info.value)
    assert "derives no finite string" in message
    for part in named:
        assert part in message, f"{part!r} not in {message!r}"
    for part in not_named:
        assert part not in message, f"{part!r} in {message!r}"


@pytest.mark.parametrize("constraint", [Regex(r"[^\s\S]"), Regex(r"[^\d\D]x|y[^\s\S]"),
                                        Regex(r"a{0}b{3,2}")])
def test_regex_matching_nothing_is_refused(constraint, compiler, tiny_vocab):
    with pytest.raises(ConstraintError):
        compiler.compile(constraint, tiny_vocab)


# Grammars with a base case somewhere compile, and derive exactly their strings:
# (constraint, texts accepted with eos allowed after them, texts refused). Lark's
# 'start: "a" |' is a valid grammar (lark itself reads the empty alternative as the
# empty string), so it accepts "" and "a" and nothing else.
LIVE = [
    (Lark('start: "a" |'), ["", "a"], ["aa", "b"]),
    (Ebnf('root ::= ("x" root)*'), ["", "x", "xxx"], ["y"]),
    (Ebnf('root ::= "x" root?'), ["x", "xxx"], [""]),
    (Ebnf('root ::= "q" | b\nb ::= "x" b'), ["q"], ["x", "xq"]),
    (Lark('start: a*\na: "x" a'), [""], ["x"]),
    (Ebnf('root ::= "a" [^\\x00-\\U0010FFFF]*'), ["a"], ["ab"]),
    (Regex(r"x|[^\d\D]y"), ["x"], ["y", ""]),    # (one empty branch: the other stays)
]


@pytest.mark.parametrize("constraint,accepted,refused", LIVE,
                         ids=[f"{i}-{type(c).__name__}" for i, (c, _, _) in enumerate(LIVE)])
def test_grammars_with_a_base_case_derive_their_strings(constraint, accepted, refused,
                                                        compiler, tiny_vocab):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = compiler.compile(constraint, tiny_vocab)
    for text in accepted:
        assert _ends_after(compiled, tiny_vocab, text), text
    for text in refused:
        assert not _ends_after(compiled, tiny_vocab, text), text


def _ends_after(compiled, vocab, text: str) -> bool:
    """Whether the matcher takes ``text`` byte by byte and then allows eos."""
    matcher = compiled.matcher()
    for byte in text.encode():
        if not matcher.accept(2 + byte):           # token 2 + b is the single byte b
            return False
    mask = compiled.allocate_bitmask(1)
    matcher.fill_bitmask(mask, 0)
    return EOS in allowed_ids(mask, 0, vocab.vocab_size)


@pytest.mark.parametrize("constraint,expect", [
    (Ebnf('root ::= "q" | b\nb ::= "x" b'), "rule 'b' derives no finite string"),
    (Lark('start: "k" | a\na: "x" a'), "rule 'a' derives no finite string"),
])
def test_dead_rules_beside_a_live_start_are_warned_about(constraint, expect, tiny_vocab):
    compiler = GrammarCompiler()
    with pytest.warns(UserWarning, match=expect):
        compiled = compiler.compile(constraint, tiny_vocab)
    assert any(expect in w for w in compiled.warnings)
    compiler.close()


@pytest.mark.parametrize("constraint,expect", [
    (Lark("start: /a$b/"), "'$' should be at the end of the regex"),
    (Lark('start: /x^y/ | "c"'), "'^' should be at the start of the regex"),
])
def test_native_warnings_become_python_warnings_not_stderr(constraint, expect, tiny_vocab,
                                                           capfd):
    compiler = GrammarCompiler()       # a fresh cache: the compile really runs
    capfd.readouterr()
    with pytest.warns(UserWarning, match=re.escape(expect)) as caught:
        compiled = compiler.compile(constraint, tiny_vocab)
    assert capfd.readouterr().err == ""
    assert [str(w.message) for w in caught if expect in str(w.message)][0].startswith("xgrammar:")
    assert any(expect in w for w in compiled.warnings)
    with warnings.catch_warnings():
        warnings.simplefilter("error")     # a cache hit warns no more
        assert compiler.compile(constraint, tiny_vocab) is compiled
    compiler.close()


def test_a_clean_compile_has_no_warnings_and_leaves_stderr_alone(tiny_vocab, capfd):
    compiler = GrammarCompiler()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compiled = compiler.compile(JsonSchema({"type": "integer"}), tiny_vocab)
    assert compiled.warnings == ()
    os.write(2, b"after\n")              # descriptor 2 is the test's again
    assert capfd.readouterr().err == "after\n"
    compiler.close()


def test_other_output_on_descriptor_2_is_passed_through_after_a_capture(capfd):
    log = native_log()
    with log.capture() as outer:
        os.write(2, b"[07:22:48] /project/cpp/x.cc:10: Warning: from the library\n")
        with log.capture() as inner:                 # overlapping captures share it
            os.write(2, b"some other output\n")
            os.write(2, b"[07:22:49] /project/cpp/y.cc:20: second\n")
        assert capfd.readouterr().err == ""          # still redirected for the outer one
    assert outer == ["from the library", "second"]
    assert inner == ["second"]
    assert capfd.readouterr().err == "some other output\n"


def test_concurrent_compiles_each_get_their_warnings(tiny_vocab, capfd):
    compiler = GrammarCompiler(max_workers=2)
    texts = [f'start: /a$b/ | "{c}"' for c in "pqrstu"]
    results: dict[str, tuple[str, ...]] = {}

    def run(text: str) -> None:
        results[text] = compiler.compile(Lark(text), tiny_vocab).warnings

    threads = [threading.Thread(target=run, args=(t,)) for t in texts]
    with warnings.catch_warnings(record=True):      # (the filters are the process's)
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert all(any("'$' should be at the end" in w for w in results[t]) for t in texts)
    assert capfd.readouterr().err == ""
    os.write(2, b"restored\n")
    assert capfd.readouterr().err == "restored\n"
    compiler.close()

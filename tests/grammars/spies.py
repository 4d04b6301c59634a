"""Spies on the grammar backends and tuned grammars, shared by grammar and engine tests."""

from __future__ import annotations

import dataclasses


def known_mask_calls(monkeypatch) -> list[bool]:
    """Whether each of xgrammar's batch accepts from now on (the test's) went by
    known text masks (see ``xgrammar.text_masks.TextMasks``), in the order they return."""
    from formcast.grammars.backends.xgrammar.batch_accept import PreparedAccept

    seen: list[bool] = []
    real = PreparedAccept._on_known_masks

    def spy(self, tokens):
        got = real(self, tokens)
        seen.append(got is not None)
        return got
    monkeypatch.setattr(PreparedAccept, "_on_known_masks", spy)
    return seen


def tuned(*compiled, **tuning):
    """Each of ``compiled`` (CompiledGrammars of the xgrammar backend, of one
    vocabulary) compiled again by one backend of their own whose
    XGrammarTuning has ``tuning``: grammars with their own known masks and
    caches. One grammar given, one returned; else a list."""
    from formcast.grammars.backends.xgrammar import XGrammarBackend, XGrammarTuning
    from formcast.grammars.compiler import grammar_source

    backend = XGrammarBackend(compiled[0].vocab, tuning=XGrammarTuning(**tuning))
    made = [dataclasses.replace(c, grammar=backend.compile(
        grammar_source(c.constraint, "xgrammar")[0])) for c in compiled]
    return made[0] if len(made) == 1 else made


class FillSpy:
    """Stands for a backend's per-thread fill plans: records the rows of each
    batch fill, then fills them through the real plan."""

    def __init__(self, backend) -> None:
        self.real = backend.fill_plans
        self.filled: list[list[int]] = []
        backend.fill_plans = self

    def get(self) -> "FillSpy":
        return self

    def fill(self, matchers, bitmask, rows) -> None:
        self.filled.append(list(rows))
        self.real.get().fill(matchers, bitmask, rows)

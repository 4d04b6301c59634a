"""Spies on the grammar backends' internals, shared by grammar and engine tests."""

from __future__ import annotations


def known_mask_calls(monkeypatch) -> list[bool]:
    """Whether each of xgrammar's batch accepts from now on (the test's) went by
    known text masks (see ``xgrammar_backend._TextMasks``), in the order they return."""
    from formcast.grammars.backends import xgrammar_backend

    seen: list[bool] = []
    real = xgrammar_backend._PreparedAccept._on_known_masks

    def spy(self, tokens):
        got = real(self, tokens)
        seen.append(got is not None)
        return got
    monkeypatch.setattr(xgrammar_backend._PreparedAccept, "_on_known_masks", spy)
    return seen

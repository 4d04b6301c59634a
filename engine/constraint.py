"""The one interface between the engine and the grammar layer.

The engine imports no grammar library: it drives any object that implements
:class:`LogitsConstraint`. ``formcast.grammars`` provides the real matchers.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class LogitsConstraint(Protocol):
    """A per-request token filter with state (one instance per request)."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed tokens of the next step into ``bitmask[row]``.

        ``bitmask`` is int32 ``[rows, ceil(V/32)]``; bit ``t % 32`` of word ``t // 32``
        set means token ``t`` is allowed.
        """

    def accept(self, token_id: int) -> bool:
        """Advance by ``token_id``; False (state unchanged) if it is not allowed.

        It must take exactly the tokens :meth:`fill_bitmask` allows: a greedy
        request's unmasked pick is checked by ``accept`` alone
        (``EngineConfig.unmasked_greedy``)."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    def is_terminated(self) -> bool:
        """True once the constraint is complete and accepts nothing more."""

    def forced_tokens(self) -> list[int]:
        """Tokens the constraint fixes from here on (jump-forward); may be empty."""

    def valid_prefix(self, draft: list[int]) -> int:
        """How many leading tokens of ``draft`` the constraint allows (state unchanged)."""


# Optional: a constraint class may offer ``fill_bitmasks(constraints, bitmask, rows)``
# (a static or class method) that fills ``bitmask[rows[i]]`` for each of several of its
# instances in one call, writing those rows whole (every word: the engine does not
# clear them first). On CUDA the engine uses it for a step's rows of that class
# (falling back to ``fill_bitmask`` row by row, on cleared rows, if it raises).
#
# Optional: ``fill_distinct_bitmasks(constraints, bitmask) -> list[int] | None`` (a
# static or class method) fills one row of ``bitmask`` per distinct state among
# several of its instances, rows ``0..k-1`` written whole, and returns the row
# holding each instance's mask (None: row ``i`` is instance ``i``'s). On CUDA the
# engine prefers it to ``fill_bitmasks`` when a step's constrained rows are all of
# that class: the device then reads the shared rows where they are.
#
# Optional: ``accept_tokens(constraints, tokens) -> list[int]`` (static or class
# method) accepts ``tokens[i]`` into ``constraints[i]`` for several instances in one
# call, giving per row 0 (refused, state unchanged), 1 (taken) or 2 (taken, and the
# constraint is now terminated). The engine uses it for the unmasked greedy picks of
# a pipelined step; if it raises, every constraint in the call fails its request.
#
# Optional: ``forces_text() -> bool`` (a method): whether the constraint fixes the
# next bytes of text whatever token comes (a JSON key, punctuation). A greedy request
# masked since its model's pick broke the grammar goes back to unmasked picks once its
# masked picks are the model's own argmax; the engine does not count an agreement
# where this is True, which shows nothing of how well the model follows the grammar.
#
# Optional: ``narrow_choice() -> bool`` (a method): whether the constraint allows
# fewer than half of the vocabulary's tokens next (punctuation, a number's digits;
# forced text among them). When a constraint has it, the engine asks it rather than
# ``forces_text``: an agreement counts only where the choice is wide (inside a JSON
# string), since the row's next pick goes unmasked, and where the grammar leaves few
# tokens that pick is often refused.
#
# Optional: ``batch_acceptor(constraints) -> Callable[[list[int]], list[int]]``
# (static or class method) prepares ``accept_tokens`` for a fixed list of its
# instances: the engine calls the answer once a step, with that step's tokens, for
# as many steps as the same rows run (the steady state of a large batch), so the
# per-instance preparation is paid once. Verdicts and failures as ``accept_tokens``.
#
# Optional: ``prepare(constraints)`` (static or class method) readies several of its
# instances for their first step (xgrammar's matchers fork their grammar's start
# state then, not when made). The engine calls it for the step that launches their
# requests' prefill, once that step is on its way to the device.


# Optional: ``take_forced_tokens(limit) -> list[int]`` (a method) accepts the tokens
# the constraint fixes from here, at most ``limit``, and returns them (the engine's
# jump-forward at a request's start, ``EngineConfig.jump_forward``): a class may take
# them faster than :func:`accept_forced_tokens` does (xgrammar's new matchers fork a
# matcher that took their grammar's opening).


def take_forced_tokens(constraint: LogitsConstraint, limit: int) -> list[int]:
    """The tokens ``constraint`` fixes from here, at most ``limit``, accepted into
    it: its ``take_forced_tokens`` hook's, else :func:`accept_forced_tokens`."""
    hook = getattr(constraint, "take_forced_tokens", None)
    return list(hook(limit)) if hook is not None else accept_forced_tokens(constraint, limit)


def accept_forced_tokens(constraint: LogitsConstraint, limit: int) -> list[int]:
    """``constraint.forced_tokens()``, at most ``limit``, accepted one by one up to
    the first it refuses: those accepted."""
    taken: list[int] = []
    for token in constraint.forced_tokens()[:max(limit, 0)]:
        if not constraint.accept(token):
            break
        taken.append(token)
    return taken


def bitmask_words(vocab_size: int) -> int:
    """Number of int32 words of one bitmask row for ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32

"""Requests coming in: validated into sequences, queued, and given the tokens
their constraint fixes at their start (jump-forward).
"""

from __future__ import annotations

import functools
import itertools
import secrets
from collections.abc import Sequence as SequenceABC

import torch

from formcast.engine.constraint import LogitsConstraint, take_forced_tokens
from formcast.engine.errors import RequestError
from formcast.engine.output import OutputProcessor
from formcast.engine.sampling_params import SamplingParams
from formcast.engine.scheduler import Scheduler
from formcast.engine.sequence import Request, Sequence


class RequestIntake:
    """Makes and queues the engine's sequences.

    Parameters
    ----------
    scheduler : Scheduler
        Where sequences queue.
    output : OutputProcessor
        Holds them in flight (ids are unique among those).
    vocab_size : int
        The model's: prompt token ids must lie below it.
    max_model_len : int
        The longest sequence, prompt and output.
    device : torch.device
        Where a request's generator draws.
    eos_token_ids : frozenset[int]
        Tokens that end a request: a jump forward never takes one.
    jump_forward : bool
        Take a constrained request's fixed opening into its prefill.
    """

    def __init__(self, scheduler: Scheduler, output: OutputProcessor, *, vocab_size: int,
                 max_model_len: int, device: torch.device, eos_token_ids: frozenset[int],
                 jump_forward: bool) -> None:
        self.scheduler, self.output = scheduler, output
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.device, self.eos_token_ids = device, eos_token_ids
        self.jump_forward = jump_forward
        self._ids = itertools.count()

    def next_id(self, prefix: str = "req") -> str:
        """A fresh request id."""
        return f"{prefix}-{next(self._ids)}"

    def make(self, prompt: Request | SequenceABC[int], params: SamplingParams | None,
             constraint: LogitsConstraint | None, request_id: str | None) -> Sequence:
        """A sequence for the request, validated (raises :class:`RequestError`)."""
        prompt, params, constraint, request_id = Request.unpack(prompt, params, constraint,
                                                                request_id)
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, (str, bytes)):
            raise RequestError("prompt must be a list of token ids; encode text with "
                               "engine.tokenizer.encode(...) first")
        ids = list(prompt)
        if not ids:
            raise RequestError("prompt is empty: a request needs at least one token")
        vocab = self.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt holds token ids outside [0, {vocab}): {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise RequestError(
                f"prompt has {len(ids)} tokens but the context holds {self.max_model_len} "
                "(prompt + output); shorten the prompt")
        if constraint is not None and not _conforms(type(constraint)):
            raise RequestError(f"constraint {type(constraint).__name__} does not implement "
                               "LogitsConstraint (fill_bitmask, accept, rollback, ...)")
        if request_id is None:
            request_id = self.next_id()
        elif request_id in self.output.requests:
            raise RequestError(f"request id {request_id!r} is already in flight")
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        return Sequence(request_id, ids, params, constraint, (self.device, seed),
                        self.max_model_len, epochs=self.scheduler.epochs)

    def queue(self, seq: Sequence) -> bool:
        """Hand ``seq`` to the scheduler, its constraint's fixed opening appended
        when jumping forward; False when its constraint failed there (the request
        ended: its output is owed to the next step)."""
        self.output.start(seq)
        self.scheduler.add(seq)
        if seq.constraint is not None and self.jump_forward:
            return self._jump_forward(seq)
        return True

    def _jump_forward(self, seq: Sequence) -> bool:
        """Append the tokens ``seq``'s constraint fixes at its start to its prompt's
        prefill (:attr:`EngineConfig.jump_forward`); a constraint that fails here
        ends the request with its error (False)."""
        params = seq.params
        limit = seq.max_total_len - len(seq.token_ids) - 1  # (one left to sample)
        if limit <= 0 or params.stop or seq.logprobs is not None or \
                len(seq.token_ids) > seq.num_prompt_tokens:
            return True
        constraint = seq.constraint
        try:
            tokens = take_forced_tokens(constraint, limit)
            if len(tokens) > limit:
                raise ValueError(f"take_forced_tokens({limit}) took {len(tokens)} tokens")
            ends = set(params.stop_token_ids)
            if not params.ignore_eos:
                ends.update(self.eos_token_ids)
            if ends.intersection(tokens):  # (grammars force none: a caller's stop token)
                constraint.rollback(len(tokens))
                return True
        except Exception as exc:
            seq.error = f"constraint failed: {type(exc).__name__}: {exc}"
            self.output.finish(seq, "abort")
            return False
        for token in tokens:
            seq.token_ids.append(token)
            seq.defer_text(token)
        seq.num_forced_tokens += len(tokens)
        return True


@functools.cache
def _conforms(kind: type) -> bool:
    """Whether instances of ``kind`` implement LogitsConstraint (the protocol's
    structural check is slow: a batch of constrained requests checks each class once)."""
    return issubclass(kind, LogitsConstraint)

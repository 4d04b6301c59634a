"""What a sampled token does to its request: append, stop strings, finish,
rollback out of a dead end, and incremental detokenization.

:class:`OutputProcessor` owns the requests in flight (by id) and the count of
requests ended, which the pipeline compares to know whether a row ended under it.
"""

from __future__ import annotations

import itertools
import time

import torch

from formcast.engine.block_manager import BlockManager
from formcast.engine.constraint import LogitsConstraint, ops_for
from formcast.engine.sampler import Sampler
from formcast.engine.scheduler import Scheduler
from formcast.engine.sequence import Sequence, SequenceStatus, TokenLogprob
from formcast.engine.detokenizer import IncrementalDetokenizer
from formcast.engine.tokenizer import Tokenizer

FINISHED = SequenceStatus.FINISHED


class OutputProcessor:
    """Appends tokens to requests and ends them.

    Parameters
    ----------
    tokenizer : Tokenizer
        For the requests' text.
    scheduler : Scheduler
        Told of every request that ends.
    runner
        The model runner, which lets go of an ended request's state.
    block_manager : BlockManager
        Truncated when a request rolls back out of a dead end.
    eos_token_ids : frozenset[int]
        The tokens that end a request (unless it ignores them).
    max_rollbacks : int
        ``EngineConfig.max_constraint_rollbacks``.
    keep_graves : bool
        Keep the constraints of ended requests in :attr:`graves` for the host's
        waits to drop (:class:`formcast.engine.chores.HostChores`), rather than
        letting them go on the caller's path.
    graves_kept : int
        The most kept; past it half are dropped at once.
    """

    def __init__(self, tokenizer: Tokenizer, scheduler: Scheduler, runner,
                 block_manager: BlockManager, eos_token_ids: frozenset[int], *,
                 max_rollbacks: int, keep_graves: bool, graves_kept: int) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.runner = runner
        self.block_manager = block_manager
        self.eos_token_ids = eos_token_ids
        self.max_rollbacks = max_rollbacks
        self.requests: dict[str, Sequence] = {}  # in flight, by id
        self.num_finishes = 0  # calls of finish: a step in flight whose count moved lost rows
        self.graves: list[LogitsConstraint] = []  # ended requests' constraints (see above)
        self.keep_graves = keep_graves
        self._graves_kept = graves_kept

    def start(self, seq: Sequence) -> None:
        """Hold ``seq`` as in flight, with a detokenizer of its own."""
        self.requests[seq.request_id] = seq
        seq.detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=True)

    def settle_all(self, seqs: list[Sequence], result) -> None:
        """Give each of ``seqs`` its token of a sampler ``result``."""
        for i, seq in enumerate(seqs):
            self.settle(seq, result.token_ids[i], result.logprobs[i], result.errors.get(i))

    def settle(self, seq: Sequence, token: int, logprob: TokenLogprob | None,
               error: str | None) -> bool:
        """Give ``seq`` its sampled token, or handle the sampling's ``error``: roll
        back out of the dead end (the value is resampled next step) or end the
        request. True when the token was appended."""
        if error is None:
            self.append_token(seq, token, logprob)
            return True
        if not self.roll_back_dead_end(seq):
            seq.error = dead_end_message(seq, error)
            self.finish(seq, "abort")
        return False

    def settle_on_host(self, seqs: list[Sequence], both: torch.Tensor) -> None:
        """Give ``seqs`` their tokens from ``both`` ``[2, B]`` (tokens, dead-end
        flags) on the device, waiting for them."""
        token_list, dead_list = both.tolist()
        errors: dict[int, str] = {}
        token_list = Sampler.finish_rows(token_list, dead_list, errors)
        for i, seq in enumerate(seqs):
            self.settle(seq, token_list[i], None, errors.get(i))

    def roll_back_dead_end(self, seq: Sequence) -> bool:
        """Back a request out of a dead end its constraint can explain; False if not.

        A constraint whose finished value failed an end check (``rollback_hint() > 0``)
        is rolled back to the step holding the offending value, and so are the
        request's tokens, text and KV cache; the token sampled at that step is banned
        there, so the next step samples something else. At most ``max_rollbacks``
        times per request.
        """
        constraint = seq.constraint
        if constraint is None or seq.num_rollbacks >= self.max_rollbacks:
            return False
        try:
            k = int(ops_for(type(constraint)).rollback_hint(constraint))
        except Exception:
            return False
        if not 0 < k <= seq.num_output_tokens:
            return False
        keep = len(seq) - k
        try:
            # the last kept token is fed again: its logits choose the new token at `keep`
            self.block_manager.truncate(seq, keep - 1)
            seq.constraint.rollback(k)
        except (RuntimeError, ValueError) as exc:
            seq.error = f"rolling back failed: {exc}"
            return False
        banned = seq.token_ids[keep]
        del seq.token_ids[keep:]
        if seq.logprobs is not None:
            del seq.logprobs[seq.num_output_tokens:]
        seq.ban(keep, banned)
        seq.num_rollbacks += 1
        seq.detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=True)
        seq.text = seq.detok.feed_many(seq.output_ids)
        return True

    def append_taken(self, seqs: list[Sequence], tokens: list[int],
                     verdicts: list[int] | None = None, *, quiet: bool = False) -> None:
        """:meth:`append_token` of each of ``seqs``' ``tokens`` that its
        constraint (if any) took, by a batch accept's ``verdicts`` (rows under 1
        are skipped; None: every row took its token and none ended its
        constraint), without logprobs. A token that cannot end its request (no
        end-of-sequence or stop token, no stop strings to look for, room left,
        not the first) is appended here in two list appends: every row, every step.
        ``quiet``: that is known of every row."""
        if quiet and verdicts is None:
            for seq, token in zip(seqs, tokens):  # (Sequence.defer_text, inline)
                seq.token_ids.append(token)
                seq._undecoded.append(token)
            return
        eos, append = self.eos_token_ids, self.append_token
        for seq, token, verdict in zip(seqs, tokens, verdicts or itertools.repeat(1)):
            if verdict == 1 and seq.ends_on_length_only and token not in eos and \
                    len(seq.token_ids) + 1 < seq.max_total_len and seq.first_token_time:
                seq.token_ids.append(token)
                seq._undecoded.append(token)
            elif verdict > 0:
                append(seq, token, None, accepted=True, terminated=verdict == 2)

    def append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None, *,
                     accepted: bool = False, terminated: bool | None = None) -> None:
        """Append a sampled token; ``accepted``: the constraint took it already
        (``terminated``, when known: whether that ended the constraint)."""
        if seq.constraint is not None and not accepted:
            try:
                ok = seq.constraint.accept(token)
            except Exception as exc:
                ok, seq.error = False, f"constraint failed: {type(exc).__name__}: {exc}"
            if not ok:
                seq.error = seq.error or f"constraint rejected sampled token {token}"
                self.finish(seq, "abort")
                return
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
        seq.token_ids.append(token)
        if seq.logprobs is not None and logprob is not None:
            seq.logprobs.append(logprob)
        params = seq.params
        is_eos = token in self.eos_token_ids and not params.ignore_eos
        if not is_eos:
            if params.stop:
                self._append_text(seq, token)
            else:  # nothing reads the text before the request's output does
                seq.defer_text(token)
        if is_eos or token in params.stop_token_ids:
            self.finish(seq, "stop")
        elif seq.status is FINISHED:
            return  # a stop string matched
        elif seq.constraint is not None and (
                seq.constraint.is_terminated() if terminated is None else terminated):
            self.finish(seq, "stop")
        elif len(seq.token_ids) >= seq.max_total_len:
            self.finish(seq, "length")

    def _append_text(self, seq: Sequence, token: int) -> None:
        """Detokenize now and look for the request's stop strings."""
        stops = seq.params.stop
        delta = seq.detok.feed(token)
        if not delta:
            return
        before = len(seq.text)
        seq.text += delta
        longest = max(len(s) for s in stops)
        window_start = max(0, before - longest + 1)
        hits = [(seq.text.find(s, window_start), s) for s in stops]
        hits = [(pos, s) for pos, s in hits if pos >= 0]
        if hits:
            pos, s = min(hits)
            cut = pos + len(s) if seq.params.include_stop_str_in_output else pos
            seq.text = seq.text[:cut]
            self.finish(seq, "stop")

    def finish(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` (``reason``: "stop", "length" or "abort") and let go of it."""
        self.num_finishes += 1
        if not seq.is_finished:
            self.scheduler.finish(seq, reason)
        self.runner.release(seq)
        self.requests.pop(seq.request_id, None)
        if seq.constraint is not None and self.keep_graves:
            self.graves.append(seq.constraint)
            if len(self.graves) > self._graves_kept:  # (no device time to drop them in)
                del self.graves[:self._graves_kept // 2]
        # (a batch's rows ending at once each detokenize their whole output here;
        # making the text when the output is read, past the step, measured no better)
        if seq.detok is not None:
            text = seq.text  # every token's text made while the detokenizer is here
            if reason != "stop":
                text += seq.detok.flush()  # bytes of a character cut off at the end
            seq.text, seq.detok = text, None


def dead_end_message(seq: Sequence, error: str) -> str:
    """The sampler's error, with why the constraint refused to end and what was tried."""
    constraint = seq.constraint
    why = ops_for(type(constraint)).last_violation(constraint) if constraint is not None \
        else None
    parts = [error]
    if why:
        parts.append(f"the finished value fails its end check: {why}")
    if seq.num_rollbacks:
        parts.append(f"after {seq.num_rollbacks} rollback(s) to resample it")
    if seq.error:
        parts.append(seq.error)
    return "; ".join(parts)

"""Requests as the user hands them in, and the engine's mutable state for each."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from formcast.engine.constraint import LogitsConstraint
from formcast.engine.sampling_params import SamplingParams

FinishReason = str  # "stop" | "length" | "abort"


@dataclass(frozen=True, kw_only=True)
class Request:
    """One generation request: prompt token ids, sampling parameters, optional constraint."""

    prompt_token_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    constraint: LogitsConstraint | None = None
    request_id: str | None = None

    @staticmethod
    def unpack(prompt, params, constraint, request_id) -> tuple:
        """``add_request``'s arguments as (prompt ids, params, constraint, request id):
        a :class:`Request` in ``prompt`` fills whatever the other arguments leave None."""
        if isinstance(prompt, Request):
            return (prompt.prompt_token_ids, params or prompt.params,
                    constraint or prompt.constraint, request_id or prompt.request_id)
        return prompt, params, constraint, request_id


@dataclass(frozen=True, kw_only=True)
class TokenLogprob:
    """Log-prob of the chosen token and of the most likely alternatives at one step."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, kw_only=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_prompt_tokens: int
    # speculative decoding: draft tokens verified, of them accepted, of those forced
    # by the grammar (jump-forward), and positions the target model scored to verify
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_forced_tokens: int = 0
    num_verification_tokens: int = 0


@dataclass(frozen=True, kw_only=True)
class RequestOutput:
    """A snapshot of one request's output (final when ``finished`` is True)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finished: bool
    finish_reason: FinishReason | None
    logprobs: tuple[TokenLogprob, ...] | None
    metrics: RequestMetrics
    error: str | None = None


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class SamplingEpochs:
    """Counts of the changes in how a group of sequences (one engine's) sample.

    ``sampling`` counts the changes of any one's way of sampling (``masked``,
    banned tokens): a list of them sorted by it once stays sorted while the
    count holds. ``bans`` counts their bans (:meth:`Sequence.ban`).
    """

    __slots__ = ("sampling", "bans")

    def __init__(self) -> None:
        self.sampling = 0
        self.bans = 0


class Sequence:
    """The engine's state of one request: tokens, KV blocks, progress, sampler state.

    ``epochs`` counts the changes in how it samples, shared by the sequences of
    one engine (its scheduler's; a fresh count when None).
    """

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 constraint: LogitsConstraint | None,
                 generator: torch.Generator | tuple[torch.device, int],
                 max_total_len: int, *, epochs: SamplingEpochs | None = None) -> None:
        self.request_id = request_id
        self.epochs = epochs if epochs is not None else SamplingEpochs()
        self.token_ids: list[int] = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self._prompt_tuple: tuple[int, ...] | None = None  # (for outputs)
        self.params = params
        self.constraint = constraint
        # a torch.Generator, or the (device, seed) of one made when first asked
        # for: greedy requests never draw, and a CUDA generator costs microseconds
        self._generator = generator
        # generation stops at max_tokens or when the context is full
        self.max_total_len = min(max_total_len, self.num_prompt_tokens + params.max_tokens)
        # no stop strings or stop tokens: a token that is not an end-of-sequence
        # token ends the request only by its length
        self.ends_on_length_only = not params.stop and not params.stop_token_ids
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # hashes of the leading full, computed blocks
        # the block tables of the model's further KV groups (kv_groups), if any
        self.group_tables: list[list[int]] = []
        self.num_computed_tokens = 0   # tokens whose KV is in the cache
        self.num_cached_prompt_tokens = 0
        self.num_preemptions = 0
        self.num_rollbacks = 0         # constraint dead ends backed out of
        # position -> token ids the sampler must not pick there (set by rollbacks)
        self.banned_tokens: dict[int, set[int]] = {}
        # unmasked greedy picks (EngineConfig.unmasked_greedy): masks serve the
        # request since a refused pick, until this many masked picks in a row
        # were its unmasked argmax; refused picks since one was taken
        self.masked = False
        self.agreements_due = 0
        self.refusal_streak = 0
        self.draft = None              # spec.Draft to verify in the next step, if any
        self.num_draft_tokens = 0
        self.num_accepted_draft_tokens = 0
        self.num_forced_tokens = 0
        self.num_verification_tokens = 0
        self.spec_lookup_proposed = 0  # prompt-lookup tokens verified / accepted,
        self.spec_lookup_accepted = 0  # for the proposer's confidence estimate
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.detok = None              # the engine's IncrementalDetokenizer, while it runs
        self._text = ""
        self._undecoded: list[int] = []  # output tokens whose text is not made yet
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.arrival_time = time.perf_counter()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def generator(self) -> torch.Generator:
        """The request's random generator, seeded with :attr:`seed`."""
        made = self._generator
        if not isinstance(made, torch.Generator):
            device, seed = made
            made = self._generator = torch.Generator(device=device).manual_seed(seed)
        return made

    @property
    def generator_made(self) -> bool:
        """Whether :attr:`generator` was made yet (a request that never draws makes none)."""
        return isinstance(self._generator, torch.Generator)

    @property
    def seed(self) -> int:
        """The seed of :attr:`generator` (read without making it)."""
        made = self._generator
        return made.initial_seed() if isinstance(made, torch.Generator) else made[1]

    @property
    def text(self) -> str:
        """The output's text; tokens appended with :meth:`defer_text` are
        detokenized when it is read (most steps of most requests need no text)."""
        if self._undecoded:
            self._text += self.detok.feed_many(self._undecoded)
            self._undecoded.clear()
        return self._text

    @property
    def num_undecoded(self) -> int:
        """Output tokens whose text is not made yet (made when :attr:`text` is read)."""
        return len(self._undecoded)

    @text.setter
    def text(self, value: str) -> None:
        self._undecoded.clear()
        self._text = value

    def pick_refused(self) -> None:
        """Its unmasked greedy pick was refused: masks serve it until 2, 4, 8 or
        16 masked picks in a row (as refusals repeat) are its unmasked argmax.

        (Two after a first refusal rather than one: each refusal costs the
        request a step, and at the end of a batch the rows set back most are
        what the batch waits for: fewer refusals measured, the same tokens.)"""
        self.refusal_streak += 1
        self._mask_until_agreed()

    def masked_pick_seen(self, agreed: bool) -> None:
        """A masked greedy pick was (``agreed``) or was not its unmasked argmax.
        One that was not masks the request from then on (as a refused pick
        would, without a step lost to it), until 1 (never refused) to 16 (as
        after its refusals) masked picks in a row agree."""
        if not agreed:
            self._mask_until_agreed()
        elif self.masked:
            self.agreements_due -= 1
            if self.agreements_due <= 0:
                self.masked = False
                self.epochs.sampling += 1

    @staticmethod
    def masked_picks_missed(seqs: Iterable[Sequence]) -> None:
        """Masks serve each of ``seqs`` until 1 << min(refusals in a row, 4)
        masked picks in a row are its unmasked argmax: :meth:`masked_pick_seen`
        of picks that were not, in one loop (a batch's opening: 256 rows masked
        while the grammar fixes the text, every step)."""
        changed = None  # (one that changed: they share their epochs)
        for s in seqs:
            if not s.masked:
                s.masked, changed = True, s
            s.agreements_due = 1 << min(s.refusal_streak, 4)
        if changed is not None:
            changed.epochs.sampling += 1

    def premask(self) -> None:
        """Masked from its next pick on, before any pick of it was refused (the
        engine's premasking: its model tends to break the grammar here), until a
        masked pick is its unmasked argmax (more in a row after refusals in a
        row, as :meth:`_mask_until_agreed` counts them)."""
        self._mask_until_agreed()

    def _mask_until_agreed(self) -> None:
        """Its own :meth:`masked_picks_missed`."""
        Sequence.masked_picks_missed((self,))

    def ban(self, position: int, token_id: int) -> None:
        """The sampler must not pick ``token_id`` at ``position`` (a dead end
        backed out of); bans at later positions are dropped."""
        self.banned_tokens = {p: t for p, t in self.banned_tokens.items() if p <= position}
        self.banned_tokens.setdefault(position, set()).add(token_id)
        self.epochs.sampling += 1
        self.epochs.bans += 1

    def defer_text(self, token_id: int) -> None:
        """Append ``token_id``'s text the next time :attr:`text` is read. (The
        engine's loop over a step's rows appends to ``_undecoded`` itself: at a
        large batch the calls cost as much as the appends.)"""
        self._undecoded.append(token_id)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def to_output(self) -> RequestOutput:
        # (a step builds one for every request that took a token: each field is
        # set in one dict update, not through the frozen dataclasses' __init__,
        # which sets them one by one and costs several times as much)
        prompt = self._prompt_tuple
        if prompt is None:
            prompt = self._prompt_tuple = tuple(self.token_ids[:self.num_prompt_tokens])
        metrics = object.__new__(RequestMetrics)
        metrics.__dict__.update(
            arrival_time=self.arrival_time,
            first_scheduled_time=self.first_scheduled_time,
            first_token_time=self.first_token_time,
            finished_time=self.finished_time,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=len(self.token_ids) - self.num_prompt_tokens,
            num_cached_prompt_tokens=self.num_cached_prompt_tokens,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_draft_tokens=self.num_accepted_draft_tokens,
            num_forced_tokens=self.num_forced_tokens,
            num_verification_tokens=self.num_verification_tokens)
        out = object.__new__(RequestOutput)
        out.__dict__.update(
            request_id=self.request_id,
            prompt_token_ids=prompt,
            token_ids=tuple(self.token_ids[self.num_prompt_tokens:]),
            text=self.text,
            finished=self.status is SequenceStatus.FINISHED,
            finish_reason=self.finish_reason,
            logprobs=tuple(self.logprobs) if self.logprobs is not None else None,
            metrics=metrics,
            error=self.error)
        return out

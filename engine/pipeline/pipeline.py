"""Asynchronous steps: in steady decoding each step launches the next forward on
the device with the previous step's sampled tokens, still on the device, as its
input, and only then takes those tokens on the host (grammars, text, stops, the
next masks) while the device runs.

A request that turns out finished has its extra row dropped. Anything else (a
new request, a draft, a dead end to roll back, logprobs) drains the pipeline and
runs an ordinary step. Outputs are those of ordinary steps, one step later.

:meth:`Pipeline.step` is the pipelined step; its usual case in a large
constrained batch takes :class:`formcast.engine.pipeline.fast_lane.FastLane`.
"""

from __future__ import annotations

import torch

from formcast.engine.block_manager import BlockManager
from formcast.engine.chores import HostChores
from formcast.engine.config import EngineConfig
from formcast.engine.constraint_ops import MaskThread
from formcast.engine.errors import EngineError
from formcast.engine.kernels import current_stream, event_poll, to_device
from formcast.engine.output import OutputProcessor
from formcast.engine.pipeline.accept_thread import AcceptThread
from formcast.engine.pipeline.fast_lane import FastLane
from formcast.engine.pipeline.premask import Premasker
from formcast.engine.pipeline.sampling import RowSampler
from formcast.engine.pipeline.state import HostSlots, InFlight, PipelineStats, Room, without
from formcast.engine.pipeline.take import Taker
from formcast.engine.sampler import Sampler
from formcast.engine.scheduler import Scheduler
from formcast.engine.sequence import Sequence, SequenceStatus
from formcast.engine.speculative.decoding import SpeculativeDecoder
from formcast.engine.tokenizer import Tokenizer

FINISHED = SequenceStatus.FINISHED


class Pipeline:
    """The step in flight and everything that takes, samples and launches it.

    Parameters
    ----------
    config : EngineConfig
        The engine's (its tuning, block size, batch bounds, accept switches).
    scheduler, block_manager, runner, sampler, output, chores, speculative
        The engine's parts this shares.
    masks : MaskThread
        The engine's mask thread.
    tokenizer : Tokenizer
        For premasking's look at the tokens' text.
    device : torch.device
        Where the steps run.
    eos_token_ids : frozenset[int]
        The tokens that end a request.
    """

    def __init__(self, config: EngineConfig, scheduler: Scheduler, block_manager: BlockManager,
                 runner, sampler: Sampler, output: OutputProcessor, chores: HostChores,
                 speculative: SpeculativeDecoder, masks: MaskThread, tokenizer: Tokenizer, *,
                 device: torch.device, eos_token_ids: frozenset[int]) -> None:
        self.tuning = tuning = config.tuning
        self.max_batched_tokens = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.block_size = config.block_size
        self.native_accept = config.native_accept
        self.scheduler, self.block_manager, self.runner = scheduler, block_manager, runner
        self.sampler, self.output, self.chores = sampler, output, chores
        self.speculative = speculative
        self.device, self.eos_token_ids = device, eos_token_ids
        self.stats = PipelineStats()
        self.premasker = Premasker(tokenizer, tuning, self.stats)
        self.rows = RowSampler(sampler, runner, output, self.premasker, masks, scheduler.epochs,
                               unmasked_greedy=config.unmasked_greedy, tuning=tuning)
        self.accept = AcceptThread(tuning)
        self.taker = Taker(output, chores, self.premasker, self.rows, lambda seqs: self.room_of(seqs),
                           eos_token_ids=eos_token_ids, tuning=tuning, stats=self.stats)
        self.inflight: InFlight | None = None  # a launched step the host has not taken
        self.lane = FastLane(self)  # (and the step after the one in flight, launched ahead)
        self.host_slots: HostSlots | None = None  # where in-flight steps land (CUDA)
        self.room: Room | None = None  # (see room_of)

    def configure(self, config: EngineConfig) -> None:
        """Take the fields of ``config`` read as the steps run."""
        self.native_accept = config.native_accept
        self.rows.unmasked_greedy = config.unmasked_greedy

    def step(self) -> list[Sequence] | None:
        """A pipelined step, when the running requests allow one: launch a decode
        step for every running request, take the last step's tokens while it
        runs, sample it on the device. Returns the requests that took a token or
        ended; None when an ordinary step must run instead (:meth:`drain` first)."""
        if not self.can_step():
            return None
        taken = self._pipelined_step()
        if self.inflight is None or self.inflight.early is None:
            self.accept.quick_switches(False)  # (no picks left with the accept thread)
        self.chores.commit_quota()
        return taken

    def opening(self, plan, plain: list[Sequence]) -> tuple | None:
        """Whether ``plan``, an ordinary step whose rows ``plain`` sample, puts its
        sampled tokens in flight as a pipelined step's (:meth:`launch_opening`):
        its rows sorted for that (as :meth:`RowSampler.sort` sorts a batch's
        first picks), else None."""
        if not self._opens_in_flight(plan, plain):
            return None
        return self.rows.sort(plain, None, first=True)

    def launch_opening(self, logits: torch.Tensor, plain: list[Sequence], first: tuple) -> bool:
        """Sample ``plain``'s first tokens from ``logits`` on the device and hold
        them in flight; False (nothing done) when a constraint failed to fill
        its mask, for the ordinary way to report."""
        picked = self.rows.sample(logits, plain, None, first=first)
        if picked is None:
            return False
        both, unchecked, watched, agree, free, masked = picked
        self.launch_inflight(plain, both, logits, unchecked, watched, agree, free, masked,
                             self.output.num_finishes)
        return True

    def let_go(self) -> None:
        """No request is left: let go of the rows (and with them of the finished
        requests, their constraints and token lists) rather than holding them
        until the next batch's first steps replace them, on the host's path."""
        self.room = None
        self.rows.forget()
        self.premasker.forget()
        self.accept.acceptor.reset()
        self.taker.masked_acceptor.reset()

    def can_step(self) -> bool:
        sched, prev = self.scheduler, self.inflight
        running = sched.running
        if sched.waiting or not running or len(running) > self.max_batched_tokens:
            return False
        if self.speculative.drafts(running):
            return False  # drafts are made from tokens the host has
        if prev is not None:
            # (the rows in flight, unchanged since: their state is the pipeline's own.
            # Sequences compare by identity, so the list comparison runs in C)
            if prev.void:
                return False  # a row's state moved under it (a dead end backed out)
            running = list(running)
            if prev.seqs == running:
                return True
            # requests that ended since it launched lose their rows when it is taken
            return self.output.num_finishes != prev.finishes and \
                [s for s in prev.seqs if s.status is not FINISHED] == running
        return all(s.num_uncomputed_tokens == 1 and s.params.logprobs is None for s in running)

    def _opens_in_flight(self, plan, plain: list[Sequence]) -> bool:
        """Whether ``plan``'s sampled tokens go in flight (:meth:`launch_inflight`)
        rather than to the host in its step: every running request samples in
        it (``plain``: no drafts), in the running order, none wants logprobs,
        nothing waits, and the steps after it can pipeline. A large batch's
        first step then costs the device no wait for the host's sampling and
        its constraints' first accepts; a small one keeps its first token one
        step sooner."""
        sched = self.scheduler
        if len(plain) < self.tuning.first_in_flight_rows or len(plain) != len(plan.scheduled) \
                or sched.waiting or len(plain) > self.max_batched_tokens:
            return False
        if [item.seq for item in plan.scheduled] != list(sched.running) or \
                self.speculative.drafts(plain):
            return False
        return all(s.params.logprobs is None for s in plain)

    def _pipelined_step(self) -> list[Sequence] | None:
        """Launch a decode step for every running request, take the last step's
        tokens while it runs, sample it on the device. None (nothing changed) when
        the KV cache has no room for it."""
        prev, bm, output = self.inflight, self.block_manager, self.output
        running = list(self.scheduler.running)
        if prev is None or self.room_of(running).tokens > 1:
            launch = running
        else:  # a request whose token in flight is its last gets no row
            launch = [s for s in running if len(s.token_ids) + 1 < s.max_total_len]
        ahead = self.lane.ahead
        if ahead is not None and ahead.seqs == launch:
            self.lane.ahead = None
            logits = ahead.logits  # (launched by the last step, its blocks grown then)
        else:
            self.lane.drop_ahead()
            if not bm.grow_decode(launch):
                return None  # an ordinary step preempts
            if prev is None:
                tokens = to_device([s.token_ids[-1] for s in launch], torch.long, self.device)
            elif len(launch) == len(prev.seqs):
                tokens = prev.tokens
            else:
                keep = set(launch)
                tokens = prev.tokens[to_device([i for i, s in enumerate(prev.seqs) if s in keep],
                                               torch.long, self.device)]
            try:
                logits = self.runner.execute_decode(launch, tokens) if launch else None
            except Exception as exc:
                raise EngineError(f"model forward failed: {type(exc).__name__}: {exc}") from exc
        self.stats.num_pipelined_steps += 1
        self.inflight = None
        self.rows.masks_ahead = None
        finishes = output.num_finishes
        taking = early = None
        if prev is not None:
            taking = self.taker.begin(prev, defer=True)
            if taking.pending is not None and len(launch) == len(prev.seqs) and \
                    finishes == prev.finishes == output.num_finishes:
                # the accept thread is checking the unmasked picks, every row launched
                # again and none ended: sample every row while it works; those whose
                # pick turns out refused are sampled again over their draws
                try:
                    self.premasker.landed(taking)
                    early = self.rows.sample(logits, launch, None)
                    taking.sampled = True
                except BaseException:
                    self.taker.end(taking)  # (the checked picks are appended before we go)
                    raise
        if early is not None:
            try:
                lane = self.lane.run(taking, launch, logits, early)
            except BaseException:
                self.taker.end(taking)
                raise
            if lane is not None:
                filled, settled = lane
                self.accept.let_in(self.inflight)
                taken = self.taker.end(taking)[0]  # (refused rows: sampled again already)
                bm.defer_commits(filled)  # (hashed once their last token is there)
                return taken + settled
        checked_from = output.num_finishes
        taken, ok, refused = self.taker.end(taking) if taking is not None else ([], None, [])
        if early is not None:
            return taken + self.launch_sampled(prev, launch, logits, early, ok, refused,
                                                 checked_from)
        # (the rows in flight all launched again and none ended: rows stay in place)
        same = ok is None or finishes == output.num_finishes and len(launch) == len(prev.seqs)
        if same and (ok is None or len(ok) + len(refused) == len(launch)):
            # every row took its token or had its pick refused (the usual step): the
            # rest stay
            rows, live = range(len(launch)), launch
            if refused:
                drop = sorted(refused)
                rows, live = without(rows, drop), without(launch, drop)
        else:
            same = False
            # a request that finished, backed out of a dead end or had its pick
            # refused drops its row
            rows = [i for i, s in enumerate(launch) if s.status is not FINISHED and s in ok]
            live = [launch[i] for i in rows]
        self.advance(live)
        # rows whose unmasked pick was refused: sampled again under their masks
        fixed, fixed_both, settled = self.rows.resample(prev, refused) if refused else ([], None, [])
        if settled:  # (ended, or backed out of a dead end)
            taken = taken + [prev.seqs[i] for i in settled]
        if not live and not fixed:
            return taken
        picked = None
        if live:
            # (rows are read where they lie: no copy of the step's logits)
            picked = self.rows.sample(logits, live, None if len(rows) == len(launch) else rows)
            if picked is None:  # a broken constraint: the ordinary way, here and now
                masks = self.sampler.fill_masks(live)
                if len(rows) < len(launch):
                    logits = logits[to_device(rows, torch.long, logits.device)]
                output.settle_all(live, self.sampler(logits, live, masks=masks))
                if fixed:
                    output.settle_on_host(fixed, fixed_both)
                return taken + live + fixed
        both, unchecked, watched, agree, free, masked = \
            picked if picked is not None else (None, {}, [], None, [], [])
        seqs = live
        if fixed:  # in-flight rows keep the running order
            if same and len(fixed) == len(refused):  # (all launched rows are back: in place)
                seqs, at_fixed, at_live = launch, refused, rows
            else:
                members = set(live).union(fixed)
                seqs = [s for s in running if s in members]
                at = {s: k for k, s in enumerate(seqs)}
                at_fixed, at_live = [at[s] for s in fixed], [at[s] for s in live]
            dev = fixed_both.device
            merged = torch.empty(2, len(seqs), dtype=torch.long, device=dev)
            index = to_device(at_fixed + at_live, torch.long, dev)
            merged[:, index[:len(fixed)]] = fixed_both
            if live:
                merged[:, index[len(fixed):]] = both
                unchecked = {at_live[j]: r for j, r in unchecked.items()}
                watched = [at_live[j] for j in watched]
                free = [at_live[j] for j in free]
            # (rows sampled again under their masks: constrained)
            masked = sorted([at_live[j] for j in masked] + at_fixed)
            both = merged
        self.launch_inflight(seqs, both, logits, unchecked, watched, agree, free, masked,
                             output.num_finishes)
        return taken

    def room_of(self, seqs: list[Sequence]) -> Room:
        """How many more tokens every one of ``seqs`` has room for, at least, and
        whether each ends on its length only (no stop strings or stop tokens)
        and has its first token: what the pipelined steps check of every row,
        every step, found once per run of steps over the same rows. The room
        found then shrinks by at most a token a pipelined step (each takes one
        token a row); an ordinary step forgets it (:meth:`drain`)."""
        room, steps = self.room, self.stats.num_pipelined_steps
        # (found again while a row has yet to take its first token: a batch's
        # first step puts them in flight)
        if room is None or room.seqs != seqs or room.unstarted:  # (identity compares, in C)
            unstarted = not all(s.first_token_time for s in seqs)
            quiet = not unstarted and all(s.ends_on_length_only for s in seqs)
            least = min((s.max_total_len - len(s.token_ids) for s in seqs), default=0)
            room = self.room = Room(seqs=list(seqs), tokens=least, quiet=quiet, steps=steps,
                                      unstarted=unstarted)
        return Room(seqs=room.seqs, tokens=room.tokens - (steps - room.steps),
                     quiet=room.quiet, steps=steps, unstarted=room.unstarted)

    def launch_sampled(self, prev: InFlight, launch: list[Sequence], logits: torch.Tensor,
                        picked: tuple, ok: set[Sequence], refused: list[int], finishes: int,
                        filled: list[Sequence] | None = None, slot: tuple | None = None
                        ) -> list[Sequence]:
        """The rest of a pipelined step whose every row (``launch``, the rows of
        ``prev`` in order) was sampled from ``logits`` (``picked``, as
        :meth:`RowSampler.sample` gave it) while the last picks were checked: rows
        whose pick was refused are sampled again from ``prev``'s logits under
        their masks, over their draws; requests that ended (``finishes``: the
        count before the check) stay in flight, rows the next take drops.
        ``filled``: a list that takes the rows whose count filled a block, for
        the caller to hash (their tokens are not appended yet), rather than
        hashing them here. ``slot``: the host slot ``picked``'s tokens and flags
        were copied into (:meth:`copy_to_host`), copied again when a resample
        changes them. Returns the outputs beyond the take's (requests a failed
        resample settled)."""
        both, unchecked, watched, agree, free, masked = picked
        if finishes == self.output.num_finishes:  # (every other row took its token)
            live = without(launch, sorted(refused)) if refused else launch
        else:
            live = [s for s in launch if s in ok and s.status is not FINISHED]
            for i, s in enumerate(launch):  # (in none of the step's row lists: dropped when taken)
                if s.status is FINISHED:
                    unchecked.pop(i, None)
        self.advance(live, filled)
        void: set[int] = set()
        if refused:
            # (not only while rows are premasked: a take before this may have let go
            # of the refused one already)
            masked, watched, agree = unpremask(refused, masked, watched, agree)
            _, fixed_both, settled = self.rows.resample(prev, refused, into=both)
            at = refused
            if settled:  # (ended, or backed out of a dead end: void rows)
                void = set(settled)
                at = [i for i in refused if i not in void]
            if at:
                if fixed_both is not None:  # (else written into ``both`` already)
                    index = to_device(at, torch.long, both.device)
                    with torch.inference_mode():  # (the graph's output may be sampled rows)
                        both[:, index] = fixed_both
                masked = sorted(masked + at)  # (sampled again under their masks)
            for i in refused:
                unchecked.pop(i, None)  # (a premasked row's pick was masked)
        if slot is not None and refused:  # (the copy made before holds the refused picks)
            slot = self.copy_to_host(both, agree, len(watched), slot)
        self.launch_inflight(launch, both, logits, unchecked, watched, agree, free, masked,
                              finishes, void, slot=slot)
        return [launch[i] for i in sorted(void)]

    def advance(self, seqs: list[Sequence], filled: list[Sequence] | None = None) -> None:
        """Count each of ``seqs``' token in flight as computed. A block it fills is
        hashed, or, given ``filled``, its sequence put there for the caller to
        hash once the tokens are appended."""
        bs = self.block_size
        full = []
        for s in seqs:
            n = s.num_computed_tokens = s.num_computed_tokens + 1
            if not n % bs:
                full.append(s)
        if filled is not None:
            filled += full
        elif full:
            self.block_manager.defer_commits(full)

    def copy_to_host(self, both: torch.Tensor, agree, watched: int, slot: tuple | None = None
                      ) -> tuple:
        """Start copying a sampled step's ``[2, B]`` tokens and dead-end flags (and
        ``watched`` rows' ``agree`` flags) to the host: into ``slot`` (as this
        returns it) or the next host slot. Returns the host tensors and the event
        that fires once they are filled (None off CUDA)."""
        if slot is not None:
            host, agree_host, ready = slot
        elif both.is_cuda:
            if self.host_slots is None:
                self.host_slots = HostSlots(self.max_num_seqs)
            host, agree_host, ready = self.host_slots.next(both.size(1), watched)
        else:
            host, ready = torch.empty(2, both.size(1), dtype=torch.long), None
            agree_host = torch.empty(watched, dtype=torch.bool) if watched else None
        host.copy_(both, non_blocking=True)
        if watched:  # (a slot copied into again may hold more rows' flags)
            agree_host[:watched].copy_(agree, non_blocking=True)
        if ready is not None:
            ready.record(current_stream(self.device))
        return host, agree_host, ready

    def launch_inflight(self, seqs: list[Sequence], both: torch.Tensor, logits: torch.Tensor,
                         unchecked: dict[int, int], watched: list[int], agree, free: list[int],
                         masked: list[int], finishes: int, void: set[int] = frozenset(),
                         slot: tuple | None = None) -> None:
        """Start copying a sampled step's ``[2, B]`` tokens and dead-end flags (and the
        watched rows' ``agree`` flags) to the host, unless ``slot`` holds them
        already (:meth:`copy_to_host`), and hold it as the step in flight."""
        host, agree_host, ready = slot if slot is not None else \
            self.copy_to_host(both, agree, len(watched))
        step = self.inflight = InFlight(
            seqs=seqs, tokens=both[0], host=host, ready=ready,
            logits=logits if unchecked else None, unchecked=unchecked, watched=watched,
            agree=agree_host, free=free, masked=masked, finishes=finishes, void=void)
        overlap = len(unchecked) >= self.tuning.overlap_rows
        native = self.native_accept
        if overlap and (native or native is None and ready is not None):
            # the constraints' native worker offers the unmasked picks as soon as they
            # land, outside the interpreter, while the host goes on to the next step.
            # (The rows sampled under their masks were taken there too, in the same
            # trial: no gain beyond the spread, so their take stays on this thread)
            poll = event_poll(ready) if ready is not None else None
            if poll is not None or ready is None:
                step.early = self.accept.acceptor.launch(seqs, list(unchecked), host, poll)
                self.stats.num_native_accepts += step.early is not None
        self.accept.quick_switches(overlap and step.early is None)
        if overlap and step.early is None:
            # else the accept thread does, taking the interpreter lock around it
            step.early = self.accept.submit(step)

    def drain(self) -> list[Sequence]:
        """Take the step in flight, if any: afterwards every request is in an
        ordinary state (its sampled token appended)."""
        self.lane.drop_ahead()
        self.accept.quick_switches(False)
        prev, self.inflight = self.inflight, None
        outputs = self.taker.take(prev)[0] if prev is not None else []
        self.premasker.forget()  # (an ordinary step masks every row)
        # (after the take, which finds it for its rows: an ordinary step may take
        # several tokens a row without counting as a pipelined one)
        self.room = None
        # (the accept thread is done: the rows are let go)
        self.accept.acceptor.reset()
        self.taker.masked_acceptor.reset()
        return outputs


def unpremask(refused: list[int], masked: list[int], watched: list[int], agree
               ) -> tuple[list[int], list[int], torch.Tensor | None]:
    """A sampled step's ``masked`` and ``watched`` rows (``agree``: the
    watched ones' flags, on the device) without the ``refused`` ones: rows
    premasked as their pick landed (see :meth:`Premasker.landed`) whose pick
    was then refused, their masked pick drawn in a state left behind. (The
    caller samples them again from the step before.)"""
    gone = set(refused)
    if gone.isdisjoint(masked):
        return masked, watched, agree
    masked = [i for i in masked if i not in gone]
    keep = [k for k, i in enumerate(watched) if i not in gone]
    if len(keep) < len(watched):
        agree = agree[to_device(keep, torch.long, agree.device)] if keep else None
        watched = [watched[k] for k in keep]
    return masked, watched, agree

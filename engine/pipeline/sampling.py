"""Sampling a pipelined step's rows on the device: greedy rows take the graph's
argmax, masked greedy rows one masked-argmax kernel, the rest the sampler; and
sampling again, under their masks, the rows whose unmasked pick was refused.
"""

from __future__ import annotations

import itertools
import operator
from concurrent.futures import Future, wait

import torch

from formcast.engine.constraint_ops import MaskThread
from formcast.engine.kernels import to_device
from formcast.engine.output import OutputProcessor
from formcast.engine.pipeline.premask import Premasker
from formcast.engine.pipeline.state import InFlight, without
from formcast.engine.sampler import FilledMasks, Sampler
from formcast.engine.sequence import SamplingEpochs, Sequence
from formcast.engine.tuning import EngineTuning

IS_MASKED = operator.attrgetter("masked")


class RowSampler:
    """Samples pipelined steps' rows, remembering how it sorted the last step's
    rows (sorted again only when they or their way of sampling change) and the
    masks filled ahead for the next step's.

    Parameters
    ----------
    sampler : Sampler
        Masks and draws the rows that need it.
    runner
        The model runner: its decode graph's greedy picks.
    output : OutputProcessor
        Settles a row whose constraint fails to fill its mask.
    premasker : Premasker
        The check a premasked row's mask waits for.
    masks : MaskThread
        Fills masks while the host does other work.
    epochs : SamplingEpochs
        Counts the changes in how the engine's sequences sample.
    unmasked_greedy : bool
        ``EngineConfig.unmasked_greedy``.
    tuning : EngineTuning
        The engine's knobs.
    """

    def __init__(self, sampler: Sampler, runner, output: OutputProcessor, premasker: Premasker,
                 masks: MaskThread, epochs: SamplingEpochs, *, unmasked_greedy: bool,
                 tuning: EngineTuning) -> None:
        self.sampler = sampler
        self.runner = runner
        self.output = output
        self.premasker = premasker
        self.masks = masks
        self.epochs = epochs
        self.unmasked_greedy = unmasked_greedy
        self.tuning = tuning
        # (rows, epochs.sampling, unmasked_greedy, sort's answer) of the
        # last sample over a whole step's rows
        self._sorted_rows: tuple | None = None
        # (rows, epochs.bans, whether every one is a greedy constrained row
        # without bans) of the last sort
        self._uniform_rows: tuple | None = None
        # (rows, their masks: a future) filled while a pipelined step's picks were
        # checked, for its sampling
        self.masks_ahead: tuple[list[Sequence], Future] | None = None

    def forget(self) -> None:
        """Let go of the rows (no request is left)."""
        self._sorted_rows = self._uniform_rows = None

    def sample(self, logits: torch.Tensor, live: list[Sequence],
                     rows: list[int] | None, *, first: tuple | None = None):
        """Sample a pipelined step's rows on the device: ``live[j]`` from
        ``logits[rows[j]]`` (``rows`` None: row ``j``), the launched step's logits.

        Greedy rows take the graph's argmax (or one reduction) unless banned
        tokens apply, or masks serve them (constrained rows under
        ``unmasked_greedy`` off, or since a refused pick); the rest go through the
        sampler, with masks. Returns ``[2, len(live)]`` tokens and dead-end flags;
        the rows given an unmasked pick that their constraint has yet to check
        (index into ``live`` -> its logits row); the masked greedy rows watched for
        agreement and, on the device, whether each one's masked pick is its
        unmasked argmax; the rows without a constraint; the other constrained rows
        (sampled under their masks). None when a constraint failed to fill its mask.
        ``first``: the rows' first tokens, as :meth:`sort` sorted them for that."""
        unmasked = self.unmasked_greedy
        kept = self._sorted_rows
        if first is not None:
            plain, drawn, unchecked, watch, free, masked, masked_only = first
        elif kept is not None and rows is None and kept[1] == self.epochs.sampling and \
                kept[2] == unmasked and kept[0] == live:  # (identity compares, in C)
            # the rows as the last step sorted them: nothing changed their way since
            plain, drawn, unchecked, watch, free, masked, masked_only = kept[3]
            unchecked = dict(unchecked)  # (the caller's to change)
        else:
            plain, drawn, unchecked, watch, free, masked, masked_only = \
                self.sort(live, rows)
            if rows is None:
                self._sorted_rows = (list(live), self.epochs.sampling, unmasked,
                                     (plain, drawn, dict(unchecked), watch, free, masked,
                                      masked_only))
        dev = logits.device
        seqs = live if not plain else [live[j] for j in drawn]
        # (every drawn row watched: a batch's masked opening)
        watched = list(drawn) if len(watch) == len(drawn) else [drawn[k] for k in watch]
        masks = None
        if masked_only:
            masks = self.masks_for(seqs)
            if masks.errors:
                return None
        # every index list the sampling needs goes to the device in one upload
        lists: list[list[int]] = []
        gather = (plain or watch) and rows is not None
        if gather:
            lists.append(rows)
        if drawn:
            logit_rows = drawn if rows is None else [rows[j] for j in drawn]
            if masked_only:
                lists += [drawn, logit_rows, watch if len(watch) < len(drawn) else [],
                          masks.shared or []]
            else:
                lists += [logit_rows, watch, watched, drawn]
        index = iter(())
        pinned = False
        if any(lists):
            values = list(itertools.chain.from_iterable(lists))
            flat = None
            if masked_only and not gather and len(drawn) <= self.tuning.pinned_rows and \
                    (not watch or len(watch) == len(drawn)) and dev.type == "cuda":
                # a few masked rows (the usual step after a refusal): the kernel reads
                # the lists and the masks in pinned host memory, no copy launched
                flat = self.sampler.pinned_ints(masks, values)
                pinned = flat is not None
            if flat is None:
                flat = to_device(values, torch.long, dev)
            index = iter(flat.split([len(part) for part in lists]))  # (one call: views)
        greedy = None
        if plain or watch:  # (before the sampler masks the logits in place)
            greedy = self.runner.greedy_samples(len(logits))
            if greedy is None:
                greedy = self.sampler.greedy_unmasked(logits)
        if gather:
            greedy = greedy[:, next(index)]  # (a copy: the graph's output stays as it is)
        if not drawn:
            return greedy, unchecked, [], None, free, masked
        if masked_only:
            cols, at, subset, mask_rows = next(index), next(index), next(index), next(index)
            source = None
            if greedy is None:
                out = torch.empty(2, len(live), dtype=torch.long, device=dev)
            elif gather:
                out = greedy
            elif self.tuning.picks_whole_row:  # (the kernel copies the unmasked picks: no clone launched)
                out, source = torch.empty(greedy.shape, dtype=greedy.dtype, device=dev), greedy
            else:
                out = greedy.clone()
            agree = self.sampler.greedy_masked_(out, logits, at, cols, masks, mask_rows,
                                                pinned=pinned, source=source)
            if len(watch) < len(drawn):
                agree = agree[subset] if watch else None
            return out, unchecked, watched, agree, free, masked
        at, w, w_cols, cols = next(index), next(index), next(index), next(index)
        if any(s.constraint is not None for s in seqs):
            masks = self.masks_for(seqs)
            if masks.errors:
                return None
        if plain or rows is not None:  # (the sampler masks its rows in place)
            logits = logits[at]
        sampled, dead, _ = self.sampler.sample_on_device(logits, seqs, masks)
        both = torch.stack((sampled, dead.long()))
        agree = sampled[w] == greedy[0, w_cols] if watch else None
        if not plain:
            return both, unchecked, watched, agree, free, masked
        if not gather:
            greedy = greedy.clone()  # (the graph's own output otherwise)
        greedy[:, cols] = both
        return greedy, unchecked, watched, agree, free, masked

    def sort(self, live: list[Sequence], rows: list[int] | None, *,
                   first: bool = False) -> tuple:
        """:meth:`sample`'s rows by how each is sampled: the greedy rows
        given the unmasked argmax, the rows drawn by the sampler, those of
        them given an unmasked pick (-> logits row), the drawn ones watched for
        agreement (index into drawn), the rows without a constraint, the
        constrained ones sampled under their masks, and whether the drawn rows
        are all masked greedy rows (one kernel then picks them all). ``first``:
        the rows' first tokens, which every constrained row picks under its mask,
        watched, as an ordinary step's sampling picks them."""
        unmasked = self.unmasked_greedy
        if unmasked and not first and self.tuning.uniform_rows and \
                self.all_greedy_constrained(live):
            # (the usual constrained batch, sorted again when rows are masked or
            # unmasked: a row goes by its mask alone, found in C-level loops)
            masked = list(itertools.compress(itertools.count(), map(IS_MASKED, live)))
            plain = without(range(len(live)), masked)
            unchecked = dict(zip(plain, plain if rows is None else map(rows.__getitem__, plain)))
            return plain, masked, unchecked, list(range(len(masked))), [], list(masked), \
                bool(masked)
        plain, drawn, unchecked, watch, free, masked = [], [], {}, [], [], []
        masked_only = True
        # (the rule of _picks_unmasked, unrolled: this runs for every row)
        for j, s in enumerate(live):
            greedy = s.params.greedy and not s.banned_tokens
            if s.constraint is None:
                free.append(j)
                if greedy:
                    plain.append(j)
                    continue
            elif greedy and unmasked:
                if not s.masked and not first:
                    plain.append(j)
                    unchecked[j] = j if rows is None else rows[j]
                    continue
                watch.append(len(drawn))  # (masked since a refused pick: watched for agreement)
            if s.constraint is not None:
                masked.append(j)
            else:
                masked_only = False
            masked_only = masked_only and greedy
            drawn.append(j)
        return plain, drawn, unchecked, watch, free, masked, masked_only and bool(drawn)

    def all_greedy_constrained(self, live: list[Sequence]) -> bool:
        """Whether every one of ``live`` is a greedy request under a constraint,
        with no banned tokens: found once for as long as the rows and the
        sequences' bans stay the same (a row's constraint and parameters are
        its own for good)."""
        kept = self._uniform_rows
        bans = self.epochs.bans
        if kept is None or kept[1] != bans or kept[0] != live:  # (identities, in C)
            every = all(s.constraint is not None and not s.banned_tokens and s.params.greedy
                        for s in live)
            kept = self._uniform_rows = (list(live), bans, every)
        return kept[2]

    def picks_unmasked(self, s: Sequence) -> bool:
        """Whether a pipelined step gives ``s`` the unmasked argmax (checked later
        by its constraint, if any) rather than the sampler's draw."""
        return s.params.greedy and not s.banned_tokens and (
            s.constraint is None or self.unmasked_greedy and not s.masked)

    def masks_for(self, seqs: list[Sequence]) -> FilledMasks:
        """``seqs``' masks: those filled ahead while the last tokens were taken when
        they are for exactly these rows, else filled now."""
        ahead, self.masks_ahead = self.masks_ahead, None
        premasker = self.premasker
        landed, premasker.wait = premasker.wait, None
        if landed is not None:  # (premasked rows: their masks follow the tokens being taken)
            try:
                landed.result()
            except Exception:  # (the take reports it)
                pass
        if ahead is not None:
            if len(ahead[0]) == len(seqs) and all(a is b for a, b in zip(ahead[0], seqs)):
                try:
                    return ahead[1].result()
                except Exception:  # filled again, which reports the error
                    pass
            else:
                wait([ahead[1]])  # (the mask thread is done with the constraints)
        return self.sampler.fill_masks(seqs)

    def resample(self, prev: InFlight, refused: list[int], into: torch.Tensor | None = None
                  ) -> tuple[list[Sequence], torch.Tensor | None, list[int]]:
        """Sample again, under their masks, the rows of ``prev`` (indices) whose
        unmasked greedy pick the constraint refused, from the logits they were
        picked from. Returns those rows and their ``[2, r]`` tokens and dead-end
        flags on the device, and the rows (indices) settled here instead (backed
        out or ended) since their constraint failed to fill its mask. ``into``:
        ``[2, len(prev.seqs)]`` tokens and flags whose columns ``refused`` take
        the picks in place, when every row is picked under its mask (then no
        tokens are returned)."""
        seqs = [prev.seqs[i] for i in refused]
        dev = prev.logits.device
        r = len(seqs)
        logit_rows = [prev.unchecked[i] for i in refused]
        masks = self.sampler.fill_masks(seqs)
        if not masks.errors and not any(s.banned_tokens for s in seqs):
            # logits rows, the columns written and the rows' mask rows: one upload
            shared = masks.shared or []
            out = into if into is not None else torch.empty(2, r, dtype=torch.long, device=dev)
            index = to_device(logit_rows + (refused if into is not None else list(range(r)))
                              + shared, torch.long, dev)
            rows, cols, mask_rows = index.split([r, r, len(shared)])
            with torch.inference_mode():  # (``into`` may be a graph's output)
                self.sampler.greedy_masked_(out, prev.logits, rows, cols, masks, mask_rows)
            return seqs, None if into is not None else out, []
        rows = to_device(logit_rows, torch.long, dev)
        tokens, dead, errors = self.sampler.sample_on_device(prev.logits[rows], seqs, masks)
        settled = [refused[j] for j in sorted(errors)]
        if errors:
            for j in sorted(errors):
                self.output.settle(seqs[j], -1, None, errors[j])
            ok = [j for j in range(len(seqs)) if j not in errors]
            if not ok:
                return [], None, settled
            idx = to_device(ok, torch.long, tokens.device)
            seqs, tokens, dead = [seqs[j] for j in ok], tokens[idx], dead[idx]
        return seqs, torch.stack((tokens, dead.long())), settled

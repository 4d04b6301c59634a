"""The engine: requests in, tokens out, over a continuously batched paged KV cache.

``Engine.step()`` is one iteration: schedule, run the model once over every
scheduled token, sample one token for each sequence whose chunk reached its end,
apply stop conditions, and return what changed.
"""

from __future__ import annotations

import atexit
import functools
import gc
import itertools
import operator
from dataclasses import dataclass, field
from concurrent.futures import Future, ThreadPoolExecutor, wait
import secrets
import sys
import threading
import time
from collections.abc import Sequence as SequenceABC

import torch

from formcast.engine.block_manager import BlockManager
from formcast.engine.config import DeepseekV4Config, EngineConfig, LlamaConfig
from formcast.engine.constraint import LogitsConstraint, take_forced_tokens
from formcast.engine.cuda_graph import graph_ladder
from formcast.engine.kernels import current_stream, event_poll, to_device, wait_event
from formcast.engine.layers.quant import QUANTIZATIONS, quantize_linears
from formcast.engine.loader.gguf import Int4Blocks, read_int4_blocks
from formcast.engine.model_runner import ModelRunner, kv_bytes_per_block
from formcast.engine.models.deepseek_v4 import DeepseekV4ForCausalLM
from formcast.engine.models.deepseek_v4_runner import (DeepseekV4Runner, state_bytes_per_sequence,
                                                        state_bytes_per_token)
from formcast.engine.models.llama import LlamaForCausalLM
from formcast.engine.sampler import FilledMasks, Sampler
from formcast.engine.sampling_params import SamplingParams
from formcast.engine.scheduler import ScheduledSeq, Scheduler
from formcast.engine.sequence import (Request, RequestOutput, Sequence, SequenceStatus,
                                      TokenLogprob)
from formcast.engine.speculative import JumpForwardProposer, PromptLookupProposer, propose
from formcast.engine.speculative.mtp import MTPProposer
from formcast.engine.speculative.proposers import DraftMemory, fill_draft_masks
from formcast.engine.speculative.schedule import StepCostModel, choose_lengths
from formcast.engine.tokenizer import IncrementalDetokenizer, Tokenizer, cached_gguf_tokenizer
from formcast.engine.errors import EngineError, RequestError

FINISHED = SequenceStatus.FINISHED


def resolve_device(device: str | torch.device) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"unknown device {device!r}: use 'auto', 'cpu' or 'cuda[:N]'") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but CUDA is not available here")
    return dev


@functools.cache
def _unfreeze_at_exit() -> None:
    """Hand frozen objects back to the collector when the interpreter exits: its
    last collection skips the permanent generation, and extension modules that
    count their objects at shutdown (Triton's, through nanobind) would report
    every one of them as leaked."""
    atexit.register(gc.unfreeze)


class Engine:
    """A continuously batching inference engine for one model.

    Build it with :meth:`from_pretrained`. Submit work with :meth:`add_request` and
    drive it with :meth:`step`, or use :meth:`generate` for a whole batch.
    """

    def __init__(self, model: LlamaForCausalLM | DeepseekV4ForCausalLM, tokenizer: Tokenizer, *,
                 config: EngineConfig | None = None, device: torch.device | None = None,
                 name: str = "model") -> None:
        self.config = config or EngineConfig()
        self._tuning = tuning = self.config.tuning
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.quantization: str | None = None  # "int4"/"int8" when the linears are packed
        param = model.model.embed_tokens.weight
        self.device = device or param.device
        self.dtype = param.dtype
        mcfg = model.config
        bs = self.config.block_size
        spec = self.config.spec
        self._mtp: MTPProposer | None = None
        if isinstance(model, DeepseekV4ForCausalLM):
            max_rollback = max(16, spec.max_draft + 1)  # a whole rejected draft truncates
            num_blocks = self.config.num_kv_blocks or _state_blocks(self.config, mcfg, self.dtype,
                                                                    max_rollback)
            # "auto" drafts on float32 engines only (see _propose_drafts)
            uses_mtp = len(model.mtp) > 0 and spec.enabled and (
                spec.method == "mtp" or (spec.method == "auto" and self.dtype == torch.float32))
            # per-request states, not paged KV: blocks only admit requests, nothing is shared
            self.prefix_caching = False
            self.runner: ModelRunner | DeepseekV4Runner = DeepseekV4Runner(
                model, max_rollback=max_rollback, keep_hidden=uses_mtp)
            if uses_mtp:
                self._mtp = MTPProposer(self.runner, valid_vocab_size=tokenizer.vocab_size)
        else:
            num_blocks = self.config.num_kv_blocks or max(
                1, self.config.kv_cache_memory // kv_bytes_per_block(mcfg, bs, self.dtype))
            self.prefix_caching = self.config.enable_prefix_caching
            graph_sizes = graph_ladder(self.config.max_num_seqs) \
                if self.config.cuda_graphs and self.device.type == "cuda" else ()
            self.runner = ModelRunner(model, num_blocks=num_blocks, block_size=bs,
                                      device=self.device, dtype=self.dtype,
                                      cuda_graph_sizes=graph_sizes,
                                      max_model_len=self._max_len(num_blocks),
                                      sample_vocab=min(tokenizer.vocab_size, mcfg.vocab_size),
                                      max_prefill_tokens=self.config.max_num_batched_tokens,
                                      max_prefill_chunks=self.config.max_num_seqs, tuning=tuning)
        if spec.enabled and spec.method == "mtp" and self._mtp is None:
            raise ValueError("spec method 'mtp' needs a model with an MTP layer (a DeepSeek-V4 "
                             "checkpoint with mtp.0.* weights); use 'prompt_lookup' or 'auto'")
        # a sequence must always fit alone in the cache, so cap the context there
        self.max_model_len = self._max_len(num_blocks)
        self.block_manager = BlockManager(num_blocks, bs, enable_prefix_caching=self.prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=self.config.max_num_seqs,
                                   max_num_batched_tokens=self.config.max_num_batched_tokens)
        self.sampler = Sampler(mcfg.vocab_size, tokenizer.vocab_size,
                               batch_fill=self.device.type == "cuda", tuning=tuning)
        self.step_cost = StepCostModel()  # seconds per step by tokens, learned online
        self._draft_memory: DraftMemory | None = None  # the model's habits, for drafting
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids)
        self._seqs: dict[str, Sequence] = {}
        self._aborted: list[Sequence] = []  # outputs owed to the next step (aborts, drains)
        self._num_finishes = 0  # calls of _finish: a step in flight whose count moved lost rows
        self._inflight: _InFlight | None = None  # a launched step the host has not taken
        self._ahead: _Ahead | None = None  # the step after it, launched already (_fast_lane)
        self._host_slots: _HostSlots | None = None  # where in-flight steps land (CUDA)
        asynchronous = self.config.async_scheduling
        if asynchronous is None:
            asynchronous = self.device.type == "cuda"
        self._async = asynchronous and isinstance(self.runner, ModelRunner)
        self.num_pipelined_steps = 0  # steps launched before the host had their input
        self.num_launched_ahead = 0  # of those, launched before the last tokens were appended
        # greedy picks made without masks for constrained rows, and those refused
        # (EngineConfig.unmasked_greedy)
        self.num_unmasked_picks = 0
        self.num_refused_picks = 0
        self.num_native_accepts = 0  # steps' accepts launched on the native worker
        self._ids = itertools.count()
        self._mask_pool: ThreadPoolExecutor | None = None  # fills masks during the forward
        # (rows, their masks: a future) filled while a pipelined step's picks were
        # checked, for its sampling
        self._masks_ahead: tuple[list[Sequence], Future] | None = None
        self._accept_pool: ThreadPoolExecutor | None = None  # checks picks during sampling
        self._acceptor = _Acceptor()  # (the accept thread's own)
        self._masked_acceptor = _Acceptor()  # (rows sampled under their masks)
        self._switch_interval: float | None = None  # the process's, while ours is set
        self._room: _Room | None = None  # (see _room_of)
        # (rows, Sequence.sampling_epoch, unmasked_greedy, _sort_rows' answer) of
        # the last _sample_live over a whole step's rows
        self._sorted_rows: tuple | None = None
        # (rows, Sequence.ban_epoch, whether every one is a greedy constrained
        # row without bans) of the last _sort_rows (see there)
        self._uniform_rows: tuple | None = None
        # (rows, their constraint classes' tidy hooks) of the last step that waited
        self._tidy_hooks: tuple[list[Sequence], list] | None = None
        self._detok_at = 0  # (the row _detokenize_while goes on from)
        # premasking (see _premask_landed): the tokens that may end a JSON string,
        # how often the model's next unmasked pick after one broke the grammar
        # (a moving average), the rows premasked whose first masked pick's
        # agreement is due, the rows that took such a token unmasked whose next
        # pick's verdict is due, and the accept a premasked row's mask waits for
        self._risky: frozenset[int] | None = None
        self._quotes: list[int] | None = None  # each token's unescaped double quotes
        self._premask_rate = 0.0
        self._premasked: dict[Sequence, None] = {}
        # the constraints of ended requests, kept (on CUDA) until the host waits for
        # the device: see _finish and _bury_while
        self._graves: list[LogitsConstraint] = []
        self._keep_graves = self.device.type == "cuda"
        self._graves_kept = tuning.graves_kept
        self._risky_after: list[Sequence] = []
        self._premask_wait = None
        self.num_premasked_picks = 0  # picks made under a mask by premasking
        if self.config.num_threads is not None and self.device.type == "cpu":
            torch.set_num_threads(self.config.num_threads)
        freeze = self.config.freeze_gc
        if freeze if freeze is not None else self.device.type == "cuda":
            gc.collect()
            gc.freeze()
            _unfreeze_at_exit()

    def _max_len(self, num_blocks: int) -> int:
        mpe = self.model.config.max_position_embeddings
        return min(self.config.max_model_len or mpe, mpe, num_blocks * self.config.block_size)

    # -- construction -------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, name_or_path: str, *, device: str | torch.device = "auto",
                        dtype: torch.dtype | None = None, quantization: str | None = "auto",
                        parallel=None, **config) -> "Engine":
        """Load a model by registry name or path and build an engine for it.

        Parameters
        ----------
        name_or_path : str
            ``"smollm2"`` (fetched on first use), a ``.gguf`` file, or an HF-layout folder:
            Llama, or DeepSeek-V4 (``model_type`` "deepseek_v4"; transformers' or the
            original release's tensor names; FP8/FP4 weights dequantized at load; its
            MTP layer, when the folder has ``mtp.0.*`` weights, drafts under spec
            "auto" or "mtp"; prefix caching is always off for it).
        device : str or torch.device
            "auto" (CUDA when available), "cpu" or "cuda[:N]".
        dtype : torch.dtype | None
            Weights and KV dtype; default float32 on CPU, bfloat16 on CUDA.
        quantization : {"auto", "int4", "int8"} | None
            CPU only: keep linear weights in 4 bits (groups of 32) or 8 bits (per
            channel) and run them with bfloat16 activations; the output head is held
            in bfloat16. Several times faster decode; logits move slightly. "int4" on
            a GGUF whose linears are stored Q4_0/Q4_1 takes the file's own blocks
            (codes exact; scales in bfloat16); other weights are quantized from float
            (min/max per group). "auto" (the default): "int4" for such a GGUF on the
            CPU, None otherwise. None: float weights in ``dtype``.
        **config
            Fields of :class:`EngineConfig` (block_size, num_kv_blocks, max_num_seqs, ...).
        parallel : formcast.engine.ParallelConfig | None
            More than one rank (``dp > 1``): start one process per rank on this
            machine and return a :class:`formcast.engine.parallel.ParallelEngine`
            (same calls), attention data parallel, MoE experts split when ``ep > 1``.

        Raises
        ------
        ModelNotFoundError, ModelFetchError, CorruptModelError, UnsupportedModelError
            The model could not be resolved or loaded.
        TypeError
            An unknown engine option was passed.
        """
        from formcast.engine.hub import resolve_model
        from formcast.engine.loader import load_checkpoint

        if parallel is not None and parallel.dp > 1:
            from formcast.engine.parallel import ParallelEngine

            return ParallelEngine.launch(name_or_path, parallel, device=str(device), dtype=dtype,
                                         quantization=quantization, **config)
        try:
            engine_config = EngineConfig(**config)
        except TypeError as exc:
            raise TypeError(f"unknown engine option: {exc}") from exc
        dev = resolve_device(device)
        dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
        source = resolve_model(name_or_path)
        tokenizer = (cached_gguf_tokenizer(source.path) if source.kind == "gguf"
                     else Tokenizer.from_hf_dir(source.path))
        ckpt = load_checkpoint(source)
        if quantization not in (None, "auto") + QUANTIZATIONS:
            raise ValueError(f"unknown quantization {quantization!r}; choose 'auto', "
                             f"{', '.join(map(repr, QUANTIZATIONS))} or None")
        blocks = {}
        if source.kind == "gguf" and dev.type == "cpu" and quantization in ("auto", "int4"):
            blocks = fuse_int4_blocks(read_int4_blocks(source.path))
        if quantization == "auto":
            quantization = "int4" if blocks else None
        model = build_model(ckpt.config, ckpt.weights, device=dev, dtype=dtype,
                            quantization=quantization, int4_blocks=blocks)
        engine = cls(model, tokenizer, config=engine_config, device=dev, name=source.name)
        engine.quantization = quantization
        return engine

    # -- requests -----------------------------------------------------------------
    def add_request(self, prompt: Request | SequenceABC[int], params: SamplingParams | None = None,
                    *, constraint: LogitsConstraint | None = None,
                    request_id: str | None = None) -> str:
        """Validate and queue one request; returns its id.

        Raises
        ------
        RequestError
            Empty prompt, prompt too long for the context, token ids out of range,
            duplicate request id, or a constraint that is not a LogitsConstraint.
        """
        seq = self._make_sequence(prompt, params, constraint, request_id)
        self._queue(seq)
        return seq.request_id

    def _make_sequence(self, prompt: Request | SequenceABC[int], params: SamplingParams | None,
                       constraint: LogitsConstraint | None, request_id: str | None) -> Sequence:
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
        vocab = self.model.config.vocab_size
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
            request_id = f"req-{next(self._ids)}"
        elif request_id in self._seqs:
            raise RequestError(f"request id {request_id!r} is already in flight")
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        return Sequence(request_id, ids, params, constraint, (self.device, seed),
                        self.max_model_len)

    def _queue(self, seq: Sequence) -> None:
        self._seqs[seq.request_id] = seq
        seq.detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=True)
        self.scheduler.add(seq)
        if seq.constraint is not None:
            jump = self.config.jump_forward
            if jump or jump is None and self.device.type == "cuda":
                self._jump_forward(seq)

    def _jump_forward(self, seq: Sequence) -> None:
        """Append the tokens ``seq``'s constraint fixes at its start to its prompt's
        prefill (:attr:`EngineConfig.jump_forward`); a constraint that fails here
        ends the request with its error."""
        params = seq.params
        limit = seq.max_total_len - len(seq.token_ids) - 1  # (one left to sample)
        if limit <= 0 or params.stop or seq.logprobs is not None or \
                len(seq.token_ids) > seq.num_prompt_tokens:
            return
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
                return
        except Exception as exc:
            seq.error = f"constraint failed: {type(exc).__name__}: {exc}"
            self._finish(seq, "abort")
            self._aborted.append(seq)  # (its output comes with the next step)
            return
        for token in tokens:
            seq.token_ids.append(token)
            seq.defer_text(token)
        seq.num_forced_tokens += len(tokens)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request; its output (finish_reason "abort") comes with the next step.
        Returns False if no such request is in flight."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.is_finished:
            return False
        self._finish(seq, "abort")
        self._aborted.append(seq)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    # -- the loop -----------------------------------------------------------------
    def step(self, *, finished_only: bool = False) -> list[RequestOutput]:
        """Run one scheduling + model + sampling iteration.

        Returns the outputs of requests that got a token or finished in this step;
        with ``finished_only``, of those that finished (a caller that waits for
        whole results saves building an output for every running request at
        every step: microseconds a request, as long as a large batch's step).
        """
        finishes, aborted = self._num_finishes, bool(self._aborted)
        seqs = self._step()
        if finished_only:
            if finishes == self._num_finishes and not aborted:
                return []  # (nothing ended: no row to look at)
            return [seq.to_output() for seq in seqs if seq.status is FINISHED]
        return [seq.to_output() for seq in seqs]

    def _step(self) -> list[Sequence]:
        """:meth:`step`, returning the sequences (their outputs are built on demand:
        a copy of every token of every running request each step adds up)."""
        outputs = self._step_once()
        if not self.scheduler.has_unfinished():
            self._let_go()
        return outputs

    def _step_once(self) -> list[Sequence]:
        """:meth:`_step` but for letting go of a finished batch."""
        outputs = list(self._aborted)
        self._aborted.clear()
        if self._async:
            if self._can_pipeline():
                taken = self._pipelined_step()
                if self._inflight is None or self._inflight.early is None:
                    self._quick_switches(False)  # (no picks left with the accept thread)
                self._commit_quota()
                if taken is not None:
                    return outputs + taken
            outputs += self._drain()
        self._propose_drafts()
        plan = self.scheduler.schedule()
        for seq in plan.preempted:
            self.runner.release(seq)  # recomputed from scratch when readmitted
        if not plan.scheduled:
            return outputs
        sampled = [item for item in plan.scheduled if item.samples]
        # logits rows: one per sampled item, plus one per draft token after it
        starts, plain_rows, plain = [], [], []
        row = 0
        for item in sampled:
            starts.append(row)
            if not item.num_draft:
                plain_rows.append(row)
                plain.append(item.seq)
            row += 1 + item.num_draft
        # a batch's first step, every running request sampling: its tokens go in
        # flight like a pipelined step's (the next step launches on them first)
        in_flight = self._async and self._first_in_flight(plan, plain)
        # the masks of plain rows depend only on tokens already accepted: fill them
        # while the model runs
        masks = None
        if in_flight:
            first = self._sort_rows(plain, None, first=True)
            drawn = [plain[j] for j in first[1]]
            if self.config.overlap_masks and any(s.constraint is not None for s in drawn):
                masks = self._fill_masks_async(drawn)
                self._masks_ahead = drawn, masks  # (for _sample_live's _masks_for)
        elif self.config.overlap_masks and any(s.constraint is not None for s in plain):
            masks = self._fill_masks_async(plain)
        started = time.perf_counter()
        try:
            logits = self.runner.execute(plan.scheduled)
        except Exception as exc:
            if masks is not None:
                self._masks_ahead = None
                masks.result()  # the worker is done with the constraints before we go
            raise EngineError(f"model forward failed: {type(exc).__name__}: {exc}") from exc
        self.scheduler.on_step_done(plan)
        self._prepare_constraints(plan.scheduled)
        if in_flight:
            picked = self._sample_live(logits, plain, None, first=first)
            if picked is not None:
                both, unchecked, watched, agree, free, masked = picked
                self._launch_inflight(plain, both, logits, unchecked, watched, agree, free,
                                      masked, self._num_finishes)
                # (no step cost observed: the host has not waited for the device)
                return outputs
            # (a constraint failed to fill its mask: the ordinary way)
            masks = self._masks_ahead = None
        if plain:
            rows = logits if len(plain_rows) == len(logits) else logits[plain_rows]
            # greedy constrained rows about to enter the pipeline: whether their masked
            # pick is the model's own argmax says whether they start there unmasked
            watch = [j for j, s in enumerate(plain) if s.constraint is not None
                     and s.params.greedy and not s.banned_tokens] \
                if self._async and self.config.unmasked_greedy else []
            argmax = None
            if watch:  # (before the sampler masks the rows in place)
                argmax = self.sampler.greedy_unmasked(
                    rows if len(watch) == len(plain)
                    else rows[to_device(watch, torch.long, rows.device)])[0]
            result = self._sample_and_append(rows, plain,
                                             None if masks is None else masks.result())
            if watch:
                for j, unmasked in zip(watch, argmax.tolist()):
                    if j not in result.errors:
                        plain[j].masked_pick_seen(result.token_ids[j] == unmasked)
        for item, start in zip(sampled, starts):
            if item.num_draft:
                self._verify(item.seq, logits[start:start + 1 + item.num_draft])
            outputs.append(item.seq)
        self.step_cost.observe(plan.num_tokens, time.perf_counter() - started)
        return outputs

    # -- asynchronous scheduling ----------------------------------------------------
    # In steady decoding (every running request decoding one token, nothing waiting,
    # nothing drafted) a step launches the next forward on the device with the
    # previous step's sampled tokens as input, still on the device, and only then
    # takes those tokens on the host: accepting them in the grammars, detokenizing,
    # checking stops, filling the next masks, all while the device runs. A request
    # that turns out finished has its extra row dropped. Anything else (a new
    # request, a draft, a dead end to roll back, logprobs) drains the pipeline and
    # runs an ordinary step. Outputs are those of ordinary steps, one step later.

    def _let_go(self) -> None:
        """No request is left: the caches of the rows that ran (finding them
        unchanged from step to step) let go of them, and with them of the
        finished requests, their constraints and token lists. Before, they held
        them until the next batch's first steps replaced them, where their
        destructors ran on the host's path (and the matchers' on the native
        worker, as the batch's first accepts wanted it). At 256 JSON rows of
        8 tokens, ``benchmarks/host_overhead.py``'s stubbed engine on our CPU
        (medians of 15 in one process): the next batch's first pipelined step
        2790 us of host time rather than 3517, the last step 2634 rather than
        2489, the steps after the prefill 10.20 ms rather than 10.75."""
        self._room = self._sorted_rows = self._uniform_rows = self._tidy_hooks = None
        self._forget_premasking()
        self._acceptor.reset()
        self._masked_acceptor.reset()
        self.block_manager.forget_rows()
        forget = getattr(self.runner, "forget_rows", None)
        if forget is not None:
            forget()

    def _can_pipeline(self) -> bool:
        sched, prev = self.scheduler, self._inflight
        running = sched.running
        if sched.waiting or not running or len(running) > self.config.max_num_batched_tokens:
            return False
        if self._drafts(running):
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
            return self._num_finishes != prev.finishes and \
                [s for s in prev.seqs if s.status is not FINISHED] == running
        return all(s.num_uncomputed_tokens == 1 and s.params.logprobs is None for s in running)

    def _first_in_flight(self, plan, plain: list[Sequence]) -> bool:
        """Whether ``plan``'s sampled tokens go in flight (:meth:`_launch_inflight`)
        rather than to the host in its step: every running request samples in
        it (``plain``: no drafts), in the running order, none wants logprobs,
        nothing waits, and the steps after it can pipeline. A large batch's
        first step then costs the device no wait for the host's sampling and
        its constraints' first accepts; a small one keeps its first token one
        step sooner."""
        sched = self.scheduler
        if len(plain) < self._tuning.first_in_flight_rows or len(plain) != len(plan.scheduled) \
                or sched.waiting or len(plain) > self.config.max_num_batched_tokens:
            return False
        if [item.seq for item in plan.scheduled] != list(sched.running) or self._drafts(plain):
            return False
        return all(s.params.logprobs is None for s in plain)

    def _drafts(self, running: list[Sequence]) -> bool:
        """Whether a step of ``running`` would draft for any of them (see
        :meth:`_draft_mode`)."""
        mode = self._draft_mode(len(running))
        return mode == "all" or mode == "forced" and any(s.constraint is not None
                                                         for s in running)

    def _pipelined_step(self) -> list[Sequence] | None:
        """Launch a decode step for every running request, take the last step's
        tokens while it runs, sample it on the device. None (nothing changed) when
        the KV cache has no room for it."""
        prev, bm = self._inflight, self.block_manager
        running = list(self.scheduler.running)
        if prev is None or self._room_of(running).tokens > 1:
            launch = running
        else:  # a request whose token in flight is its last gets no row
            launch = [s for s in running if len(s.token_ids) + 1 < s.max_total_len]
        ahead = self._ahead
        if ahead is not None and ahead.seqs == launch:
            self._ahead = None
            logits = ahead.logits  # (launched by the last step, its blocks grown then)
        else:
            self._drop_ahead()
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
        self.num_pipelined_steps += 1
        self._inflight = None
        self._masks_ahead = None
        finishes = self._num_finishes
        taking = early = None
        if prev is not None:
            taking = self._take_begin(prev, defer=True)
            if taking.pending is not None and len(launch) == len(prev.seqs) and \
                    finishes == prev.finishes == self._num_finishes:
                # the accept thread is checking the unmasked picks, every row launched
                # again and none ended: sample every row while it works; those whose
                # pick turns out refused are sampled again over their draws
                try:
                    self._premask_landed(taking)
                    early = self._sample_live(logits, launch, None)
                    taking.sampled = True
                except BaseException:
                    self._take_end(taking)  # (the checked picks are appended before we go)
                    raise
        if early is not None:
            try:
                lane = self._fast_lane(taking, launch, logits, early)
            except BaseException:
                self._take_end(taking)
                raise
            if lane is not None:
                filled, settled = lane
                self._let_accept_in()
                taken = self._take_end(taking)[0]  # (refused rows: sampled again already)
                bm.defer_commits(filled)  # (hashed once their last token is there)
                return taken + settled
        checked_from = self._num_finishes
        taken, ok, refused = self._take_end(taking) if taking is not None else ([], None, [])
        if early is not None:
            return taken + self._launch_sampled(prev, launch, logits, early, ok, refused,
                                                 checked_from)
        # (the rows in flight all launched again and none ended: rows stay in place)
        same = ok is None or finishes == self._num_finishes and len(launch) == len(prev.seqs)
        if same and (ok is None or len(ok) + len(refused) == len(launch)):
            # every row took its token or had its pick refused (the usual step): the
            # rest stay
            rows, live = range(len(launch)), launch
            if refused:
                drop = sorted(refused)
                rows, live = _without(rows, drop), _without(launch, drop)
        else:
            same = False
            # a request that finished, backed out of a dead end or had its pick
            # refused drops its row
            rows = [i for i, s in enumerate(launch) if s.status is not FINISHED and s in ok]
            live = [launch[i] for i in rows]
        self._advance(live)
        # rows whose unmasked pick was refused: sampled again under their masks
        fixed, fixed_both, settled = self._resample(prev, refused) if refused else ([], None, [])
        if settled:  # (ended, or backed out of a dead end)
            taken = taken + [prev.seqs[i] for i in settled]
        if not live and not fixed:
            return taken
        picked = None
        if live:
            # (rows are read where they lie: no copy of the step's logits)
            picked = self._sample_live(logits, live, None if len(rows) == len(launch) else rows)
            if picked is None:  # a broken constraint: the ordinary way, here and now
                masks = self.sampler.fill_masks(live)
                if len(rows) < len(launch):
                    logits = logits[to_device(rows, torch.long, logits.device)]
                self._sample_and_append(logits, live, masks)
                if fixed:
                    self._settle_on_host(fixed, fixed_both)
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
        self._launch_inflight(seqs, both, logits, unchecked, watched, agree, free, masked,
                              self._num_finishes)
        return taken

    def _fast_lane(self, taking: "_Taking", launch: list[Sequence], logits: torch.Tensor,
                   picked: tuple) -> tuple[list[Sequence], list[Sequence]] | None:
        """The usual step of a large constrained batch, its critical path cut short.

        Every row of ``taking`` was sampled again (``picked``, as :meth:`_sample_live`
        gave it for ``launch``, the same rows) while the accept thread checked the
        unmasked picks. Once every pick turns out taken or refused (none ending
        its constraint or failing), and no request ended or will end by the token
        it takes, the rows whose pick was refused are sampled again, this step's
        tokens are launched on their way to the host and the step after is
        launched on the device (:meth:`_launch_ahead`), all before the taken
        tokens are appended, which the device no longer waits for. Returns the
        rows whose count of computed tokens filled a block (to hash once the
        tokens are appended) and the requests a failed resample settled; None
        (nothing done) when the step must go the ordinary way."""
        prev = taking.prev
        seqs, tokens, checked = prev.seqs, taking.token_list, taking.checked
        if not taking.clean or len(taking.pending_rows) != len(checked) \
                or prev.finishes != self._num_finishes:
            return None
        # no row's token ends its request, and every row runs the step after: the
        # rows with a pick to append still count one token short of that
        eos = self.eos_token_ids
        every = len(checked) == len(seqs)
        ending = set()  # (rows whose token would end them: the lane goes on only if refused)
        if not taking.quiet:  # (quiet, the usual step: no row's token ends it)
            room = self._room_of(seqs)
            if room.quiet and room.tokens > 2:  # (only an end token ends a row)
                ending = {i for i in (range(len(seqs)) if every else checked)
                          if tokens[i] in eos}
            else:
                for i in range(len(seqs)) if every else checked:
                    s = seqs[i]
                    if not (s.ends_on_length_only and tokens[i] not in eos and s.first_token_time
                            and len(s.token_ids) + 2 < s.max_total_len):
                        ending.add(i)
        if not every:
            pending = set(checked)
            if any(len(s.token_ids) + 1 >= s.max_total_len
                   for i, s in enumerate(seqs) if i not in pending):
                return None
        # the step after this one, staged on the host while the accept thread
        # works, for the usual verdicts: every pick taken, every row one token on
        staged = self.block_manager.grow_decode(launch, ahead=1) and \
            self.runner.stage_decode_ahead(launch)
        slot = None
        if staged:
            # its inputs queued too (the picks it takes as they stand, every pick
            # taken): the launch after the verdicts is then the replay alone, which
            # reads nothing of the rows. So this step's picks start on their way to
            # the host now too: when every verdict is 1 nothing changes them, and
            # the replay goes before the rest
            both, _, watched, agree = picked[:4]
            if self.runner.preload_decode(both[0]):
                slot = self._copy_to_host(both, agree, len(watched))
        try:
            verdicts = taking.pending.result()
        except BaseException:
            return None  # (the take reports it)
        refused: list[int] = []
        if verdicts is None:
            return None
        if verdicts.count(1) != len(verdicts):
            if verdicts.count(0) + verdicts.count(1) != len(verdicts):
                return None  # a constraint ended or failed
            refused = [checked[k] for k, v in enumerate(verdicts) if not v]
        if not ending.issubset(refused):
            return None
        if refused and taking.ahead is not None:
            wait([taking.ahead[1]])  # (the mask thread is done before masks are filled here)
        filled: list[Sequence] = []
        first = slot is not None and not refused
        if first:
            # the step after first: what the device waits for (its inputs and this
            # step's copy to the host are queued already)
            self._launch_ahead(launch, picked[0][0], staged=True)
        settled = self._launch_sampled(prev, launch, logits, picked, set(), refused,
                                       self._num_finishes, filled=filled, slot=slot)
        if not first and not settled:
            self._launch_ahead(launch, self._inflight.tokens, staged=staged and not refused)
        return filled, settled

    def _room_of(self, seqs: list[Sequence]) -> "_Room":
        """How many more tokens every one of ``seqs`` has room for, at least, and
        whether each ends on its length only (no stop strings or stop tokens)
        and has its first token: what the pipelined steps check of every row,
        every step, found once per run of steps over the same rows. The room
        found then shrinks by at most a token a pipelined step (each takes one
        token a row); an ordinary step forgets it (:meth:`_drain`)."""
        room, steps = self._room, self.num_pipelined_steps
        # (found again while a row has yet to take its first token: a batch's
        # first step puts them in flight)
        if room is None or room.seqs != seqs or room.unstarted:  # (identity compares, in C)
            unstarted = not all(s.first_token_time for s in seqs)
            quiet = not unstarted and all(s.ends_on_length_only for s in seqs)
            least = min((s.max_total_len - len(s.token_ids) for s in seqs), default=0)
            room = self._room = _Room(seqs=list(seqs), tokens=least, quiet=quiet, steps=steps,
                                      unstarted=unstarted)
        return _Room(seqs=room.seqs, tokens=room.tokens - (steps - room.steps),
                     quiet=room.quiet, steps=steps, unstarted=room.unstarted)

    def _launch_ahead(self, seqs: list[Sequence], tokens: torch.Tensor, *,
                      staged: bool = False) -> None:
        """Launch the decode step after the one in flight for ``seqs``, on its sampled
        ``tokens`` on the device, as the next pipelined step would (it takes it
        when its rows are still these). Skipped when the blocks it opens are not
        free, or when it fails (the next step launches it again, and reports it).
        ``staged``: its blocks were grown and its inputs staged (see
        :meth:`ModelRunner.stage_decode_ahead`) before every row advanced."""
        if not staged and not self.block_manager.grow_decode(seqs):
            return
        mark = self.runner.decode_mark()
        try:
            logits = self.runner.execute_decode(seqs, tokens, staged=staged)
        except Exception:
            self.runner.rewind_decode(mark)
            return
        self._ahead = _Ahead(seqs=seqs, logits=logits, mark=mark)
        self.num_launched_ahead += 1

    def _drop_ahead(self) -> None:
        """Forget the step launched ahead, if any (its rows changed, or an ordinary
        step comes): its output is never read, and the next replay reuses its place."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            self.runner.rewind_decode(ahead.mark)

    def _launch_sampled(self, prev: "_InFlight", launch: list[Sequence], logits: torch.Tensor,
                        picked: tuple, ok: set[Sequence], refused: list[int], finishes: int,
                        filled: list[Sequence] | None = None, slot: tuple | None = None
                        ) -> list[Sequence]:
        """The rest of a pipelined step whose every row (``launch``, the rows of
        ``prev`` in order) was sampled from ``logits`` (``picked``, as
        :meth:`_sample_live` gave it) while the last picks were checked: rows
        whose pick was refused are sampled again from ``prev``'s logits under
        their masks, over their draws; requests that ended (``finishes``: the
        count before the check) stay in flight, rows the next take drops.
        ``filled``: a list that takes the rows whose count filled a block, for
        the caller to hash (their tokens are not appended yet), rather than
        hashing them here. ``slot``: the host slot ``picked``'s tokens and flags
        were copied into (:meth:`_copy_to_host`), copied again when a resample
        changes them. Returns the outputs beyond the take's (requests a failed
        resample settled)."""
        both, unchecked, watched, agree, free, masked = picked
        if finishes == self._num_finishes:  # (every other row took its token)
            live = _without(launch, sorted(refused)) if refused else launch
        else:
            live = [s for s in launch if s in ok and s.status is not FINISHED]
            for i, s in enumerate(launch):  # (in none of the step's row lists: dropped when taken)
                if s.status is FINISHED:
                    unchecked.pop(i, None)
        self._advance(live, filled)
        void: set[int] = set()
        if refused:
            # (not only while rows are premasked: a take before this may have let go
            # of the refused one already)
            masked, watched, agree = self._unpremask(refused, masked, watched, agree)
            _, fixed_both, settled = self._resample(prev, refused, into=both)
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
            slot = self._copy_to_host(both, agree, len(watched), slot)
        self._launch_inflight(launch, both, logits, unchecked, watched, agree, free, masked,
                              finishes, void, slot=slot)
        return [launch[i] for i in sorted(void)]

    @staticmethod
    def _unpremask(refused: list[int], masked: list[int], watched: list[int], agree
                   ) -> tuple[list[int], list[int], torch.Tensor | None]:
        """A sampled step's ``masked`` and ``watched`` rows (``agree``: the
        watched ones' flags, on the device) without the ``refused`` ones: rows
        premasked as their pick landed (see :meth:`_premask_landed`) whose pick
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

    def _advance(self, seqs: list[Sequence], filled: list[Sequence] | None = None) -> None:
        """Count each of ``seqs``' token in flight as computed. A block it fills is
        hashed, or, given ``filled``, its sequence put there for the caller to
        hash once the tokens are appended."""
        bs = self.config.block_size
        full = []
        for s in seqs:
            n = s.num_computed_tokens = s.num_computed_tokens + 1
            if not n % bs:
                full.append(s)
        if filled is not None:
            filled += full
        elif full:
            self.block_manager.defer_commits(full)

    def _copy_to_host(self, both: torch.Tensor, agree, watched: int, slot: tuple | None = None
                      ) -> tuple:
        """Start copying a sampled step's ``[2, B]`` tokens and dead-end flags (and
        ``watched`` rows' ``agree`` flags) to the host: into ``slot`` (as this
        returns it) or the next host slot. Returns the host tensors and the event
        that fires once they are filled (None off CUDA)."""
        if slot is not None:
            host, agree_host, ready = slot
        elif both.is_cuda:
            if self._host_slots is None:
                self._host_slots = _HostSlots(self.config.max_num_seqs)
            host, agree_host, ready = self._host_slots.next(both.size(1), watched)
        else:
            host, ready = torch.empty(2, both.size(1), dtype=torch.long), None
            agree_host = torch.empty(watched, dtype=torch.bool) if watched else None
        host.copy_(both, non_blocking=True)
        if watched:  # (a slot copied into again may hold more rows' flags)
            agree_host[:watched].copy_(agree, non_blocking=True)
        if ready is not None:
            ready.record(current_stream(self.device))
        return host, agree_host, ready

    def _launch_inflight(self, seqs: list[Sequence], both: torch.Tensor, logits: torch.Tensor,
                         unchecked: dict[int, int], watched: list[int], agree, free: list[int],
                         masked: list[int], finishes: int, void: set[int] = frozenset(),
                         slot: tuple | None = None) -> None:
        """Start copying a sampled step's ``[2, B]`` tokens and dead-end flags (and the
        watched rows' ``agree`` flags) to the host, unless ``slot`` holds them
        already (:meth:`_copy_to_host`), and hold it as the step in flight."""
        host, agree_host, ready = slot if slot is not None else \
            self._copy_to_host(both, agree, len(watched))
        step = self._inflight = _InFlight(
            seqs=seqs, tokens=both[0], host=host, ready=ready,
            logits=logits if unchecked else None, unchecked=unchecked, watched=watched,
            agree=agree_host, free=free, masked=masked, finishes=finishes, void=void)
        overlap = len(unchecked) >= self._tuning.overlap_rows
        native = self.config.native_accept
        if overlap and (native or native is None and ready is not None):
            # the constraints' native worker offers the unmasked picks as soon as they
            # land, outside the interpreter, while the host goes on to the next step.
            # (The rows sampled under their masks were taken there too, in the same
            # trial: no gain beyond the spread, so their take stays on this thread)
            poll = event_poll(ready) if ready is not None else None
            if poll is not None or ready is None:
                step.early = self._acceptor.launch(seqs, list(unchecked), host, poll)
                self.num_native_accepts += step.early is not None
        self._quick_switches(overlap and step.early is None)
        if overlap and step.early is None:
            # else the accept thread does, taking the interpreter lock around it
            step.landed = threading.Event()
            step.early = self._accept_thread().submit(self._check_landed, step)

    def _quick_switches(self, on: bool) -> None:
        """While the accept thread checks picks, the interpreter offers the GIL to
        a waiting thread after 0.2 ms rather than its default 5 ms: the accept
        thread needs it briefly before and after each native batch accept, and
        otherwise waits for the main thread's next torch call. At 256 JSON rows
        on the H200 (one host, consecutive runs) constrained throughput went
        from 0.73 to 0.81 of free text's with it. The process's own interval is
        put back when the overlap ends (smaller batches, the pipeline drains,
        ``generate`` returns)."""
        if on == (self._switch_interval is not None):
            return
        if on:
            self._switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(min(self._switch_interval, self._tuning.accept_switch_interval))
        else:
            sys.setswitchinterval(self._switch_interval)
            self._switch_interval = None

    def _let_accept_in(self) -> None:
        """When the step in flight's tokens have landed and the accept thread has
        yet to start on them, wait until it has (it needs the interpreter lock
        for that, which this thread would otherwise keep up to a switch interval):
        its native accept then runs while this thread appends the last tokens."""
        step = self._inflight
        if step is not None and step.landed is not None and not step.landed.is_set() and (
                step.ready is None or step.ready.query()):
            _wait_landed(step)

    def _accept_thread(self) -> ThreadPoolExecutor:
        if self._accept_pool is None:
            self._accept_pool = ThreadPoolExecutor(1, thread_name_prefix="formcast-accept")
        return self._accept_pool

    def _check_landed(self, step: "_InFlight") -> list[int] | None:
        """On the accept thread: wait for ``step``'s tokens, then offer its unmasked
        picks to their constraints; the verdicts of ``list(step.unchecked)``, or None
        when a row failed to sample (its take sorts that out first, then checks)."""
        try:
            if step.ready is not None:  # (landed already, the usual case: kept the lock)
                wait_event(step.ready)
            step.lists = token_list, dead_list = step.host.tolist()
            if any(dead_list):
                return None
        finally:
            step.landed.set()
        return self._acceptor(step.seqs, token_list, list(step.unchecked))

    def _sample_live(self, logits: torch.Tensor, live: list[Sequence],
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
        ``first``: the rows' first tokens, as :meth:`_sort_rows` sorted them for that."""
        unmasked = self.config.unmasked_greedy
        kept = self._sorted_rows
        if first is not None:
            plain, drawn, unchecked, watch, free, masked, masked_only = first
        elif kept is not None and rows is None and kept[1] == Sequence.sampling_epoch and \
                kept[2] == unmasked and kept[0] == live:  # (identity compares, in C)
            # the rows as the last step sorted them: nothing changed their way since
            plain, drawn, unchecked, watch, free, masked, masked_only = kept[3]
            unchecked = dict(unchecked)  # (the caller's to change)
        else:
            plain, drawn, unchecked, watch, free, masked, masked_only = \
                self._sort_rows(live, rows)
            if rows is None:
                self._sorted_rows = (list(live), Sequence.sampling_epoch, unmasked,
                                     (plain, drawn, dict(unchecked), watch, free, masked,
                                      masked_only))
        dev = logits.device
        seqs = live if not plain else [live[j] for j in drawn]
        # (every drawn row watched: a batch's masked opening)
        watched = list(drawn) if len(watch) == len(drawn) else [drawn[k] for k in watch]
        masks = None
        if masked_only:
            masks = self._masks_for(seqs)
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
            if masked_only and not gather and len(drawn) <= self._tuning.pinned_rows and \
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
            elif self._tuning.picks_whole_row:  # (the kernel copies the unmasked picks: no clone launched)
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
            masks = self._masks_for(seqs)
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

    def _sort_rows(self, live: list[Sequence], rows: list[int] | None, *,
                   first: bool = False) -> tuple:
        """:meth:`_sample_live`'s rows by how each is sampled: the greedy rows
        given the unmasked argmax, the rows drawn by the sampler, those of
        them given an unmasked pick (-> logits row), the drawn ones watched for
        agreement (index into drawn), the rows without a constraint, the
        constrained ones sampled under their masks, and whether the drawn rows
        are all masked greedy rows (one kernel then picks them all). ``first``:
        the rows' first tokens, which every constrained row picks under its mask,
        watched, as an ordinary step's sampling picks them."""
        unmasked = self.config.unmasked_greedy
        if unmasked and not first and self._tuning.uniform_rows and \
                self._all_greedy_constrained(live):
            # (the usual constrained batch, sorted again when rows are masked or
            # unmasked: a row goes by its mask alone, found in C-level loops.
            # 256 rows with 3 masked on our CPU: 27 us rather than 56)
            masked = list(itertools.compress(itertools.count(), map(_IS_MASKED, live)))
            plain = _without(range(len(live)), masked)
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

    def _all_greedy_constrained(self, live: list[Sequence]) -> bool:
        """Whether every one of ``live`` is a greedy request under a constraint,
        with no banned tokens: found once for as long as the rows and the
        sequences' bans stay the same (a row's constraint and parameters are
        its own for good)."""
        kept = self._uniform_rows
        if kept is None or kept[1] != Sequence.ban_epoch or kept[0] != live:  # (identities, in C)
            every = all(s.constraint is not None and not s.banned_tokens and s.params.greedy
                        for s in live)
            kept = self._uniform_rows = (list(live), Sequence.ban_epoch, every)
        return kept[2]

    def _picks_unmasked(self, s: Sequence) -> bool:
        """Whether a pipelined step gives ``s`` the unmasked argmax (checked later
        by its constraint, if any) rather than the sampler's draw."""
        return s.params.greedy and not s.banned_tokens and (
            s.constraint is None or self.config.unmasked_greedy and not s.masked)

    def _fill_masks_async(self, seqs: list[Sequence]):
        """``seqs``' masks, filled on the mask thread: a future."""
        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="formcast-masks")
        return self._mask_pool.submit(self.sampler.fill_masks, seqs)

    def _masks_for(self, seqs: list[Sequence]) -> FilledMasks:
        """``seqs``' masks: those filled ahead while the last tokens were taken when
        they are for exactly these rows, else filled now."""
        ahead, self._masks_ahead = self._masks_ahead, None
        landed, self._premask_wait = self._premask_wait, None
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

    def _resample(self, prev: "_InFlight", refused: list[int], into: torch.Tensor | None = None
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
                self._settle(seqs[j], -1, None, errors[j])
            ok = [j for j in range(len(seqs)) if j not in errors]
            if not ok:
                return [], None, settled
            idx = to_device(ok, torch.long, tokens.device)
            seqs, tokens, dead = [seqs[j] for j in ok], tokens[idx], dead[idx]
        return seqs, torch.stack((tokens, dead.long())), settled

    def _settle_on_host(self, seqs: list[Sequence], both: torch.Tensor) -> None:
        """Give ``seqs`` their tokens from ``both`` ``[2, B]`` (tokens, dead-end
        flags) on the device, waiting for them."""
        token_list, dead_list = both.tolist()
        errors: dict[int, str] = {}
        token_list = Sampler.finish_rows(token_list, dead_list, errors)
        for i, seq in enumerate(seqs):
            self._settle(seq, token_list[i], None, errors.get(i))

    def _take(self, prev: "_InFlight", *, defer: bool = False
              ) -> tuple[list[Sequence], set[Sequence], list[int]]:
        """Append a launched step's tokens to its requests (waiting for the copy).

        Returns the requests that took a token or ended (the step's outputs), those
        of them that took their token, and the rows (indices into ``prev.seqs``)
        whose unmasked greedy pick their constraint refused. Those rows are
        sampled again under their masks by the caller when ``defer``, else here
        (waiting for the device), and then count among the outputs."""
        return self._take_end(self._take_begin(prev, defer=defer))

    def _take_begin(self, prev: "_InFlight", *, defer: bool = False) -> "_Taking":
        """:meth:`_take`'s first half: the rows sampled on the device (no
        constraint, or under their masks) take their tokens and the next masks of
        those that stay masked start filling on the mask thread. The unmasked
        picks are offered to their constraints by :meth:`_take_end`, unless the
        accept thread has been at it since they landed (``prev.early``)."""
        lists = None
        if prev.landed is not None:
            # the accept thread reads the tokens first (and this thread sleeps
            # meanwhile): it then holds the interpreter lock only until its native
            # accept starts, rather than waiting for it behind this thread's work
            _wait_landed(prev)
            lists = prev.lists
        if lists is None:
            if prev.ready is not None:
                if not prev.ready.query():  # (the device is busy: the host's chores now)
                    def busy(ready=prev.ready) -> bool:
                        return not ready.query()

                    self._commit_while(busy)
                    self._open_while(prev.seqs, busy)
                    self._tidy_constraints(prev.seqs)
                    self._bury_while(busy)
                    if self._tuning.detok_chore_tokens:
                        self._detokenize_while(prev.seqs, busy)
                wait_event(prev.ready)
            lists = prev.host.tolist()
        token_list, dead_list = lists
        errors: dict[int, str] = {}
        if any(dead_list):
            token_list = Sampler.finish_rows(token_list, dead_list, errors)
        seqs = prev.seqs
        if prev.watched:
            premasked = self._premasked
            agrees = prev.agree.tolist()
            if not premasked and not any(agrees):  # (a batch's opening: none met its argmax)
                Sequence.masked_picks_missed(map(seqs.__getitem__, prev.watched))
                agrees = ()
            for i, agreed in zip(prev.watched, agrees):
                seq = seqs[i]
                if premasked and seq in premasked:  # (its first masked pick since premasked)
                    del premasked[seq]
                    self._risky_seen(not agreed)
                if agreed and seq.masked and seq.agreements_due <= 1 and (
                        _narrow_choice(seq) or self._ends_string(seq, token_list[i])):
                    # (the grammar left few tokens there, or fixed the text: an
                    # agreement shows little, and the next pick, unmasked, would be
                    # a gamble; or the pick leaves a string, and the next one is the
                    # schema's punctuation, which the agreement says nothing about)
                    continue
                seq.masked_pick_seen(agreed)
        free, masked, checked = prev.free, prev.masked, list(prev.unchecked)
        room = self._room_of(seqs)
        taking = _Taking(prev=prev, token_list=token_list, checked=checked, defer=defer,
                         quiet=room.quiet and room.tokens > 2 and
                         self.eos_token_ids.isdisjoint(token_list))
        outputs = taking.outputs
        if errors or prev.void or self._num_finishes != prev.finishes:
            taking.clean = False
            # rows that failed to sample, and requests ended meanwhile (aborted: their
            # output went out then), take nothing
            gone = {i for i, seq in enumerate(seqs) if seq.status is FINISHED} | prev.void
            for i in sorted(errors.keys() - gone):
                outputs.append(seqs[i])
                self._settle(seqs[i], token_list[i], None, errors[i])
            gone.update(errors)
            free, masked, checked = ([i for i in rows if i not in gone]
                                     for rows in (free, masked, checked))
            taking.checked = checked
        if prev.early is not None:  # (checked since the tokens landed, or being checked)
            taking.pending, taking.pending_rows = prev.early, list(prev.unchecked)
        ok = taking.ok
        try:
            # sampled rows (masked, free) first: the next masks of those that stay
            # masked are then filled on the mask thread while the unmasked picks
            # are checked, both in native code
            if free:
                rows, tokens = self._rows_of(seqs, token_list, free)
                self._append_taken(rows, tokens, quiet=taking.quiet)
                outputs += rows
                ok.update(rows)
            if masked:  # sampled under their masks: their constraints take them in one go
                rows, tokens = self._rows_of(seqs, token_list, masked)
                # (prepared once for the batch's rows, its part for the masked rows
                # made again only when they change). Here, on this thread: taking
                # them on the accept thread as they land, while this one launched
                # the next step (256 rows all masked in a batch's opening), was
                # tried: on the H200, comparing the two in one process (four
                # processes, medians of 12-16 runs a side) it took 0.91-1.04x of
                # this way's time, inside the spread of either way's own runs
                verdicts = self._masked_acceptor(seqs, token_list, masked)
                if verdicts.count(1) == len(verdicts):  # (the usual step)
                    self._append_taken(rows, tokens, quiet=taking.quiet)
                    ok.update(rows)
                else:
                    for seq, token, verdict in zip(rows, tokens, verdicts):
                        if verdict <= 0:  # a token its own mask allowed, or the constraint failed
                            seq.error = seq.error or f"constraint rejected sampled token {token}"
                            self._finish(seq, "abort")
                    self._append_taken(rows, tokens, verdicts)
                    ok.update(seq for seq, verdict in zip(rows, verdicts) if verdict > 0)
                outputs += rows
            if defer and checked and masked:  # (the rows the next sampling draws, as it lists them)
                nxt = [seqs[i] for i in (sorted(free + masked) if free else masked)]
                nxt = [s for s in nxt if s in ok and s.status is not FINISHED
                       and not self._picks_unmasked(s)]
                if len(nxt) >= self._tuning.async_fill_rows and any(s.constraint is not None for s in nxt):
                    taking.ahead = self._masks_ahead = nxt, self._fill_masks_async(nxt)
        except BaseException:
            taking.abandon()
            raise
        return taking

    def _take_end(self, taking: "_Taking") -> tuple[list[Sequence], set[Sequence], list[int]]:
        """:meth:`_take`'s second half: the unmasked picks' verdicts (waited for
        when on the accept thread) and what follows from them; returns as :meth:`_take`."""
        prev, outputs, ok, checked = taking.prev, taking.outputs, taking.ok, taking.checked
        seqs = prev.seqs
        refused: list[int] = []
        try:
            if checked:  # unmasked greedy picks, offered to their constraints now
                rows, tokens = self._rows_of(seqs, taking.token_list, checked)
                pending, taking.pending = taking.pending, None
                verdicts = pending.result() if pending is not None else None
                if verdicts is None:
                    verdicts = self._accept_batch(rows, tokens)
                elif len(taking.pending_rows) != len(checked):  # (rows gone since: skipped)
                    at = dict(zip(taking.pending_rows, verdicts))
                    verdicts = [at[i] for i in checked]
                # rows not simply taken (refused, ended or failed) are few: the rest
                # go through in slices
                odd = [] if verdicts.count(1) == len(verdicts) else \
                    [k for k, v in enumerate(verdicts) if v != 1]
                if odd:
                    for k in odd:
                        seq, verdict = rows[k], verdicts[k]
                        if verdict == 0:
                            seq.pick_refused()  # masked until the model agrees with its grammar
                            self._premasked.pop(seq, None)  # (its masked pick is void)
                            refused.append(checked[k])
                            continue
                        if verdict == 2:  # taken, and the constraint is now done
                            seq.refusal_streak = 0
                            self._append_taken([seq], [tokens[k]], [2])
                            ok.add(seq)
                        else:  # the constraint failed (seq.error says how)
                            self._finish(seq, "abort")
                        outputs.append(seq)
                    rows, tokens = _without(rows, odd), _without(tokens, odd)
                if any(map(_STREAK, rows)):  # (found in C: most steps no row has one)
                    for seq in rows:
                        seq.refusal_streak = 0  # a pick taken ends the streak of refusals
                self._append_taken(rows, tokens, quiet=taking.quiet)
                outputs += rows
                ok.update(rows)
                self.num_unmasked_picks += len(verdicts) - verdicts.count(-1)
                self.num_refused_picks += len(refused)
                self._watch_risky(taking, rows, tokens, refused)
        finally:
            taking.abandon()  # (the threads are done with the constraints before we go on)
        if refused and not taking.defer:
            rows, both, _ = self._resample(prev, refused)  # (every refused row is an output)
            if rows:
                self._settle_on_host(rows, both)
            outputs.extend(seqs[i] for i in refused)
            refused = []
        return outputs, ok, refused

    # -- premasking ------------------------------------------------------------------
    # A greedy constrained row picks unmasked until its grammar refuses a pick; the
    # refused row is sampled again under its mask and set back a step (the step
    # launched on the refused token is lost to it), and a batch whose rows were set
    # back ends a step or more after the rest. Where a model breaks the grammar,
    # it breaks it at the same places: a model of random weights (the GPU
    # benchmark's) writes words inside a JSON string, and its pick after the
    # string's closing quote, where the grammar wants punctuation, is refused
    # nearly every time. So once the picks after such a token (one holding a double
    # quote that leaves the output out of a string, :meth:`_leaves_string`) mostly
    # broke the grammar, a row that takes one is masked for its next
    # pick, until its model agrees with its grammar again: no pick refused, no step
    # lost, the same tokens (greedy under the mask either way). Whether the model
    # would have broken it is still seen: a premasked row's masked pick is watched,
    # and one that is not the model's argmax would have been refused. A model that
    # follows the grammar there (a trained one writing JSON) never turns it on.
    # (Quotes that open a string count out: the word after one goes right, and
    # counted in they held the average under a half on the H100, 75 picks refused
    # and none premasked at 256 rows.)

    def _risky_tokens(self) -> frozenset[int]:
        """The tokens after which premasking may mask a row: those whose text
        holds a double quote (one that leaves a JSON string, :meth:`_leaves_string`)."""
        risky = self._risky
        if risky is None:
            quotes = self._quotes = [b.count(b'"') - b.count(b'\\"')
                                     for b in self.tokenizer.token_bytes()]
            risky = self._risky = frozenset(i for i, n in enumerate(quotes) if n)
        return risky

    def _leaves_string(self, seq: Sequence, token: int, appended: bool) -> bool:
        """Whether ``token`` (a risky one, the last of ``seq``'s output if
        ``appended``) leaves the row's output with an even number of unescaped
        double quotes: in JSON, out of a string (a key's end, a value's), where
        its grammar wants punctuation next, rather than into one, where any
        word goes (the picks a model of random weights gets wrong, and right).
        The count goes on from where the last call stopped (a few list lookups
        a token, in C), from the output's start again after a rollback (which
        resets it; a shorter output than counted does too)."""
        ids, quotes = seq.token_ids, self._quotes
        upto = len(ids) - appended
        done, parity = seq.quote_scan
        if upto < done:  # (tokens taken back)
            done, parity = seq.num_prompt_tokens, 0
        if upto > done:
            parity ^= sum(map(quotes.__getitem__, ids[done:upto])) & 1
            seq.quote_scan = (upto, parity)
        return not (parity + quotes[token]) & 1

    def _ends_string(self, seq: Sequence, token: int) -> bool:
        """Whether ``token``, ``seq``'s pick not yet appended, leaves its output
        out of a JSON string (:meth:`_leaves_string`, for a risky token). A
        masked row's agreement on such a pick does not end its masking
        (:meth:`_take_begin`). On the H100, the GPU benchmark's JSON rows: refused
        picks over five runs 40 -> 0 at 64 rows and 75 -> 25 at 256 (two runs of
        gpu_throughput.py); in one process (engine_ab.py, 4 runs a side) the same
        tokens, JSON tokens/s 1.002x best (medians 0.6-0.73 of free text's on that
        host either way: noise)."""
        return token in self._risky_tokens() and self._leaves_string(seq, token, False)

    def _premasking(self) -> bool:
        return self._premask_rate >= self._tuning.premask_after

    def _premask(self, seq: Sequence) -> None:
        seq.premask()
        self._premasked[seq] = None
        self.num_premasked_picks += 1

    def _premask_landed(self, taking: "_Taking") -> None:
        """Premask the rows of ``taking`` whose unmasked pick, landed and being
        checked on the accept thread or the native worker, is a risky token,
        for the sampling that comes before the verdicts: their masks (filled by
        :meth:`_masks_for`) wait for that check, which their matchers' state
        follows. A pick that turns out refused sets its row back as ever."""
        if not taking.checked or not self._premasking():
            return
        tokens, risky = taking.token_list, self._risky_tokens()
        if risky.isdisjoint(tokens):
            return
        seqs, found = taking.prev.seqs, False
        for i in taking.checked:
            if tokens[i] in risky and not seqs[i].masked and \
                    self._leaves_string(seqs[i], tokens[i], False):
                self._premask(seqs[i])
                found = True
        if found:
            self._premask_wait = taking.pending

    def _watch_risky(self, taking: "_Taking", rows: list[Sequence], tokens: list[int],
                     refused: list[int]) -> None:
        """After a take's verdicts (``rows`` took ``tokens`` unmasked; the picks at
        ``refused`` were refused): the verdicts on the rows that took a risky
        token the step before count in :attr:`_premask_rate`, and the rows that
        take one now are premasked (when premasking and the step's sampling
        comes after this) or watched so."""
        after = self._risky_after
        if after:  # (a few rows: each looked up in C)
            self._risky_after = []
            missed = [taking.prev.seqs[i] for i in refused]
            for seq in after:
                if seq in missed:
                    self._risky_seen(True)
                elif seq in rows:
                    self._risky_seen(False)
        risky = self._risky_tokens()
        if risky.isdisjoint(tokens):
            return
        premask = self._premasking() and not taking.sampled
        # (the rows that took one, found in C: a trained model writing JSON takes
        # quotes at most steps of a large batch)
        for seq, token in itertools.compress(zip(rows, tokens), map(risky.__contains__, tokens)):
            if not seq.masked and seq.status is not FINISHED and \
                    self._leaves_string(seq, token, True):
                if premask:
                    self._premask(seq)
                else:
                    self._risky_after.append(seq)

    def _forget_premasking(self) -> None:
        """Drop the rows premasked or watched and the check a mask waits for (the
        pipeline is over; the moving average stays)."""
        self._premasked.clear()
        self._risky_after, self._premask_wait = [], None

    def _risky_seen(self, missed: bool) -> None:
        """A pick after a risky token broke the grammar (``missed``), or did not."""
        self._premask_rate += (float(missed) - self._premask_rate) * self._tuning.premask_ema

    def _tidy_constraints(self, seqs: list[Sequence]) -> None:
        """Offer the constraint classes of ``seqs``' rows their optional ``tidy``
        hook (housekeeping that would otherwise fall on a step's path), while the
        host waits for the device anyway. The hooks are looked up once for as
        long as the rows stay the same (a scan of every row each step before)."""
        kept = self._tidy_hooks
        if kept is None or kept[0] != seqs:  # (identity compares, in C)
            kinds = {type(s.constraint) for s in seqs if s.constraint is not None}
            hooks = [h for h in (getattr(k, "tidy", None) for k in kinds) if h is not None]
            kept = self._tidy_hooks = (list(seqs), hooks)
        for hook in kept[1]:
            try:
                hook()
            except Exception:  # (the constraints report it where they are used)
                pass

    def _bury_while(self, busy) -> None:
        """Drop the constraints of ended requests that :meth:`_finish` kept, a
        few at a time while ``busy()`` (the device runs a step). Their last
        references are often the caller's, let go as ``generate`` returns: a
        batch of 256 xgrammar matchers took 1.5-2.4 ms to destroy on the H200's
        host there, on the path of the caller and of the next batch's opening."""
        graves = self._graves
        while graves and busy():
            del graves[-self._tuning.graves_at_once:]

    @staticmethod
    def _prepare_constraints(scheduled) -> None:
        """Offer the constraint classes of ``scheduled``'s requests that have yet
        to take a token their optional ``prepare`` hook, once for each class's
        instances (xgrammar's matchers fork their grammar's start state there),
        while the device runs the step just launched: their prefill. Made in
        the first accepts instead, the forks of 256 rows would hold up the batch's
        first masked steps; made with the matchers, before ``generate``, the
        device idles meanwhile (on an H100's host, py-spy counted 1.4 ms of a
        256-row batch's 2.3 ms of matcher making in xgrammar's fork)."""
        kinds: dict[type, list] = {}
        for item in scheduled:
            seq = item.seq
            if seq.constraint is not None and seq.first_token_time is None:
                kinds.setdefault(type(seq.constraint), []).append(seq.constraint)
        for kind, constraints in kinds.items():
            hook = getattr(kind, "prepare", None)
            if hook is not None:
                try:
                    hook(constraints)
                except Exception:  # (the constraints report it where they are used)
                    pass

    def _commit_while(self, busy) -> None:
        """While ``busy()`` (the device at work, the host otherwise idle), hash
        the full blocks that decode steps filled (see
        :meth:`BlockManager.defer_commits`), a few sequences at a time."""
        bm = self.block_manager
        while bm.num_deferred and busy():
            bm.commit_deferred(self._tuning.commit_chore_rows)

    def _open_while(self, seqs: list[Sequence], busy) -> None:
        """While ``busy()``, open the next KV block of ``seqs``' rows that will
        need one soon (:meth:`BlockManager.open_early`), a few rows at a time, a
        round of the rows at most."""
        bm = self.block_manager
        while busy() and bm.open_early(seqs, self._tuning.open_chore_rows):
            pass

    def _commit_quota(self) -> None:
        """Hash some of the blocks left unhashed, the step's launches made (a host
        with no wait to do it in still drains a batch's blocks in a few steps,
        not at the batch's end, where its requests are freed)."""
        if self.block_manager.num_deferred:
            self.block_manager.commit_deferred(self._tuning.commit_quota_rows)

    def _detokenize_while(self, seqs: list[Sequence], busy) -> None:
        """While ``busy()`` (the device still at work, the host otherwise
        idle), make the text of ``seqs``' deferred tokens (see
        :meth:`Sequence.defer_text`), a few rows at a time, each row once it has
        ``tuning.detok_chore_tokens`` of them. A batch's rows that end together then
        have a few tokens each left to detokenize, not their whole output: at 256
        rows of 128 tokens that was 4.3 ms of the H200's host, the device idle,
        at the end of every batch. The rows are taken in turn from where the
        last call stopped; off where ``tuning.detok_chore_tokens`` is None. (Not
        while waiting for the native worker's verdicts: that wait lets go of
        the interpreter lock, which the mask and accept threads want then; in
        the stubbed engine of host_overhead.py on our CPU, JSON at 256 rows,
        its steps took longer with it.)"""
        n = len(seqs)
        if not n:
            return
        at = self._detok_at % n
        left = n  # (one pass over the rows at most)
        step, enough = self._tuning.detok_chore_rows, self._tuning.detok_chore_tokens
        while left > 0 and busy():
            chunk = seqs[at:at + step]
            made = False
            for s in chunk:
                if len(s._undecoded) >= enough:
                    s.text  # (reading it makes it)
                    made = True
            at = (at + len(chunk)) % n
            left -= len(chunk)
            if not made:  # (rows take their tokens in step: the next ones have none either)
                break
        self._detok_at = at

    @staticmethod
    def _rows_of(seqs: list[Sequence], tokens: list[int], rows: list[int]
                 ) -> tuple[list[Sequence], list[int]]:
        """``seqs`` and ``tokens`` at ``rows`` (the lists themselves when that is all)."""
        if len(rows) == len(seqs):
            return seqs, tokens
        return [seqs[i] for i in rows], [tokens[i] for i in rows]

    @staticmethod
    def _accept_batch(seqs: list[Sequence], tokens: list[int]) -> list[int]:
        """Offer each of ``seqs`` its token in its constraint. Per row: 0 refused
        (state unchanged), 1 taken, 2 taken and the constraint is now
        terminated, -1 the constraint failed (``seq.error`` says how). A
        constraint class's ``accept_tokens`` hook takes all its rows in one call."""
        constraints = [seq.constraint for seq in seqs]
        kinds = set(map(type, constraints))
        if len(kinds) == 1:  # (the usual batch: one kind of constraint, one call)
            many = getattr(kinds.pop(), "accept_tokens", None)
            if many is not None:
                return _accept_many(many, seqs, constraints, tokens)
        verdicts = [0] * len(seqs)
        groups: dict = {}
        for j, seq in enumerate(seqs):
            many = getattr(type(seq.constraint), "accept_tokens", None)
            if many is not None:
                groups.setdefault(many, []).append(j)
                continue
            try:
                verdicts[j] = 0 if not seq.constraint.accept(tokens[j]) else \
                    2 if seq.constraint.is_terminated() else 1
            except Exception as exc:
                seq.error, verdicts[j] = f"constraint failed: {type(exc).__name__}: {exc}", -1
        for many, rows in groups.items():
            got = _accept_many(many, [seqs[j] for j in rows], [constraints[j] for j in rows],
                               [tokens[j] for j in rows])
            for j, verdict in zip(rows, got):
                verdicts[j] = verdict
        return verdicts

    def _drain(self) -> list[Sequence]:
        """Take the step in flight, if any: afterwards every request is in an
        ordinary state (its sampled token appended)."""
        self._drop_ahead()
        self._quick_switches(False)
        prev, self._inflight = self._inflight, None
        outputs = self._take(prev)[0] if prev is not None else []
        self._forget_premasking()  # (an ordinary step masks every row)
        # (after the take, which finds it for its rows: an ordinary step may take
        # several tokens a row without counting as a pipelined one)
        self._room = None
        # (the accept thread is done: the rows are let go)
        self._acceptor.reset()
        self._masked_acceptor.reset()
        return outputs

    def _sample_and_append(self, logits: torch.Tensor, seqs: list[Sequence],
                           masks: FilledMasks | None):
        """Sample ``seqs`` from ``logits`` and settle each; returns the sampling."""
        result = self.sampler(logits, seqs, masks=masks)
        for i, seq in enumerate(seqs):
            self._settle(seq, result.token_ids[i], result.logprobs[i], result.errors.get(i))
        return result

    def _settle(self, seq: Sequence, token: int, logprob: TokenLogprob | None,
                error: str | None) -> bool:
        """Give ``seq`` its sampled token, or handle the sampling's ``error``: roll
        back out of the dead end (the value is resampled next step) or end the
        request. True when the token was appended."""
        if error is None:
            self._append_token(seq, token, logprob)
            return True
        if not self._roll_back_dead_end(seq):
            seq.error = _dead_end_message(seq, error)
            self._finish(seq, "abort")
        return False

    # -- speculative decoding -----------------------------------------------------
    def _propose_drafts(self) -> None:
        """Give every running request in decode a draft to verify in this step."""
        spec = self.config.spec
        running = self.scheduler.running
        mode = self._draft_mode(len(running))
        if mode is None:
            return
        auto = spec.method == "auto"
        forced_only = mode == "forced"
        if self._draft_memory is None:
            self._draft_memory = DraftMemory(self.tokenizer.token_bytes())
        memory = self._draft_memory
        proposers = (JumpForwardProposer(memory),
                     PromptLookupProposer(spec.ngram_max, spec.ngram_min, memory=memory,
                                          encode=self._encode_plain,
                                          text_window=self._tuning.lookup_text_window,
                                          text_tries=self._tuning.lookup_text_tries,
                                          text_bytes=self._tuning.lookup_text_bytes))
        if self._mtp is not None or forced_only:  # grammar-forced tokens (then the MTP draft)
            proposers = proposers[:1]
        drafting: list[Sequence] = []
        for_mtp: list[Sequence] = []
        others = 0  # tokens the step runs anyway
        for seq in running:
            seq.draft = None
            others += min(seq.num_uncomputed_tokens, self.config.max_num_batched_tokens)
            if seq.num_uncomputed_tokens != 1 or (auto and not seq.params.greedy) \
                    or (forced_only and seq.constraint is None):
                continue
            room = min(spec.max_draft, seq.max_total_len - len(seq) - 1)
            if room > 0:
                draft = propose(seq, spec, room, proposers)
                if draft.tokens:
                    seq.draft = draft
                    drafting.append(seq)
                elif self._mtp is not None and not forced_only:
                    for_mtp.append(seq)
        if for_mtp:
            for seq, draft in zip(for_mtp, self._mtp.propose_batch(for_mtp)):
                if draft.tokens and draft.confidence[0] >= spec.min_confidence:
                    seq.draft = draft
                    drafting.append(seq)
        if drafting:
            lengths = choose_lengths([s.draft.confidence for s in drafting], others,
                                     self.step_cost) if spec.scheduled \
                else [len(s.draft.tokens) for s in drafting]
            for seq, n in zip(drafting, lengths):
                seq.draft = seq.draft.cut(n) if n else None
                if seq.draft is not None and seq.constraint is not None:
                    seq.draft.masks = fill_draft_masks(seq.constraint, seq.draft.tokens,
                                                       self.sampler.bitmask_width)

    def _draft_mode(self, num_running: int) -> str | None:
        """What a step drafts: None, "forced" (grammar-forced tokens only) or "all".
        "auto" only drafts where outputs cannot change: greedy requests, float32
        (bfloat16 GEMMs round differently for 1 and 1 + draft rows); past
        ``auto_max_batch`` requests only what a grammar forces, which costs a row of
        this step and saves a whole step later."""
        spec = self.config.spec
        if not spec.enabled:
            return None
        if spec.method != "auto":
            return "all"
        if self.dtype != torch.float32:
            return None
        return "forced" if num_running > spec.auto_max_batch else "all"

    def _encode_plain(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _verify(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Accept the longest prefix of ``seq.draft`` the target agrees with, then one
        token of the target's own; ``logits`` [1 + d, V] scores the last token and
        each draft position. Rejected positions leave no trace: their KV is beyond
        ``num_computed_tokens`` (overwritten later) and the matcher never saw them."""
        draft, seq.draft = seq.draft, None
        d = len(logits) - 1
        seq.num_draft_tokens += d
        seq.num_verification_tokens += d + 1
        lookup_seen = lookup_ok = 0
        accepted, chosen = 0, None
        for j in range(d + 1):
            proposal = draft.tokens[j] if j < d else None
            q = draft.probs[j] if draft.probs is not None and j < d else None
            mask = draft.masks[j:j + 1] if draft.masks is not None and j < len(draft.masks) \
                else None
            verdict = self.sampler.verify(logits[j:j + 1], seq, proposal, q, mask)
            if verdict.error is not None:
                if not self._roll_back_dead_end(seq):
                    seq.error = _dead_end_message(seq, verdict.error)
                    self._finish(seq, "abort")
                break
            if j < d and draft.source(j) == "lookup":
                lookup_seen += 1
                lookup_ok += verdict.accepted
            self._append_token(seq, verdict.token_id, verdict.logprob)
            if verdict.accepted:
                accepted += 1
                seq.num_accepted_draft_tokens += 1
                seq.num_forced_tokens += draft.source(j) == "forced"
                if not seq.is_finished:
                    seq.num_computed_tokens += 1  # its KV was computed in this step
            elif j < d:
                chosen = verdict.token_id
            if seq.is_finished or not verdict.accepted:
                break
        seq.spec_lookup_proposed += lookup_seen
        seq.spec_lookup_accepted += lookup_ok
        if self._draft_memory is not None and not seq.is_finished:
            self._draft_memory.observe(seq, draft, accepted, chosen)
        if not seq.is_finished:
            # give back blocks that only held rejected positions; hash full blocks
            self.block_manager.truncate(seq, seq.num_computed_tokens)
            self.block_manager.commit(seq)

    def _roll_back_dead_end(self, seq: Sequence) -> bool:
        """Back a request out of a dead end its constraint can explain; False if not.

        A constraint whose finished value failed an end check (``rollback_hint() > 0``)
        is rolled back to the step holding the offending value, and so are the
        request's tokens, text and KV cache; the token sampled at that step is banned
        there, so the next step samples something else. At most
        ``config.max_constraint_rollbacks`` times per request.
        """
        hint = getattr(seq.constraint, "rollback_hint", None)
        if hint is None or seq.num_rollbacks >= self.config.max_constraint_rollbacks:
            return False
        try:
            k = int(hint())
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
        seq.quote_scan = (seq.num_prompt_tokens, 0)  # (premasking's count: tokens replaced)
        if seq.logprobs is not None:
            del seq.logprobs[seq.num_output_tokens:]
        seq.ban(keep, banned)
        seq.num_rollbacks += 1
        seq.detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=True)
        seq.text = seq.detok.feed_many(seq.output_ids)
        return True

    def _append_taken(self, seqs: list[Sequence], tokens: list[int],
                      verdicts: list[int] | None = None, *, quiet: bool = False) -> None:
        """:meth:`_append_token` of each of ``seqs``' ``tokens`` that its
        constraint (if any) took, by :meth:`_accept_batch`'s ``verdicts`` (rows
        under 1 are skipped; None: every row took its token and none ended its
        constraint), without logprobs. A token that cannot end its request (no
        end-of-sequence or stop token, no stop strings to look for, room left,
        not the first) is appended here in two list appends: every row, every step.
        ``quiet``: that is known of every row (:attr:`_Taking.quiet`)."""
        if quiet and verdicts is None:
            for seq, token in zip(seqs, tokens):  # (Sequence.defer_text, inline)
                seq.token_ids.append(token)
                seq._undecoded.append(token)
            return
        eos, append = self.eos_token_ids, self._append_token
        for seq, token, verdict in zip(seqs, tokens, verdicts or itertools.repeat(1)):
            if verdict == 1 and seq.ends_on_length_only and token not in eos and \
                    len(seq.token_ids) + 1 < seq.max_total_len and seq.first_token_time:
                seq.token_ids.append(token)
                seq._undecoded.append(token)
            elif verdict > 0:
                append(seq, token, None, accepted=True, terminated=verdict == 2)

    def _append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None, *,
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
                self._finish(seq, "abort")
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
            self._finish(seq, "stop")
        elif seq.status is SequenceStatus.FINISHED:
            return  # a stop string matched
        elif seq.constraint is not None and (
                seq.constraint.is_terminated() if terminated is None else terminated):
            self._finish(seq, "stop")
        elif len(seq.token_ids) >= seq.max_total_len:
            self._finish(seq, "length")

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
            self._finish(seq, "stop")

    def _finish(self, seq: Sequence, reason: str) -> None:
        self._num_finishes += 1
        if not seq.is_finished:
            self.scheduler.finish(seq, reason)
        self.runner.release(seq)
        self._seqs.pop(seq.request_id, None)
        if seq.constraint is not None and self._keep_graves:
            self._graves.append(seq.constraint)
            if len(self._graves) > self._graves_kept:  # (no device time to drop them in)
                del self._graves[:self._graves_kept // 2]
        # (a batch's rows ending at once each detokenize their whole output here,
        # 4.3 ms for 252 rows on the H200's host, while rows set back a step by a
        # refused pick wait to go on. Making the text when the output is read
        # instead, past the step, was tried: at 256 JSON rows, one process,
        # medians of 8 runs a side, free text 1.031x, JSON 0.996x: inside the spread)
        if seq.detok is not None:
            text = seq.text  # every token's text made while the detokenizer is here
            if reason != "stop":
                text += seq.detok.flush()  # bytes of a character cut off at the end
            seq.text, seq.detok = text, None

    # -- conveniences -------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 *, constraints: list[LogitsConstraint | None] | None = None
                 ) -> list[RequestOutput]:
        """Run a batch of prompts to completion; outputs come back in prompt order.

        Every prompt is validated before any is queued, so a bad one raises
        :class:`RequestError` without starting the others.
        """
        n = len(prompts)
        plist = params if isinstance(params, list) else [params] * n
        clist = constraints if constraints is not None else [None] * n
        if len(plist) != n or len(clist) != n:
            raise RequestError(f"got {n} prompts but {len(plist)} params and "
                               f"{len(clist)} constraints")
        seqs = []
        for i, (p, sp, c) in enumerate(zip(prompts, plist, clist)):
            try:
                seqs.append(self._make_sequence(p, sp, c, None))
            except RequestError as exc:
                raise RequestError(f"prompt {i}: {exc}") from exc
        for seq in seqs:
            self._queue(seq)
        pending = {s.request_id for s in seqs}
        pause = self.config.pause_gc
        paused = (pause if pause is not None else self.device.type == "cuda") and gc.isenabled()
        if paused:
            gc.disable()
        try:
            while pending:
                finishes, aborted = self._num_finishes, bool(self._aborted)
                seqs_out = self._step()
                if finishes != self._num_finishes or aborted:  # (else none ended: no scan)
                    for seq in seqs_out:
                        if seq.status is FINISHED:
                            pending.discard(seq.request_id)
                if pending and not self.scheduler.has_unfinished():
                    raise EngineError(f"requests {sorted(pending)} were lost by the scheduler")
            return [s.to_output() for s in seqs]
        finally:
            self._quick_switches(False)
            if paused:
                gc.enable()

    @torch.inference_mode()
    def forward_logits(self, token_ids: SequenceABC[int], *, as_generated: bool = False
                       ) -> torch.Tensor:
        """Float32 logits ``[T, V]`` (CPU) for every position of one sequence.

        Runs through the same paged path as serving, in chunks of the step budget,
        outside the scheduler; needs enough free KV blocks for the whole sequence.
        The tokens count as a prompt: a quantized engine runs them on its float32
        weights, as it does prompts. ``as_generated``: on its quantized weights, as
        it runs the tokens it generates.
        """
        self._aborted += self._drain()  # the step in flight is taken; its outputs go out next
        seq = self._make_sequence(list(token_ids), SamplingParams(max_tokens=1), None,
                                  f"forward-logits-{next(self._ids)}")
        bm = self.block_manager
        if not bm.can_grow(seq, len(seq)):
            raise RequestError(f"not enough free KV blocks for {len(seq)} tokens right now")
        bm.grow(seq, len(seq))
        try:
            chunks = []
            while seq.num_computed_tokens < len(seq):
                n = min(len(seq) - seq.num_computed_tokens, self.config.max_num_batched_tokens)
                chunks.append(self.runner.execute([ScheduledSeq(seq=seq, num_tokens=n)],
                                                  all_logits=True,
                                                  prompt_float=not as_generated).cpu())
                seq.num_computed_tokens += n
            return torch.cat(chunks)
        finally:
            bm.free(seq)
            self.runner.release(seq)


def build_model(config: LlamaConfig | DeepseekV4Config, weights: dict[str, torch.Tensor], *,
                device: torch.device, dtype: torch.dtype, quantization: str | None = None,
                int4_blocks: dict | None = None) -> LlamaForCausalLM | DeepseekV4ForCausalLM:
    """Instantiate the model without random init, load weights, move to device/dtype,
    and optionally quantize its linear layers ("int4" or "int8", CPU only, Llama only).

    A DeepSeek-V4 model gets its MTP layer when ``weights`` hold ``mtp.0.*`` tensors,
    and keeps in float32 what DeepSeek keeps there (norms, hyper-connection maps, sinks).
    """
    if quantization is not None and device.type != "cpu":
        raise ValueError(f"quantization={quantization!r} runs on the CPU only; "
                         f"use quantization=None on {device.type}")
    if isinstance(config, DeepseekV4Config):
        if quantization is not None:
            raise ValueError(f"quantization={quantization!r} is not available for DeepSeek-V4; "
                             "use quantization=None")
        with torch.device("meta"):
            model = DeepseekV4ForCausalLM(config, with_mtp=any(n.startswith("mtp.0.") for n in weights))
        model.to_empty(device="cpu")
        model.load_weights(weights)
        return model.cast_(dtype).to(device).eval()
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to_empty(device="cpu")
    model.tie_weights()
    model.load_weights(weights)
    model = model.to(device=device, dtype=dtype).eval()
    if quantization is not None:
        quantize_linears(model, quantization, blocks=int4_blocks)
    return model


def fuse_int4_blocks(blocks: dict[str, Int4Blocks]) -> dict[str, Int4Blocks]:
    """A GGUF's per-projection 4-bit blocks (transformers names) under the engine's
    layer names, fused as its Llama runs them (q, k, v -> qkv_proj; gate, up ->
    gate_up_proj). A fused layer whose parts are not all 4-bit is left out (it is
    quantized from float instead)."""
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    out: dict[str, Int4Blocks] = {}
    for name in blocks:
        stem, part, _ = name.rsplit(".", 2)  # "model.layers.0.mlp", "up_proj", "weight"
        for layer, parts in fused.items():
            if part == parts[0]:
                names = [f"{stem}.{p}.weight" for p in parts]
                if all(n in blocks for n in names):
                    out[f"{stem}.{layer}"] = Int4Blocks.cat([blocks[n] for n in names])
        if part in ("o_proj", "down_proj"):
            out[f"{stem}.{part}"] = blocks[name]
    return out


def _state_blocks(config: EngineConfig, model_config: DeepseekV4Config, dtype: torch.dtype,
                  max_rollback: int) -> int:
    """Admission blocks for a DeepSeek-V4 engine: the tokens whose growing state fits
    in ``kv_cache_memory`` after every request's fixed part (windows, raw rows), capped
    at what ``max_num_seqs`` full-length requests could use and at 2**16 blocks."""
    bs = config.block_size
    fixed = config.max_num_seqs * state_bytes_per_sequence(model_config, dtype, max_rollback)
    free = max(config.kv_cache_memory - fixed, config.kv_cache_memory // 4)
    fit = free // (bs * state_bytes_per_token(model_config, dtype))
    longest = -(-min(config.max_model_len or model_config.max_position_embeddings,
                     model_config.max_position_embeddings) // bs)
    return max(1, min(fit, config.max_num_seqs * longest, 2 ** 16))


@functools.cache
def _conforms(kind: type) -> bool:
    """Whether instances of ``kind`` implement LogitsConstraint (the protocol's
    structural check is slow: a batch of constrained requests checks each class once)."""
    return issubclass(kind, LogitsConstraint)


def _wait_landed(step: "_InFlight") -> None:
    """Wait until the accept thread has read ``step``'s tokens (or is done with it)."""
    while not step.landed.wait(0.05):
        if step.early.done():  # (a job that never ran: the caller reads the tokens itself)
            return


def _forces_text(seq: Sequence) -> bool:
    """Whether ``seq``'s constraint, in the state it picked its last token in
    (not taken yet), fixed that token's text (its optional ``forces_text`` hook;
    False without one, or when it fails: the agreement then counts).

    A request masked since its unmasked pick broke its grammar goes back to
    unmasked picks once its masked pick is its model's argmax. Where the grammar
    fixes the text (a JSON key, its punctuation) the two often meet by chance: in
    a batch's opening at 256 rows of one schema, a random-weights model's picks
    met the grammar's on the `":` after a key and every row went back to unmasked
    picks, to have the next one, `":` again inside the string, refused at once
    (a step of every row lost, and one sampled again under its mask). Counted
    only where the grammar leaves a choice, the rows stay masked through the
    punctuation: on the CPU, 16 such rows had 1 pick refused rather than 17, in
    41 pipelined steps rather than 42, with the same tokens."""
    hook = getattr(seq.constraint, "forces_text", None)
    if hook is None:
        return False
    try:
        return bool(hook())
    except Exception:
        return False


def _narrow_choice(seq: Sequence) -> bool:
    """Whether ``seq``'s constraint, in the state it picked its last token in
    (not taken yet), allowed few tokens there: its optional ``narrow_choice``
    hook (fewer than half the vocabulary's tokens), else :func:`_forces_text`.
    An agreement there does not end a row's masking.

    Where a grammar leaves few tokens (a number's digits, punctuation, a key) a
    masked pick often meets its model's argmax by chance, and the row's next
    pick, unmasked, is a gamble: at 256 rows of the GPU benchmark's JSON
    workload every refused pick (5 a run, H200) was an `8` after `"age":88`,
    where the schema's integer stops at 120 (a step lost to each, and the
    batch's last step waiting on those rows). Counted only where the grammar
    leaves a wide choice (inside a string, for JSON), an agreement on a digit
    leaves the row masked through the number."""
    hook = getattr(seq.constraint, "narrow_choice", None)
    if hook is None:
        return _forces_text(seq)
    try:
        return bool(hook())
    except Exception:
        return False


_IS_MASKED = operator.attrgetter("masked")
_STREAK = operator.attrgetter("refusal_streak")


def _without(items: SequenceABC, drop: list[int]) -> list:
    """``items`` but those at ``drop`` (ascending indices): a few slices."""
    out, start = [], 0
    for k in drop:
        out += items[start:k]
        start = k + 1
    out += items[start:]
    return out


def _accept_many(many, seqs: list[Sequence], constraints: list, tokens: list[int]
                 ) -> list[int]:
    """A constraint class's ``accept_tokens`` hook over ``seqs``' ``constraints``:
    its verdicts, or -1 for every row (with ``seq.error`` set) when it fails or
    answers for another number of rows (which of them moved is unknown)."""
    try:
        got = many(constraints, tokens)
        if len(got) != len(seqs):
            raise ValueError(f"accept_tokens gave {len(got)} verdicts for {len(seqs)} tokens")
        return got
    except Exception as exc:
        for seq in seqs:
            seq.error = f"constraint failed: {type(exc).__name__}: {exc}"
        return [-1] * len(seqs)


class _Acceptor:
    """The accept of a pipelined step's tokens by rows that stay the same from
    step to step (the accept thread's check of a large batch's unmasked picks,
    and the take of the rows sampled under their masks, all of a batch's rows in
    its opening): :meth:`Engine._accept_batch`, through the rows' constraint
    class's ``batch_acceptor`` hook when they share one, its per-row preparation
    made again only when the rows change. A hook that raises, when prepared or
    called, fails every request of the call, as ``accept_tokens``.

    A call may offer tokens to some of the rows only (``at``): the unmasked
    picks of a batch some of whose rows are masked, those rows changing from
    step to step. The preparation is then for all the rows, and a prepared
    hook's ``subset`` (when it has one) makes the part for those rows from it,
    rather than each step preparing afresh (on the H200's host ~100 us of the
    accept thread's, which the main thread waits for the interpreter lock)."""

    __slots__ = ("seqs", "every", "hook", "prepared", "failure", "index", "part", "part_rows")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Let go of the rows (the next call prepares for its own)."""
        self.seqs = self.every = self.hook = self.prepared = self.failure = self.index = None
        self.part = self.part_rows = None

    def __call__(self, seqs: list[Sequence], tokens: list[int], at: list[int] | None = None
                 ) -> list[int]:
        """The verdicts of ``seqs[i]`` taking ``tokens[i]`` for ``i`` in ``at``
        (None: every row), in that order."""
        if at is not None and not at:
            return []
        if self.seqs != seqs:  # (identity compares, in C)
            self._prepare(seqs)
        if at is not None and len(at) == len(seqs) and at == self.every:
            at = None
        if at is None and self.index is None:
            if self.prepared is None and self.failure is None:
                return Engine._accept_batch(seqs, tokens)
            return _accept_many(self._hook, seqs, None, tokens)
        if at is None:
            at = self.every
        rows, tokens = Engine._rows_of(seqs, tokens, at)
        index = at if self.index is None else [self.index[i] for i in at]
        if self.failure is not None:
            return _accept_many(self._hook, rows, None, tokens)
        if self.hook is None or min(index) < 0:  # (no hook: the rows alone)
            return Engine._accept_batch(rows, tokens)
        try:
            part = self._part(index, rows)
        except Exception as exc:
            return _accept_many(_raise(exc), rows, None, tokens)
        return _accept_many(lambda _constraints, tokens: part(tokens), rows, None, tokens)

    def _part(self, index: list[int], rows: list[Sequence]):
        """The prepared hook for the constrained rows at ``index`` (of the
        preparation's), ``rows`` their sequences: made from the preparation
        when the rows change (a hook without subsets: prepared for the rows
        themselves). Raises what the hook raises."""
        if self.part_rows != index:
            subset = getattr(self.prepared, "subset", None)
            try:
                self.part = subset(index) if subset is not None else \
                    self.hook([s.constraint for s in rows])
                self.part_rows = index
            except Exception:
                self.part = self.part_rows = None
                raise
        return self.part

    def launch(self, seqs: list[Sequence], at: list[int], host: torch.Tensor, poll
               ) -> "_NativeCheck | None":
        """The accept of ``seqs[i]`` taking ``host[0, i]`` for ``i`` in ``at``, on
        the constraint class's native worker as soon as ``poll`` (see
        :func:`kernels.event_poll`; None: now) says the tokens landed in ``host``
        (``[2, len(seqs)]``: tokens, dead-end flags). None when the rows'
        prepared hook has no ``launch`` or declines (the caller checks them
        itself)."""
        if not at:
            return None
        if self.seqs != seqs:  # (identity compares, in C)
            self._prepare(seqs)
        if self.failure is not None or self.hook is None:
            return None
        index = at if self.index is None else [self.index[i] for i in at]
        if min(index) < 0:
            return None
        rows = seqs if len(at) == len(seqs) else [seqs[i] for i in at]
        try:
            part = self.prepared if index == self.every else self._part(index, rows)
            launch = getattr(part, "launch", None)
            job = launch(host, at, poll) if launch is not None else None
        except Exception:  # (the ordinary check reports it)
            return None
        return None if job is None else _NativeCheck(job, rows)

    def _prepare(self, seqs: list[Sequence]) -> None:
        """The hook's preparation for the constrained ones of ``seqs`` (the rest
        are never offered a token: their ``index`` entry is -1)."""
        self.seqs, self.prepared, self.failure, self.index = list(seqs), None, None, None
        self.every = list(range(len(seqs)))
        self.part = self.part_rows = None
        constraints = [s.constraint for s in seqs if s.constraint is not None]
        if len(constraints) < len(seqs):
            at = itertools.count()
            self.index = [next(at) if s.constraint is not None else -1 for s in seqs]
        kinds = set(map(type, constraints))
        hook = self.hook = \
            getattr(kinds.pop(), "batch_acceptor", None) if len(kinds) == 1 else None
        if hook is not None:
            try:
                self.prepared = hook(constraints)
            except Exception as exc:
                self.failure = exc

    def _hook(self, _constraints, tokens: list[int]) -> list[int]:
        """The prepared hook as :func:`_accept_many` calls one."""
        if self.failure is not None:
            raise self.failure
        return self.prepared(tokens)


class _NativeCheck:
    """The verdicts of a step's unmasked picks, checked by the constraint
    class's native worker (see :meth:`_Acceptor.launch`), as the accept
    thread's future gives them: ``result()`` the verdicts (a failed constraint:
    -1 for every row, ``seq.error`` set, as :func:`_accept_many`), or None when a
    row failed to sample (no constraint moved)."""

    __slots__ = ("job", "rows")

    def __init__(self, job, rows: list[Sequence]) -> None:
        self.job, self.rows = job, rows

    def done(self) -> bool:
        return self.job.done()

    def wait(self) -> None:
        """Until the worker is through with the constraints."""
        self.job.wait()

    def result(self) -> list[int] | None:
        rows = self.rows
        try:
            verdicts = self.job.result()
        except Exception as exc:
            return _accept_many(_raise(exc), rows, None, [0] * len(rows))
        if verdicts is None:
            return None
        return _accept_many(lambda _constraints, _tokens: verdicts, rows, None, verdicts)


def _raise(exc: Exception):
    """A hook, as :func:`_accept_many` calls one, that raises ``exc``."""
    def hook(_constraints, _tokens):
        raise exc
    return hook


def _dead_end_message(seq: Sequence, error: str) -> str:
    """The sampler's error, with why the constraint refused to end and what was tried."""
    why = getattr(seq.constraint, "last_violation", None)
    parts = [error]
    if why:
        parts.append(f"the finished value fails its end check: {why}")
    if seq.num_rollbacks:
        parts.append(f"after {seq.num_rollbacks} rollback(s) to resample it")
    if seq.error:
        parts.append(seq.error)
    return "; ".join(parts)


@dataclass(slots=True)
class _Room:
    """What :meth:`Engine._room_of` found of a list of rows."""

    seqs: list[Sequence]
    tokens: int   # every row has room for at least this many more tokens
    quiet: bool   # every row ends on its length only and has its first token
    steps: int    # Engine.num_pipelined_steps when found
    unstarted: bool = False  # a row had yet to take its first token


class _HostSlots:
    """Pinned host buffers that pipelined steps' tokens and agreement flags are
    copied into, and the events that fire once they are filled: two sets, used
    in turn, since a step's set is read before the step after next is sampled
    (pinned memory and an event made for every step cost tens of microseconds
    of the host's time a step)."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self._tokens = [torch.empty(2 * rows, dtype=torch.long, pin_memory=True)
                        for _ in range(2)]
        self._flags = [torch.empty(rows, dtype=torch.bool, pin_memory=True) for _ in range(2)]
        self._events = [torch.cuda.Event(), torch.cuda.Event()]
        self._turn = 0

    def next(self, n: int, watched: int
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.cuda.Event]:
        """The next set: ``[2, n]`` tokens, ``[watched]`` flags (None for 0), its event."""
        if n > self.rows:  # (more rows than running requests can be; watched <= n)
            flags = torch.empty(watched, dtype=torch.bool, pin_memory=True) if watched else None
            return (torch.empty(2, n, dtype=torch.long, pin_memory=True), flags,
                    torch.cuda.Event())
        k = self._turn
        self._turn ^= 1
        return (self._tokens[k][:2 * n].view(2, n),
                self._flags[k][:watched] if watched else None, self._events[k])


@dataclass(eq=False, kw_only=True)
class _InFlight:
    """A decode step launched and sampled on the device whose tokens the host has
    not taken yet."""

    seqs: list[Sequence]            # its rows, in order
    tokens: torch.Tensor            # [B] long, on the device: the next step's input
    host: torch.Tensor              # [2, B] long (tokens, dead-end flags), being copied in
    ready: torch.cuda.Event | None  # fires once ``host`` is filled (None off CUDA)
    # rows given an unmasked greedy pick their constraint has yet to check, each
    # to its row of ``logits`` (kept to sample it again under its mask if refused)
    unchecked: dict[int, int] = field(default_factory=dict)
    logits: torch.Tensor | None = None
    # masked greedy rows (after a refused pick) and, being copied in, whether each
    # one's masked pick was its unmasked argmax: those go back to unmasked picks
    watched: list[int] = field(default_factory=list)
    agree: torch.Tensor | None = None
    # every row is in exactly one of: ``unchecked``, ``free`` (no constraint),
    # ``masked`` (constrained, sampled under its mask), in row order
    free: list[int] = field(default_factory=list)
    masked: list[int] = field(default_factory=list)
    finishes: int = 0  # Engine._num_finishes when launched: a request may have ended since
    # rows in none of those: requests that ended since (dropped when taken), and
    # ``void`` ones, settled by a failed resample (drawn from a state left behind)
    void: set[int] = field(default_factory=set)
    # the verdicts of ``unchecked``'s picks, on the constraints' native worker or the
    # accept thread from the moment they land (``landed``: the thread read them)
    early: "Future | _NativeCheck | None" = None
    landed: threading.Event | None = None
    lists: list | None = None


@dataclass(eq=False, kw_only=True)
class _Ahead:
    """A decode step launched before the host appended its input tokens' step
    (:meth:`Engine._fast_lane`), for the next pipelined step to take."""

    seqs: list[Sequence]  # its rows, in order
    logits: torch.Tensor
    mark: int             # the model runner's decode mark before it (to rewind)


@dataclass(eq=False, kw_only=True)
class _Taking:
    """A step in flight being taken, between :meth:`Engine._take_begin` and
    :meth:`Engine._take_end`."""

    prev: _InFlight
    token_list: list[int]  # its tokens, on the host
    checked: list[int]     # its rows with unmasked picks their constraints check
    defer: bool            # refused picks are sampled again by the caller
    outputs: list[Sequence] = field(default_factory=list)
    ok: set[Sequence] = field(default_factory=set)  # requests that took their token
    # verdicts of ``pending_rows``' picks, on the accept thread or the native worker
    pending: "Future | _NativeCheck | None" = None
    pending_rows: list[int] = field(default_factory=list)
    ahead: tuple[list[Sequence], Future] | None = None  # the next masks, on the mask thread
    clean: bool = True  # every row sampled, none voided, no request ended since the launch
    sampled: bool = False  # the step after it was sampled before its verdicts came
    # no row's token can end its request (see Engine._room_of; no end token among
    # them): a row that took its token appends it plainly
    quiet: bool = False

    def abandon(self) -> None:
        """Wait for the threads working on its constraints (their errors show
        where their results are read)."""
        futures = [f for f in (self.pending, self.ahead and self.ahead[1]) if f is not None]
        for f in futures:
            if isinstance(f, _NativeCheck):
                f.wait()
            else:
                wait([f])

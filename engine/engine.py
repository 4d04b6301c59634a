"""The engine: requests in, tokens out, over a continuously batched paged KV cache.

``Engine.step()`` is one iteration: schedule, launch the model over every
scheduled token, take the sampled tokens into their requests, and return what
changed. In steady decoding with asynchronous scheduling (CUDA) the step is the
:class:`formcast.engine.pipeline.Pipeline`'s: it launches the next forward before
it takes the last one's tokens. Around the loop, one part per job: intake
(:mod:`.intake`), output (:mod:`.output`), speculative decoding
(:mod:`.speculative`), the host's chores (:mod:`.chores`), loading (:mod:`.loading`).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence as SequenceABC

import torch

from formcast.engine.chores import HostChores
from formcast.engine.config import EngineConfig
from formcast.engine.constraint import LogitsConstraint
from formcast.engine.constraint_ops import MaskThread, prepare_constraints
from formcast.engine.errors import EngineError, RequestError
from formcast.engine.intake import RequestIntake
from formcast.engine.kernels import to_device
from formcast.engine.loading import (block_manager_for, build_runner, full_blocks, load, max_len,
                                     settle_process)
from formcast.engine.model_runner import ModelRunner
from formcast.engine.models.deepseek_v4 import DeepseekV4ForCausalLM
from formcast.engine.models.llama import LlamaForCausalLM
from formcast.engine.output import OutputProcessor
from formcast.engine.pipeline import Pipeline, PipelineStats
from formcast.engine.sampler import FilledMasks, Sampler
from formcast.engine.sampling_params import SamplingParams
from formcast.engine.scheduler import ScheduledSeq, Scheduler
from formcast.engine.scoring import continuation_logprobs
from formcast.engine.sequence import Request, RequestOutput, Sequence, SequenceStatus
from formcast.engine.speculative.decoding import SpeculativeDecoder
from formcast.engine.tokenizer import Tokenizer

FINISHED = SequenceStatus.FINISHED


class Engine:
    """A continuously batching inference engine for one model.

    Build it with :meth:`from_pretrained`. Submit work with :meth:`add_request` and
    drive it with :meth:`step`, or use :meth:`generate` for a whole batch.
    """

    def __init__(self, model: LlamaForCausalLM | DeepseekV4ForCausalLM, tokenizer: Tokenizer, *,
                 config: EngineConfig | None = None, device: torch.device | None = None,
                 name: str = "model") -> None:
        self._config = config = config or EngineConfig()
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.quantization: str | None = None  # "int4"/"int8" when the linears are packed
        param = model.model.norm.weight  # (a GGUF model's embedding is blocks, not floats)
        self.device = device = device or param.device
        self.dtype = param.dtype
        cuda, tuning = device.type == "cuda", config.tuning
        self.runner, kv_groups, self.prefix_caching, mtp = build_runner(
            model, tokenizer, config, device=device, dtype=self.dtype)
        self.max_model_len = max_len(config, model.config, full_blocks(kv_groups))
        self.block_manager = block_manager_for(kv_groups, config,
                                               prefix_caching=self.prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens)
        self.sampler = Sampler(model.config.vocab_size, tokenizer.vocab_size, batch_fill=cuda,
                               tuning=tuning, invariant=config.batch_invariant_on(device.type))
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids)
        # (on CUDA ended requests' constraints are dropped while the host waits)
        self.output = OutputProcessor(tokenizer, self.scheduler, self.runner, self.block_manager,
                                      self.eos_token_ids,
                                      max_rollbacks=config.max_constraint_rollbacks,
                                      keep_graves=cuda, graves_kept=tuning.graves_kept)
        self.chores = HostChores(self.block_manager, tuning, self.output.graves)
        self.speculative = SpeculativeDecoder(
            config.spec, tokenizer, self.sampler, self.block_manager, self.output,
            dtype=self.dtype, max_batched_tokens=config.max_num_batched_tokens, tuning=tuning,
            mtp=mtp)
        self.intake = RequestIntake(self.scheduler, self.output, vocab_size=model.config.vocab_size,
                                    max_model_len=self.max_model_len, device=device,
                                    eos_token_ids=self.eos_token_ids, jump_forward=cuda)
        self.masks = MaskThread(self.sampler)  # fills masks during the forward
        asynchronous = config.async_scheduling
        if asynchronous is None:
            asynchronous = cuda
        self.pipeline: Pipeline | None = None
        # (the pipeline keeps one block table a sequence: not for sliding-window models)
        if asynchronous and isinstance(self.runner, ModelRunner) and not self.runner.grouped:
            self.pipeline = Pipeline(config, self.scheduler, self.block_manager, self.runner,
                                     self.sampler, self.output, self.chores, self.speculative,
                                     self.masks, tokenizer, device=device,
                                     eos_token_ids=self.eos_token_ids)
        self.stats = self.pipeline.stats if self.pipeline is not None else PipelineStats()
        self.config = config  # (what the parts read as they run: see there)
        self._aborted: list[Sequence] = []  # outputs owed to the next step (aborts, drains)
        settle_process(config, device)  # (torch's threads, the collector's heap)

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
        quantization : {"auto", "gguf", "int4", "int8"} | None
            CPU only. "gguf": a Llama GGUF's weights kept in the file's own blocks
            (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K), each layer's step one native call
            (int8 activation codes; needs the C++ extension). "int4"/"int8": linear
            weights in 4 bits (groups of 32) or 8 bits (per channel) run with
            bfloat16 activations, the head in bfloat16; logits move slightly. "int4"
            on a GGUF stored Q4_0/Q4_1 takes the file's blocks (codes exact; scales
            in bfloat16); other weights are quantized from float (min/max per group).
            "auto" (the default), on the CPU: "gguf" for a plain Llama GGUF in those
            blocks when the native kernels build (not under ``FORMCAST_NATIVE=0``),
            else "int4" for a Q4_0/Q4_1 GGUF, "int8" for a GGUF in other quantized
            blocks (dequantized, then quantized per channel), None otherwise. None:
            float weights in ``dtype``.
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
        if parallel is not None and parallel.dp > 1:
            from formcast.engine.parallel import ParallelEngine

            return ParallelEngine.launch(name_or_path, parallel, device=str(device), dtype=dtype,
                                         quantization=quantization, **config)
        try:
            engine_config = EngineConfig(**config)
        except TypeError as exc:
            raise TypeError(f"unknown engine option: {exc}") from exc
        model, tokenizer, dev, name, quantization = load(name_or_path, device=device, dtype=dtype,
                                                         quantization=quantization)
        engine = cls(model, tokenizer, config=engine_config, device=dev, name=name)
        engine.quantization = quantization
        return engine

    @property
    def config(self) -> EngineConfig:
        """The engine's config. Another set here changes what the engine reads as
        it runs (jump_forward, unmasked_greedy, native_accept, spec,
        max_constraint_rollbacks, overlap_masks, pause_gc); what it was built with
        (the cache, batch bounds, graphs, asynchronous steps, tuning) stays."""
        return self._config

    @config.setter
    def config(self, config: EngineConfig) -> None:
        self._config = config
        jump = config.jump_forward
        self.intake.jump_forward = jump if jump is not None else self.device.type == "cuda"
        self.output.max_rollbacks = config.max_constraint_rollbacks
        self.speculative.spec = config.spec
        if self.pipeline is not None:
            self.pipeline.configure(config)

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
        seq = self.intake.make(prompt, params, constraint, request_id)
        self._queue(seq)
        return seq.request_id

    def _queue(self, seq: Sequence) -> None:
        if not self.intake.queue(seq):  # (its constraint failed: the output comes next step)
            self._aborted.append(seq)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request; its output (finish_reason "abort") comes with the next step.
        Returns False if no such request is in flight."""
        seq = self.output.requests.get(request_id)
        if seq is None or seq.is_finished:
            return False
        self.output.finish(seq, "abort")
        self._aborted.append(seq)
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every cached prompt prefix not in use (e.g. between the arms of a
        benchmark, so none is timed on another's prefill); returns the blocks freed
        of their content. Requests in flight keep theirs."""
        return self.block_manager.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    # -- the loop -----------------------------------------------------------------
    def step(self, *, finished_only: bool = False) -> list[RequestOutput]:
        """Run one scheduling + model + sampling iteration.

        Returns the outputs of requests that got a token or finished in this step;
        with ``finished_only``, of those that finished (a caller that waits for
        whole results saves building an output for every running request at
        every step).
        """
        finishes, aborted = self.output.num_finishes, bool(self._aborted)
        seqs = self._step()
        if finished_only:
            if finishes == self.output.num_finishes and not aborted:
                return []  # (nothing ended: no row to look at)
            return [seq.to_output() for seq in seqs if seq.status is FINISHED]
        return [seq.to_output() for seq in seqs]

    def _step(self) -> list[Sequence]:
        """:meth:`step`, returning the sequences (their outputs are built on demand)."""
        outputs, self._aborted = self._aborted, []
        pipeline = self.pipeline
        taken = pipeline.step() if pipeline is not None else None
        if taken is not None:  # (launched the next step, then took the last one's tokens)
            outputs += taken
        else:
            if pipeline is not None:
                outputs += pipeline.drain()  # (every request back in an ordinary state)
            outputs += self._ordinary_step()
        if not self.scheduler.has_unfinished():
            self._let_go()
        return outputs

    def _ordinary_step(self) -> list[Sequence]:
        """Schedule, run the model over every scheduled token (prompt chunks,
        drafts), sample: the step of everything the pipeline does not take."""
        self.speculative.propose(self.scheduler.running)
        plan = self.scheduler.schedule()
        for seq in plan.preempted:
            self.runner.release(seq)  # recomputed from scratch when readmitted
        if not plan.scheduled:
            return []
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
        # a batch's first step, every running request sampling: its tokens may go in
        # flight like a pipelined step's (the next step launches on them first)
        first = self.pipeline.opening(plan, plain) if self.pipeline is not None else None
        # the masks of plain rows depend only on tokens already accepted: filled
        # while the model runs
        drawn = plain if first is None else [plain[j] for j in first[1]]
        masks = None
        if self.config.overlap_masks and any(s.constraint is not None for s in drawn):
            masks = self.masks.submit(drawn)
            if first is not None:
                self.pipeline.rows.masks_ahead = drawn, masks  # (for its sampling's masks)
        started = time.perf_counter()
        try:
            logits = self.runner.execute(plan.scheduled)
        except Exception as exc:
            if masks is not None:
                if self.pipeline is not None:
                    self.pipeline.rows.masks_ahead = None
                masks.result()  # the worker is done with the constraints before we go
            raise EngineError(f"model forward failed: {type(exc).__name__}: {exc}") from exc
        self.scheduler.on_step_done(plan)
        prepare_constraints(plan.scheduled)
        if first is not None:
            if self.pipeline.launch_opening(logits, plain, first):
                return []  # (no step cost observed: the host has not waited for the device)
            masks = self.pipeline.rows.masks_ahead = None  # (a mask failed: the ordinary way)
        if plain:
            rows = logits if len(plain_rows) == len(logits) else logits[plain_rows]
            self._sample(rows, plain, None if masks is None else masks.result())
        for item, start in zip(sampled, starts):
            if item.num_draft:
                self.speculative.verify(item.seq, logits[start:start + 1 + item.num_draft])
        self.speculative.step_cost.observe(plan.num_tokens, time.perf_counter() - started)
        return [item.seq for item in sampled]

    def _sample(self, rows: torch.Tensor, plain: list[Sequence], masks: FilledMasks | None
                ) -> None:
        """Sample ``plain`` from ``rows`` (under ``masks``) and settle each."""
        # greedy constrained rows about to enter the pipeline: whether their masked
        # pick is the model's own argmax says whether they start there unmasked
        watch = [j for j, s in enumerate(plain) if s.constraint is not None
                 and s.params.greedy and not s.banned_tokens] \
            if self.pipeline is not None and self.config.unmasked_greedy else []
        argmax = None
        if watch:  # (before the sampler masks the rows in place)
            argmax = self.sampler.greedy_unmasked(
                rows if len(watch) == len(plain)
                else rows[to_device(watch, torch.long, rows.device)])[0]
        result = self.sampler(rows, plain, masks=masks)
        self.output.settle_all(plain, result)
        if watch:
            for j, unmasked in zip(watch, argmax.tolist()):
                if j not in result.errors:
                    plain[j].masked_pick_seen(result.token_ids[j] == unmasked)

    def _let_go(self) -> None:
        """No request is left: the parts' caches of the rows let go of them (and
        of the finished requests), rather than the next batch's first steps."""
        self.chores.forget()
        if self.pipeline is not None:
            self.pipeline.let_go()
        self.block_manager.forget_rows()
        self.runner.forget_rows()

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
                seqs.append(self.intake.make(p, sp, c, None))
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
                finishes, aborted = self.output.num_finishes, bool(self._aborted)
                seqs_out = self._step()
                if finishes != self.output.num_finishes or aborted:  # (else none ended: no scan)
                    for seq in seqs_out:
                        if seq.status is FINISHED:
                            pending.discard(seq.request_id)
                if pending and not self.scheduler.has_unfinished():
                    raise EngineError(f"requests {sorted(pending)} were lost by the scheduler")
            return [s.to_output() for s in seqs]
        finally:
            if self.pipeline is not None:
                self.pipeline.accept.quick_switches(False)
            if paused:
                gc.enable()

    def continuation_logprobs(self, prefixes: SequenceABC[SequenceABC[int]],
                              continuations: SequenceABC[SequenceABC[SequenceABC[int]]]
                              ) -> list[list[list[float]]]:
        """Per prefix, per continuation of it, the log-probability of each of its tokens
        after the prefix (and the continuation's tokens before it), as generated
        tokens are run (:func:`formcast.engine.scoring.continuation_logprobs`: each
        prefix computed once from the prefix cache, each continuation's own tokens
        on a fork of its KV; outside the scheduler, nothing cached from them)."""
        if self.pipeline is not None:  # the step in flight is taken; its outputs go out next
            self._aborted += self.pipeline.drain()
        return continuation_logprobs(self, prefixes, continuations)

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
        if self.pipeline is not None:  # the step in flight is taken; its outputs go out next
            self._aborted += self.pipeline.drain()
        seq = self.intake.make(list(token_ids), SamplingParams(max_tokens=1), None,
                               self.intake.next_id("forward-logits"))
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

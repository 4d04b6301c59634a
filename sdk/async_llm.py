"""``formcast.AsyncLLM``: the model API for asyncio applications.

Every coroutine's request joins one running engine batch (an
:class:`formcast.engine_loop.EngineLoop` owns the engine on a background thread),
so ``asyncio.gather`` over many calls batches them the way
:meth:`formcast.LLM.generate_batch` does. Prompts, constraints and results are
the :class:`formcast.LLM`'s own: same arguments, same :class:`Completion`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from formcast.completion import Completion
from formcast.engine import RequestOutput, SamplingParams
from formcast.engine_loop import EngineLoop
from formcast.errors import ConstraintError, FormcastError
from formcast.llm import LLM, _pop_spec, _sampling, load
from formcast.partial_json import parse_partial
from formcast.spec import OutputSpec


class AsyncLLM:
    """Asynchronous generation, extraction and streaming on one model.

    Parameters
    ----------
    llm : formcast.LLM
        The model; its engine is driven by this object's loop from now on
        (synchronous calls on ``llm`` wait while asynchronous ones run).
    max_pending : int
        Most requests in flight at once; more raise :class:`formcast.QueueFullError`.

    Examples
    --------
    >>> async with formcast.AsyncLLM.load("smollm2") as llm:      # doctest: +SKIP
    ...     people = await asyncio.gather(*(llm.aextract(t, Person) for t in texts))
    """

    def __init__(self, llm: LLM, *, max_pending: int = 256) -> None:
        self.llm = llm
        self.loop = EngineLoop(llm, max_pending=max_pending).start()

    @classmethod
    def load(cls, model: str = "smollm2", *, max_pending: int = 256,
             **options: Any) -> "AsyncLLM":
        """Load a model (same options as :func:`formcast.load`) and start its loop."""
        return cls(load(model, **options), max_pending=max_pending)

    def __enter__(self) -> "AsyncLLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> "AsyncLLM":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def close(self) -> None:
        """Stop the loop (requests in flight fail with EngineError); the LLM stays usable."""
        self.loop.close()

    async def aclose(self) -> None:
        """:meth:`close`, without blocking the event loop."""
        await asyncio.to_thread(self.loop.close)

    # -- the building blocks the server uses too ----------------------------------------
    async def compile(self, spec: OutputSpec) -> Any:
        """The compiled grammar of ``spec`` (None for free text), compiled off the event
        loop (the grammar layer caches it, so repeats are immediate).

        Raises
        ------
        ConstraintError
            The constraint is invalid or unsatisfiable.
        """
        if spec.constraint is None:
            return None
        return await asyncio.to_thread(spec.compile, self.llm.tokenizer,
                                       vocab_size=self.llm.engine.model.config.vocab_size)

    async def outputs(self, prompt_ids: Sequence[int], params: SamplingParams, *,
                      compiled: Any = None, stream: bool = False, matcher: Any = None
                      ) -> AsyncIterator[RequestOutput]:
        """Run one request in the shared batch; yield its outputs (every change when
        ``stream``, else only the final one). Leaving the iteration early aborts
        the request.

        Under a constraint checked only when a value ends (``compiled.end_check``)
        the engine may roll text back, so such a request yields its final output only.

        Raises
        ------
        QueueFullError
            Too many requests in flight.
        RequestError
            The engine refused the request (e.g. the prompt is longer than the context).
        """
        hold = compiled is not None and compiled.end_check is not None
        if matcher is None and compiled is not None:
            matcher = compiled.matcher()
        ticket = self.loop.submit(prompt_ids, params, constraint=matcher,
                                  stream=stream and not hold)
        try:
            async for out in ticket.outputs():
                yield out
        finally:
            self.loop.abort(ticket)  # (no-op once it finished)

    async def final(self, prompt_ids: Sequence[int], params: SamplingParams, *,
                    compiled: Any = None, matcher: Any = None) -> RequestOutput:
        """The final output of one request (see :meth:`outputs`)."""
        async for out in self.outputs(prompt_ids, params, compiled=compiled, matcher=matcher):
            return out
        raise FormcastError("the engine loop ended the request without an output")

    def finish(self, out: RequestOutput, spec: OutputSpec) -> Completion | FormcastError:
        """A final output as :meth:`formcast.LLM.generate` returns it (value parsed and
        validated), or the error it ended in."""
        return self.llm._finish(out, spec)

    # -- the LLM's calls, awaited ---------------------------------------------------------
    async def agenerate(self, prompt: str | list[dict[str, str]], **kwargs: Any) -> Completion:
        """:meth:`formcast.LLM.generate`, awaited; same parameters and errors."""
        spec, ids, params = self._request(prompt, kwargs)
        compiled = await self.compile(spec)
        result = self.finish(await self.final(ids, params, compiled=compiled), spec)
        if isinstance(result, FormcastError):
            raise result
        return result

    async def aextract(self, text: str, schema: Any, *, instructions: str | None = None,
                       grounding: str = "auto", max_tokens: int | None = None,
                       seed: int | None = None, temperature: float = 0.0,
                       return_completions: bool = False) -> Any:
        """:meth:`formcast.LLM.extract`, awaited; same parameters, result and errors, but
        grounded numbers as decoded (not re-chosen whole, which waits for an idle engine)."""
        from formcast.extraction import Extraction

        job = Extraction(schema, [text], grounding=grounding, instructions=instructions)
        ids = job.ids(self.llm.tokenizer)[0]
        if isinstance(ids, FormcastError):
            raise ids
        params = _sampling(1, max_tokens=max_tokens or 512, temperature=temperature,
                           seed=seed, logprobs=0 if return_completions else None)[0]
        compiled = await self.compile(job.spec)
        out = await self.final(ids, params, compiled=compiled,
                               matcher=job.matcher(0, compiled))
        result = job.checked(0, self.finish(out, job.spec))
        if isinstance(result, FormcastError):
            raise result
        return result if return_completions else result.value

    async def astream_text(self, prompt: str | list[dict[str, str]],
                           **kwargs: Any) -> AsyncIterator[str]:
        """:meth:`formcast.LLM.stream_text`, asynchronously: text deltas as generated."""
        spec, ids, params = self._request(prompt, kwargs)
        compiled = await self.compile(spec)
        shown = 0
        async for out in self.outputs(ids, params, compiled=compiled, stream=True):
            if len(out.text) > shown:
                yield out.text[shown:]
                shown = len(out.text)

    async def astream(self, prompt: str | list[dict[str, str]], *, output_type: Any = None,
                      json_schema: dict | str | None = None, **kwargs: Any
                      ) -> AsyncIterator[Any]:
        """:meth:`formcast.LLM.stream`, asynchronously: partial values of a JSON output
        as it grows, then the validated value.

        Raises
        ------
        ConstraintError
            Neither ``output_type`` nor ``json_schema`` given, or the constraint is invalid.
        IncompleteOutputError
            ``max_tokens`` ran out before the value was complete.
        """
        if output_type is None and json_schema is None:
            raise ConstraintError("astream() needs output_type= or json_schema=; "
                                  "use astream_text() for free text")
        kwargs.update(output_type=output_type, json_schema=json_schema)
        spec, ids, params = self._request(prompt, kwargs)
        compiled = await self.compile(spec)
        last = None
        async for out in self.outputs(ids, params, compiled=compiled, stream=True):
            if out.finished:
                result = self.finish(out, spec)
                if isinstance(result, FormcastError):
                    raise result
                yield result.value
                return
            partial = parse_partial(out.text)
            if partial is not None and partial != last:
                last = partial
                yield partial

    def _request(self, prompt: str | list[dict[str, str]], kwargs: dict[str, Any]
                 ) -> tuple[OutputSpec, list[int], SamplingParams]:
        """(spec, prompt ids, sampling) of a call with :meth:`LLM.generate`'s keywords."""
        spec = _pop_spec(kwargs)
        system, raw = kwargs.pop("system", None), kwargs.pop("raw", False)
        params = _sampling(1, **{"max_tokens": 256, "temperature": 0.0, **kwargs})[0]
        return spec, self.llm.prompt_ids(prompt, system=system, raw=raw), params

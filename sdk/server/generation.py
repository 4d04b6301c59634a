"""Chat and text completions: from a request body to engine requests and back.

Each choice of a request is one engine request in the shared batch. A whole
answer waits for every choice while watching the connection (a client that
goes away aborts its requests); a streamed one sends each choice's new text as
it comes, as server-sent events.

JSON output (a schema, ``json_object`` or a tool call) is kept from running on to
``max_tokens`` unless the request sends ``stop_loops: false``: a list ends at its
first item equal to an earlier one, and a string that repeats one unit again and
again closes (the grammar layer's ``distinct_items`` and ``stop_loops``). Either
output still validates under the request's schema.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.requests import Request

from formcast.async_llm import AsyncLLM
from formcast.engine import RequestOutput, SamplingParams
from formcast.errors import FormcastError, QueueFullError
from formcast.server import responses as r
from formcast.server.constraints import ToolPlan, request_spec
from formcast.server.errors import ApiError, aborted_error, api_error
from formcast.server.protocol import ChatCompletionRequest, CompletionRequest, ChatMessage
from formcast.spec import OutputSpec

T = TypeVar("T")
_END = object()


class ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


@dataclass(frozen=True, kw_only=True)
class Job:
    """One request's engine work: a prompt per choice, their sampling, the constraint."""

    prompts: list[list[int]]      # one per choice
    params: list[SamplingParams]  # one per choice
    spec: OutputSpec
    compiled: Any
    plan: ToolPlan | None
    stop_loops: bool = False
    echoes: list[str] | None = None  # per choice, the prompt text put before it (``echo``)

    def matcher(self) -> Any:
        """A fresh matcher for one choice (None for free text)."""
        if self.compiled is None:
            return None
        if not (self.stop_loops and self.spec.kind == "json"):
            return self.compiled.matcher()
        from formcast.grammars import grounding_plan

        return self.compiled.grounded_matcher("", grounding_plan(self.spec.json_schema, "off"),
                                              distinct_items=True, stop_loops=True)


async def chat_job(llm: AsyncLLM, req: ChatCompletionRequest) -> Job:
    """The engine work of a chat request (raises ApiError/FormcastError when invalid)."""
    spec, plan = request_spec(req)
    compiled = await llm.compile(spec)
    messages = [_message(m) for m in req.messages]
    if plan is not None:  # (tell the model what it is writing: it sees only the mask)
        messages.insert(0, {"role": "system", "content": plan.instructions()})
    ids = llm.llm.prompt_ids(messages)
    _check_length(llm, ids, "messages")
    max_tokens = req.max_completion_tokens or req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = _sampling(req, len(ids), llm, max_tokens, logprobs)
    return Job(prompts=[ids] * req.n, params=params, spec=spec, compiled=compiled, plan=plan,
               stop_loops=req.stop_loops)


async def completion_job(llm: AsyncLLM, req: CompletionRequest) -> Job:
    """The engine work of a text completion: n choices for each prompt."""
    spec, _ = request_spec(req)
    compiled = await llm.compile(spec)
    prompt = req.prompt
    if isinstance(prompt, str):
        prompts = [llm.llm.prompt_ids(prompt, raw=True)]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    else:
        prompts = [llm.llm.prompt_ids(p, raw=True) if isinstance(p, str) else list(p)
                   for p in prompt]
    if not prompts:
        raise ApiError(400, "prompt is empty", param="prompt")
    if req.echo and req.logprobs is not None:
        raise ApiError(400, "echo with logprobs would need the prompt's log-probs, which this "
                       "server does not compute; drop one of them", param="echo")
    ids_all, params_all, echoes = [], [], []
    texts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    for ids, given in zip(prompts, texts if len(texts) == len(prompts) else [None] * len(prompts)):
        _check_length(llm, ids, "prompt")
        logprobs = req.logprobs
        ids_all += [ids] * req.n
        params_all += _sampling(req, len(ids), llm, req.max_tokens or 16, logprobs)
        if req.echo:  # (the prompt as given; token ids as their text)
            echo = given if isinstance(given, str) else llm.llm.tokenizer.decode(ids)
            echoes += [echo] * req.n
    return Job(prompts=ids_all, params=params_all, spec=spec, compiled=compiled, plan=None,
               stop_loops=req.stop_loops, echoes=echoes if req.echo else None)


def _message(m: ChatMessage) -> dict[str, str]:
    content = m.content
    if isinstance(content, list):
        content = "".join(part.text or "" for part in content if part.type == "text")
    if m.tool_calls and not content:  # (a past call, shown to the model as its JSON)
        content = json.dumps([c.get("function", c) for c in m.tool_calls])
    return {"role": m.role, "content": content or ""}


def _check_length(llm: AsyncLLM, ids: Sequence[int], param: str) -> None:
    limit = llm.llm.engine.max_model_len
    if len(ids) >= limit:
        raise ApiError(400, f"the prompt has {len(ids)} tokens but the context holds {limit} "
                       "(prompt + output); shorten the prompt", param=param,
                       code="context_length_exceeded")


def _sampling(req: Any, prompt_len: int, llm: AsyncLLM, max_tokens: int | None,
              logprobs: int | None) -> list[SamplingParams]:
    if max_tokens is None:  # (the rest of the context, as vLLM does)
        max_tokens = llm.llm.engine.max_model_len - prompt_len
    stop = req.stop if req.stop is not None else ()
    return [SamplingParams(max_tokens=max_tokens,
                           temperature=1.0 if req.temperature is None else req.temperature,
                           top_p=1.0 if req.top_p is None else req.top_p,
                           seed=None if req.seed is None else req.seed + i, stop=stop,
                           logprobs=logprobs) for i in range(req.n)]


# -- whole answers ----------------------------------------------------------------------
async def finals(llm: AsyncLLM, job: Job, request: Request) -> list[RequestOutput]:
    """Every choice's final output, checked (raises ApiError; ClientGone on disconnect)."""
    outs = await until_disconnect(request, _all_or_none(
        [llm.final(ids, p, compiled=job.compiled, matcher=job.matcher())
         for ids, p in zip(job.prompts, job.params)]))
    for out in outs:
        check(llm, out, job.spec)
    return outs


def check(llm: AsyncLLM, out: RequestOutput, spec: OutputSpec) -> None:
    """Raise the ApiError of a failed output; validate a complete constrained one."""
    if out.finish_reason == "abort":
        raise aborted_error(out.error)
    if spec.parses and out.finish_reason != "length":
        result = llm.finish(out, spec)
        if isinstance(result, FormcastError):
            raise api_error(result)


async def _all_or_none(coros: list[Awaitable[T]]) -> list[T]:
    """Every result, or the first failure with the others cancelled (their requests
    aborted) rather than left running for nobody."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def check_capacity(llm: AsyncLLM, job: Job) -> None:
    """Raise QueueFullError now if the job's requests would not fit (a stream's status
    is sent before its requests are submitted)."""
    loop = llm.loop
    if loop.num_in_flight + len(job.prompts) > loop.max_pending:
        raise QueueFullError(f"{loop.num_in_flight} requests are in flight (the limit is "
                             f"{loop.max_pending}); retry later")


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first (then cancel it: ClientGone)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone()
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        continue


# -- streams ------------------------------------------------------------------------------
async def merged(llm: AsyncLLM, job: Job) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) of every choice's stream, as they come."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, ids: list[int], params: SamplingParams) -> None:
        try:
            async for out in llm.outputs(ids, params, compiled=job.compiled, stream=True,
                                         matcher=job.matcher()):
                queue.put_nowait((i, out))
        except Exception as exc:
            queue.put_nowait((i, exc))
        finally:
            queue.put_nowait((i, _END))

    tasks = [asyncio.create_task(pump(i, ids, p))
             for i, (ids, p) in enumerate(zip(job.prompts, job.params))]
    try:
        ended = 0
        while ended < len(tasks):
            i, item = await queue.get()
            if item is _END:
                ended += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:  # (a client gone, or an error: the other choices stop too)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def chat_stream(llm: AsyncLLM, job: Job, *, rid: str, model: str, logprobs: bool,
                      include_usage: bool) -> AsyncIterator[str]:
    """The SSE events of a streamed chat completion."""
    n, tok, plan = len(job.prompts), llm.llm.tokenizer, job.plan
    shown, counted, finals_ = [0] * n, [0] * n, [None] * n
    call_ids = [r.new_id("call") for _ in range(n)]
    yield r.chat_chunk(rid, model, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}
                                    for i in range(n)])
    try:
        async for i, out in merged(llm, job):
            if out.finished:
                check(llm, out, job.spec)
            delta: dict[str, Any] = {}
            text = out.text[shown[i]:]
            if plan is None or out.finish_reason == "length":
                if text:
                    delta["content"] = text
            elif plan.wrapped:  # (the function's name comes last: the call is sent whole)
                if out.finished:
                    name, answer = plan.read(out.text)
                    if name is None:  # ("auto": an answer in words)
                        delta["content"] = answer
                    else:
                        delta["tool_calls"] = [{"index": 0, **c}
                                               for c in r.tool_calls(plan, out.text)]
            elif text:  # (the arguments stream as they are written)
                call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
                if shown[i] == 0:
                    call.update(id=call_ids[i], type="function")
                    call["function"]["name"] = plan.tools[0].function.name
                delta["tool_calls"] = [call]
            if plan is None or not plan.wrapped:
                shown[i] = max(shown[i], len(out.text))
            lp = None
            if logprobs and out.logprobs and len(out.logprobs) > counted[i]:
                lp = r.chat_logprobs(tok, out.logprobs[counted[i]:])
                counted[i] = len(out.logprobs)
            reason = r.finish_reason(out, plan) if out.finished else None
            if out.finished:
                finals_[i] = out
            if delta or reason or lp:
                yield r.chat_chunk(rid, model, [{"index": i, "delta": delta, "logprobs": lp,
                                                 "finish_reason": reason}])
        if include_usage:
            yield r.chat_chunk(rid, model, [], r.usage([o for o in finals_ if o is not None]))
    except (ApiError, FormcastError) as exc:
        yield r.sse(api_error(exc).body())
    yield r.DONE


async def completion_stream(llm: AsyncLLM, job: Job, *, rid: str, model: str, logprobs: bool,
                            include_usage: bool) -> AsyncIterator[str]:
    """The SSE events of a streamed text completion."""
    n, tok = len(job.prompts), llm.llm.tokenizer
    shown, counted, finals_ = [0] * n, [0] * n, [None] * n
    for i, echo in enumerate(job.echoes or ()):
        yield r.completion_chunk(rid, model, [{"index": i, "text": echo, "logprobs": None,
                                               "finish_reason": None}])
    try:
        async for i, out in merged(llm, job):
            if out.finished:
                check(llm, out, job.spec)
                finals_[i] = out
            text = out.text[shown[i]:] if len(out.text) > shown[i] else ""
            lp = None
            if logprobs and out.logprobs and len(out.logprobs) > counted[i]:
                lp = r.completion_logprobs(tok, out.logprobs[counted[i]:], shown[i])
                counted[i] = len(out.logprobs)
            shown[i] = max(shown[i], len(out.text))
            reason = r.finish_reason(out, None) if out.finished else None
            if text or reason or lp:
                yield r.completion_chunk(rid, model, [{"index": i, "text": text, "logprobs": lp,
                                                       "finish_reason": reason}])
        if include_usage:
            yield r.completion_chunk(rid, model, [],
                                     r.usage([o for o in finals_ if o is not None]))
    except (ApiError, FormcastError) as exc:
        yield r.sse(api_error(exc).body())
    yield r.DONE

"""OpenAI response bodies (whole and streamed chunks) from the engine's outputs."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from formcast.engine import RequestOutput, TokenLogprob
from formcast.server.constraints import ToolPlan


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(outputs: Sequence[RequestOutput]) -> dict[str, int]:
    """``usage`` over a request's choices (the prompt counted once, as OpenAI does)."""
    prompt = outputs[0].metrics.num_prompt_tokens if outputs else 0
    completion = sum(o.metrics.num_output_tokens for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def finish_reason(out: RequestOutput, plan: ToolPlan | None) -> str:
    if out.finish_reason == "length":
        return "length"
    if plan is None or (plan.optional and plan.read(out.text)[0] is None):
        return "stop"
    return "tool_calls"


def tool_calls(plan: ToolPlan, text: str) -> list[dict[str, Any]]:
    """The ``tool_calls`` of a finished call (none when the model answered in words)."""
    name, arguments = plan.read(text)
    if name is None:
        return []
    return [{"id": new_id("call"), "type": "function",
             "function": {"name": name, "arguments": arguments}}]


# -- log-probs --------------------------------------------------------------------------
def _token(tokenizer: Any, token_id: int) -> tuple[str, list[int]]:
    text = tokenizer.decode([token_id])
    return text, list(text.encode("utf-8"))


def chat_logprobs(tokenizer: Any, items: Sequence[TokenLogprob]) -> dict[str, Any]:
    """``choices[i].logprobs`` of a chat completion."""
    content = []
    for item in items:
        text, raw = _token(tokenizer, item.token_id)
        top = []
        for tid, lp in item.top:
            t, b = _token(tokenizer, tid)
            top.append({"token": t, "logprob": lp, "bytes": b})
        content.append({"token": text, "logprob": item.logprob, "bytes": raw,
                        "top_logprobs": top})
    return {"content": content}


def completion_logprobs(tokenizer: Any, items: Sequence[TokenLogprob],
                        offset: int = 0) -> dict[str, Any]:
    """``choices[i].logprobs`` of a text completion (``offset``: text before these)."""
    tokens, lps, tops, offsets = [], [], [], []
    for item in items:
        text, _ = _token(tokenizer, item.token_id)
        tokens.append(text)
        lps.append(item.logprob)
        tops.append({_token(tokenizer, tid)[0]: lp for tid, lp in item.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
            "text_offset": offsets}


# -- chat ---------------------------------------------------------------------------------
def chat_message(out: RequestOutput, plan: ToolPlan | None) -> dict[str, Any]:
    if plan is not None and out.finish_reason != "length":
        name, answer = plan.read(out.text)
        if name is None:  # ("auto": the model answered in words)
            return {"role": "assistant", "content": answer}
        return {"role": "assistant", "content": None, "tool_calls": tool_calls(plan, out.text)}
    return {"role": "assistant", "content": out.text}


def chat_completion(rid: str, model: str, outputs: Sequence[RequestOutput],
                    plan: ToolPlan | None, tokenizer: Any, logprobs: bool) -> dict[str, Any]:
    choices = [{"index": i, "message": chat_message(out, plan),
                "logprobs": chat_logprobs(tokenizer, out.logprobs or ()) if logprobs else None,
                "finish_reason": finish_reason(out, plan)} for i, out in enumerate(outputs)]
    return {"id": rid, "object": "chat.completion", "created": now(), "model": model,
            "choices": choices, "usage": usage(outputs), "system_fingerprint": None}


def chat_chunk(rid: str, model: str, choices: list[dict[str, Any]],
               usage_body: dict[str, int] | None = None) -> str:
    body: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": now(),
                            "model": model, "choices": choices, "system_fingerprint": None}
    if usage_body is not None:
        body["usage"] = usage_body
    return sse(body)


# -- text completions ---------------------------------------------------------------------
def completion(rid: str, model: str, outputs: Sequence[RequestOutput], tokenizer: Any,
               logprobs: bool, *, echoes: Sequence[str] | None = None) -> dict[str, Any]:
    """A text completion's body (``echoes``: per choice, the prompt put before its text)."""
    echoes = echoes or [""] * len(outputs)
    choices = [{"index": i, "text": echoes[i] + out.text,
                "logprobs": completion_logprobs(tokenizer, out.logprobs or ())
                if logprobs else None,
                "finish_reason": finish_reason(out, None)} for i, out in enumerate(outputs)]
    return {"id": rid, "object": "text_completion", "created": now(), "model": model,
            "choices": choices, "usage": usage(outputs), "system_fingerprint": None}


def completion_chunk(rid: str, model: str, choices: list[dict[str, Any]],
                     usage_body: dict[str, int] | None = None) -> str:
    body: dict[str, Any] = {"id": rid, "object": "text_completion", "created": now(),
                            "model": model, "choices": choices, "system_fingerprint": None}
    if usage_body is not None:
        body["usage"] = usage_body
    return sse(body)


def sse(body: dict[str, Any]) -> str:
    """One server-sent event carrying ``body``."""
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"

"""The FastAPI application: routes, API key, and errors as OpenAI bodies.

``create_app(llm, model_name=...)`` serves one model over an
:class:`formcast.AsyncLLM`: ``POST /v1/chat/completions``, ``POST /v1/completions``,
``GET /v1/models``, ``GET /health`` and ``GET /metrics``. Every failure answers
with an OpenAI-shaped error body (see :mod:`formcast.server.errors`); none stops
the server or the other requests in the batch.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import formcast
from formcast.async_llm import AsyncLLM
from formcast.errors import FormcastError
from formcast.server import generation as g
from formcast.server import metrics, responses
from formcast.server.errors import ApiError, api_error
from formcast.server.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("formcast.server")


@dataclass
class ServerState:
    """What the routes share: the model, the name it is served under, the API key."""

    llm: AsyncLLM
    model_name: str
    api_key: str | None
    created: int = field(default_factory=lambda: int(time.time()))
    http: metrics.HttpCounter = field(default_factory=metrics.HttpCounter)

    def check_model(self, name: str) -> None:
        if name not in (self.model_name, self.llm.llm.engine.name):
            raise ApiError(404, f"model {name!r} does not exist; this server serves "
                           f"{self.model_name!r}", param="model", code="model_not_found")


def create_app(llm: AsyncLLM, *, model_name: str, api_key: str | None = None) -> FastAPI:
    """The OpenAI-compatible application over ``llm``.

    Parameters
    ----------
    llm : formcast.AsyncLLM
        The model and its engine loop (started; the caller closes it).
    model_name : str
        The name clients give as ``model`` (the engine's own name is accepted too).
    api_key : str | None
        When given, ``/v1`` routes need ``Authorization: Bearer <api_key>``.

    Returns
    -------
    fastapi.FastAPI
    """
    state = ServerState(llm=llm, model_name=model_name, api_key=api_key)
    app = FastAPI(title="formcast", version=formcast.__version__)
    app.state.formcast = state
    routes: set[str] = set()  # (filled below, once the routes exist)
    app.add_middleware(_CountResponses, counter=state.http, routes=routes)
    _add_error_handlers(app)

    def authorized(request: Request) -> None:
        if state.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(),
                                                                     state.api_key):
            raise ApiError(401, "invalid API key: send Authorization: Bearer <key>",
                           type="authentication_error", code="invalid_api_key")

    auth = [Depends(authorized)]

    @app.get("/health")
    async def health() -> Response:
        alive = state.llm.loop.running
        return JSONResponse({"status": "ok" if alive else "engine loop stopped"},
                            status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics_page() -> Response:
        return PlainTextResponse(metrics.render(state.llm.loop, state.http),
                                 media_type=metrics.CONTENT_TYPE)

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{name:path}", dependencies=auth)
    async def model(name: str) -> dict[str, Any]:
        state.check_model(name)
        return _model_card(state)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(req: ChatCompletionRequest, request: Request) -> Response:
        state.check_model(req.model)
        job = await g.chat_job(state.llm, req)
        rid = responses.new_id("chatcmpl")
        if req.stream:
            g.check_capacity(state.llm, job)
            usage = req.stream_options is not None and req.stream_options.include_usage
            return _sse(g.chat_stream(state.llm, job, rid=rid, model=req.model,
                                      logprobs=req.logprobs, include_usage=usage))
        outs = await g.finals(state.llm, job, request)
        return JSONResponse(responses.chat_completion(rid, req.model, outs, job.plan,
                                                      state.llm.llm.tokenizer, req.logprobs))

    @app.post("/v1/completions", dependencies=auth)
    async def completions(req: CompletionRequest, request: Request) -> Response:
        state.check_model(req.model)
        job = await g.completion_job(state.llm, req)
        rid = responses.new_id("cmpl")
        logprobs = req.logprobs is not None
        if req.stream:
            g.check_capacity(state.llm, job)
            usage = req.stream_options is not None and req.stream_options.include_usage
            return _sse(g.completion_stream(state.llm, job, rid=rid, model=req.model,
                                            logprobs=logprobs, include_usage=usage))
        outs = await g.finals(state.llm, job, request)
        return JSONResponse(responses.completion(rid, req.model, outs,
                                                 state.llm.llm.tokenizer, logprobs,
                                                 echoes=job.echoes))

    routes.update(route.path for route in app.routes)
    return app


def _model_card(state: ServerState) -> dict[str, Any]:
    engine = state.llm.llm.engine
    return {"id": state.model_name, "object": "model", "created": state.created,
            "owned_by": "formcast", "max_model_len": engine.max_model_len}


def _sse(events: Any) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def _add_error_handlers(app: FastAPI) -> None:
    def answer(err: ApiError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return answer(ApiError(400, "the body is not valid JSON: " + errors[0].get(
                "msg", ""), code="invalid_json"))
        problems = []
        for e in errors[:5]:
            where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
            problems.append(f"{where or 'body'}: {e.get('msg', 'invalid')}")
        # (the first offending field: loc is ("body", field, ...))
        param = next((e["loc"][1] for e in errors if len(e.get("loc", ())) > 1
                      and isinstance(e["loc"][1], str)), None)
        return answer(ApiError(400, "invalid request: " + "; ".join(problems), param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return answer(ApiError(exc.status_code, str(exc.detail), type=kind))

    @app.exception_handler(g.ClientGone)
    async def client_gone(request: Request, exc: g.ClientGone) -> Response:
        return Response(status_code=499)  # (nobody reads it: nginx's "client closed")

    @app.exception_handler(ApiError)
    @app.exception_handler(FormcastError)
    @app.exception_handler(ValueError)
    @app.exception_handler(Exception)
    async def any_error(request: Request, exc: Exception) -> JSONResponse:
        err = api_error(exc)
        if err.status >= 500:
            log.error("request failed: %s", err.message, exc_info=exc)
        return answer(err)


class _CountResponses:
    """ASGI middleware counting responses by route and status for ``/metrics``."""

    def __init__(self, app: ASGIApp, *, counter: metrics.HttpCounter, routes: set[str]) -> None:
        self.app, self.counter, self.routes = app, counter, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"] if scope["path"] in self.routes else "other"

        async def counting(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.counter.add(path, message["status"])
            await send(message)

        await self.app(scope, receive, counting)

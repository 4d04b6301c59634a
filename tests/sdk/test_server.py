"""The OpenAI-compatible server, driven by the official ``openai`` client (sync and
async) against a real server on a free local port, on the embedded SmolLM2.

Every constrained output is checked with a validator independent of the mask
(jsonschema, re.fullmatch, membership); every error answers with an OpenAI body.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import jsonschema
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

import formcast  # noqa: E402
from formcast.server import BackgroundServer  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "smollm2"
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def allm(llm):
    async_llm = formcast.AsyncLLM(llm)
    yield async_llm
    async_llm.loop.close()


@pytest.fixture(scope="module")
def server(allm):
    with BackgroundServer(allm, model_name=MODEL) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def _chat(client, content: str, **kwargs):
    kwargs = {"max_tokens": 48, "temperature": 0, **kwargs}
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], **kwargs)


def _metrics(server) -> dict[str, float]:
    text = httpx.get(server.url.removesuffix("/v1") + "/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


# -- constraint kinds: one independent validator each --------------------------------------
def _json_valid(schema):
    return lambda text: jsonschema.validate(json.loads(text), schema) is None


CASES = [
    ("response_format json_schema",
     dict(response_format={"type": "json_schema",
                           "json_schema": {"name": "person", "schema": PERSON, "strict": True}}),
     _json_valid(PERSON)),
    ("response_format json_object", dict(response_format={"type": "json_object"}),
     lambda text: isinstance(json.loads(text), dict)),
    ("structured_outputs json", dict(extra_body={"structured_outputs": {"json": PERSON}}),
     _json_valid(PERSON)),
    ("structured_outputs regex",
     dict(extra_body={"structured_outputs": {"regex": r"[A-Z][a-z]{2,8} \d{1,2}"}}),
     lambda text: re.fullmatch(r"[A-Z][a-z]{2,8} \d{1,2}", text) is not None),
    ("structured_outputs choice",
     dict(extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}}),
     lambda text: text in ("red", "green", "blue")),
    ("structured_outputs grammar (EBNF)",
     dict(extra_body={"structured_outputs": {"grammar": 'root ::= ("yes" | "no") "," [0-9]'}}),
     lambda text: re.fullmatch(r"(yes|no),[0-9]", text) is not None),
    ("guided_json", dict(extra_body={"guided_json": json.dumps(PERSON)}), _json_valid(PERSON)),
    ("guided_regex", dict(extra_body={"guided_regex": r"\d{3}-\d{4}"}),
     lambda text: re.fullmatch(r"\d{3}-\d{4}", text) is not None),
    ("guided_choice", dict(extra_body={"guided_choice": ["cat", "dog"]}),
     lambda text: text in ("cat", "dog")),
    ("guided_grammar (Lark)",
     dict(extra_body={"guided_grammar": 'start: "x" NUM\nNUM: /[0-9]{2}/'}),
     lambda text: re.fullmatch(r"x[0-9]{2}", text) is not None),
]


@pytest.mark.parametrize("kwargs,valid", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_each_constraint_kind_validates_independently(client, kwargs, valid):
    out = _chat(client, 'Answer in JSON like {"name": "Ann", "age": 31}: who is Ann, 31?',
                **kwargs)
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    assert valid(choice.message.content)
    assert out.usage.completion_tokens > 0


def test_text_response_format_and_text_completions(client):
    out = _chat(client, "Say hello.", response_format={"type": "text"}, max_tokens=8)
    plain = _chat(client, "Say hello.", max_tokens=8)
    assert out.choices[0].message.content == plain.choices[0].message.content
    done = client.completions.create(model=MODEL, prompt="Order: 42 apples. Count:", max_tokens=8,
                                     temperature=0, extra_body={"guided_regex": r" \d+"})
    assert re.fullmatch(r" \d+", done.choices[0].text) and done.object == "text_completion"


def test_async_client_json_schema(server):
    async def go():
        async with openai.AsyncOpenAI(base_url=server.url, api_key="x", max_retries=0) as c:
            return await c.chat.completions.create(
                model=MODEL, temperature=0, max_tokens=48,
                messages=[{"role": "user", "content": "Invent a person."}],
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "p", "schema": PERSON}})

    out = asyncio.run(go())
    jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)


def test_sampling_options_n_seed_stop_logprobs(client):
    two = _chat(client, "Name a colour.", n=2, temperature=1.0, seed=5, max_tokens=6)
    again = _chat(client, "Name a colour.", n=2, temperature=1.0, seed=5, max_tokens=6)
    assert [c.index for c in two.choices] == [0, 1]
    assert [c.message.content for c in two.choices] == [c.message.content for c in again.choices]
    full = _chat(client, "Count from one to ten in words.", max_tokens=12).choices[0].message.content
    word = full.split()[2]
    cut = _chat(client, "Count from one to ten in words.", max_tokens=12, stop=[word])
    assert word not in cut.choices[0].message.content
    lp = _chat(client, "Say hi.", max_tokens=4, logprobs=True, top_logprobs=2)
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


# -- streaming ---------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [{}, {"extra_body": {"guided_regex": r"[a-z ]{5,30}\."}}],
                         ids=["text", "regex"])
def test_stream_concatenates_to_the_whole_answer_and_reports_usage(client, kwargs):
    whole = _chat(client, "Describe the sea.", max_tokens=12, **kwargs)
    chunks = list(_chat(client, "Describe the sea.", max_tokens=12, stream=True,
                        stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        whole.usage.completion_tokens
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == whole.choices[0].finish_reason and not any(reasons[:-1])


# -- tools -------------------------------------------------------------------------------
@pytest.mark.parametrize("tools,choice,name", [
    ([WEATHER], "required", "get_weather"),
    ([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, "get_time"),
    ([WEATHER, TIME], "required", None),
], ids=["required-one", "named", "required-several"])
def test_tool_calls_follow_the_function_schema(client, tools, choice, name):
    out = _chat(client, "What is the weather in Paris in celsius?", tools=tools,
                tool_choice=choice, max_tokens=64)
    call, = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and out.choices[0].message.content is None
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.function.name == (name or call.function.name) and call.function.name in by_name
    jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])


def _auto(client, question: str, **kwargs):
    return _chat(client, question, tools=[WEATHER, TIME], tool_choice="auto", max_tokens=64,
                 **kwargs)


@pytest.mark.parametrize("question", ["What is the weather in Paris in celsius?",
                                      "Write a haiku about the sea."])
def test_tool_choice_auto_answers_in_words_or_calls_a_tool(client, question):
    choice = _auto(client, question).choices[0]
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    if choice.message.tool_calls:
        call, = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])
    else:
        assert choice.finish_reason == "stop" and isinstance(choice.message.content, str)
        assert not choice.message.content.lstrip().startswith('{"content"')
    # (streamed, the same answer: the text or the call comes whole at the end)
    chunks = [c for c in _auto(client, question, stream=True) if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
    assert text == (choice.message.content or "")
    assert [(d.function.name, d.function.arguments) for d in calls] == \
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


@pytest.mark.parametrize("output,expected", [
    ('{"content": "Hello there."}', (None, "Hello there.")),
    ('{"name": "get_time", "arguments": {"city": "Oslo"}}', ("get_time", '{"city": "Oslo"}')),
])
def test_an_auto_answer_reads_as_words_or_a_call(output, expected):
    from formcast.server.constraints import request_spec
    from formcast.server.protocol import ChatCompletionRequest

    req = ChatCompletionRequest(model=MODEL, messages=MSG, tools=[WEATHER, TIME],
                                tool_choice="auto")
    spec, plan = request_spec(req)
    jsonschema.validate(json.loads(output), spec.json_schema)  # (the grammar allows both)
    assert plan.read(output) == expected


def test_tools_without_tool_choice_default_to_auto_unless_another_constraint_rules(client):
    auto = _auto(client, "What is the weather in Rome in celsius?").choices[0]
    implicit = _chat(client, "What is the weather in Rome in celsius?", tools=[WEATHER, TIME],
                     max_tokens=64).choices[0]
    assert implicit.message == auto.message or (
        implicit.message.tool_calls and auto.message.tool_calls and
        [c.function.arguments for c in implicit.message.tool_calls] ==
        [c.function.arguments for c in auto.message.tool_calls])
    ruled = _chat(client, "What is the weather in Rome?", tools=[WEATHER], max_tokens=8,
                  extra_body={"guided_choice": ["sunny", "rainy"]}).choices[0]
    assert ruled.message.content in ("sunny", "rainy") and not ruled.message.tool_calls


def test_streamed_tool_call_arguments_add_up(client):
    kwargs = dict(tools=[WEATHER], tool_choice="required", max_tokens=64)
    whole = _chat(client, "Weather in Rome?", **kwargs).choices[0].message.tool_calls[0]
    deltas = [c.choices[0].delta.tool_calls for c in _chat(client, "Weather in Rome?",
                                                           stream=True, **kwargs)
              if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0][0].function.name == "get_weather" and deltas[0][0].id
    assert "".join(d[0].function.arguments or "" for d in deltas) == whole.function.arguments


# -- echo and loops ----------------------------------------------------------------------
@pytest.mark.parametrize("prompt", ["The capital of France is", [504, 3575, 282]],
                         ids=["text", "token-ids"])
def test_echo_puts_the_prompt_before_the_completion(client, llm, prompt):
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
    plain = client.completions.create(**kwargs).choices[0].text
    echoed = client.completions.create(echo=True, **kwargs).choices[0].text
    given = prompt if isinstance(prompt, str) else llm.tokenizer.decode(prompt)
    assert echoed == given + plain
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        echo=True, stream=True, **kwargs) if c.choices)
    assert streamed == echoed
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(echo=True, logprobs=1, **kwargs)


REVIEW = {"type": "object", "properties": {
    "product": {"type": "string"}, "rating": {"type": "integer"},
    "pros": {"type": "array", "items": {"type": "string"}},
    "cons": {"type": "array", "items": {"type": "string"}}},
    "required": ["product", "rating", "pros", "cons"]}


def test_json_that_loops_ends_valid_unless_stop_loops_is_off(client):
    from formcast.extraction import extraction_messages

    # (greedy, this model repeats one pro until max_tokens without the guard)
    text = ("Fjällräven Kånken backpack, 4 stars. Pros: durable, classic look, lots of "
            "colours. Cons: thin shoulder straps, no laptop sleeve.")
    kwargs = dict(model=MODEL, messages=extraction_messages(text, REVIEW), max_tokens=120,
                  temperature=0, response_format={"type": "json_schema", "json_schema": {
                      "name": "review", "schema": REVIEW}})
    off = client.chat.completions.create(extra_body={"stop_loops": False}, **kwargs).choices[0]
    assert off.finish_reason == "length"
    on = client.chat.completions.create(**kwargs).choices[0]
    assert on.finish_reason == "stop"
    jsonschema.validate(json.loads(on.message.content), REVIEW)


# -- errors ------------------------------------------------------------------------------
def _post(server, body, *, key: str | None = None, raw: bool = False,
          route: str = "/chat/completions") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if raw:
        return httpx.post(server.url + route, content=body,
                          headers={**headers, "Content-Type": "application/json"})
    return httpx.post(server.url + route, json=body, headers=headers)


MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body,status,param", [
    ('{"model": "smollm2", "messages": [', 400, None),
    ({"model": MODEL, "messages": MSG, "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": MODEL, "messages": "hi"}, 400, "messages"),
    ({"model": MODEL, "messages": MSG, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     400, "response_format"),
    ({"model": MODEL, "messages": MSG, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "integer", "minimum": 5, "maximum": 1}}}}, 400, "response_format"),
    ({"model": MODEL, "messages": MSG, "guided_regex": "(unclosed"}, 400, "response_format"),
    ({"model": MODEL, "messages": MSG, "structured_outputs": {"grammar": 'root ::= ("a" | '}},
     400, "response_format"),
    ({"model": MODEL, "messages": MSG, "guided_regex": "a", "guided_choice": ["a"]}, 400,
     "response_format"),
    ({"model": MODEL, "messages": MSG, "tools": [WEATHER],
      "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, "response_format"),
    ({"model": "gpt-4o", "messages": MSG}, 404, "model"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 20000}]}, 400,
     "messages"),
], ids=["invalid-json", "wrong-type", "wrong-type-messages", "invalid-schema",
        "unsatisfiable-schema", "invalid-regex", "invalid-grammar", "two-constraints", "unknown-tool",
        "unknown-model", "prompt-too-long"])
def test_errors_answer_openai_bodies(server, client, body, status, param):
    resp = _post(server, body, raw=isinstance(body, str))
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    assert _chat(client, "Say hi.", max_tokens=2).choices  # the server goes on


@pytest.mark.parametrize("body,status,param", [
    ('{"model": "smollm2", "prompt": ', 400, None),
    ({"model": MODEL, "prompt": "hi", "max_tokens": [3]}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "guided_json": {"type": "nonsense"}}, 400,
     "response_format"),
    ({"model": "gpt-4o", "prompt": "hi"}, 404, "model"),
    ({"model": MODEL, "prompt": "word " * 20000}, 400, "prompt"),
], ids=["invalid-json", "wrong-type", "invalid-schema", "unknown-model", "prompt-too-long"])
def test_completions_errors_answer_openai_bodies(server, body, status, param):
    resp = _post(server, body, raw=isinstance(body, str), route="/completions")
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param


def test_openai_client_raises_its_error_classes(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSG)
    with pytest.raises(openai.BadRequestError, match="context"):
        _chat(client, "word " * 20000)
    with pytest.raises(openai.BadRequestError):
        _chat(client, "x", response_format={"type": "json_schema",
                                            "json_schema": {"name": "x", "schema": {
                                                "type": "string", "pattern": "(("}}})


# It passes the up-front check, but the end check refuses every boolean the mask allows:
# the engine bans each in turn until no token is left (a dead end found while generating).
DEAD_END = {"type": "json_schema", "json_schema": {"name": "b", "schema": {
    "type": "boolean", "not": {"type": "boolean"}}}}
OTHERS = [dict(extra_body={"guided_regex": r"\d{3}-\d{4}"}),
          dict(response_format={"type": "json_schema",
                                "json_schema": {"name": "p", "schema": PERSON}}),
          dict(max_tokens=12)]


def test_a_dead_end_answers_422_while_the_rest_of_the_batch_finishes(server, client):
    question = [{"role": "user", "content": "Describe Alice, 31, in a few words."}]
    alone = [client.chat.completions.create(model=MODEL, messages=question, temperature=0,
                                            **{"max_tokens": 40, **o}).choices[0].message.content
             for o in OTHERS]
    failed_before = _metrics(server)['formcast_requests_total{outcome="failed"}']

    async def together():
        async with openai.AsyncOpenAI(base_url=server.url, api_key="x", max_retries=0,
                                      timeout=300) as c:
            # (the dead end sampled, the others greedy: a mixed batch, on the sampling path)
            return await asyncio.gather(*(c.chat.completions.create(
                model=MODEL, messages=question, **{"max_tokens": 40, "temperature": 0, **o})
                for o in [dict(response_format=DEAD_END, temperature=1.0, seed=1), *OTHERS]),
                return_exceptions=True)

    dead, *done = asyncio.run(together())
    assert isinstance(dead, openai.UnprocessableEntityError), dead
    assert (dead.code, dead.param, dead.type) == ("constraint_dead_end", "response_format",
                                                  "invalid_request_error")
    assert "dead end" in dead.message and "Traceback" not in dead.message
    assert [o.choices[0].message.content for o in done] == alone
    m = _metrics(server)
    assert m['formcast_requests_total{outcome="failed"}'] == failed_before + 1
    assert m["formcast_requests_in_flight"] == 0
    assert m["formcast_kv_blocks_free"] == m["formcast_kv_blocks_total"]


def test_a_streamed_dead_end_ends_with_an_error_event(server):
    body = {"model": MODEL, "messages": MSG, "max_tokens": 40, "stream": True,
            "response_format": DEAD_END}
    with httpx.stream("POST", server.url + "/chat/completions", json=body, timeout=300) as resp:
        assert resp.status_code == 200  # (sent before the first token)
        events = [line.removeprefix("data: ") for line in resp.iter_lines()
                  if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "constraint_dead_end" and "dead end" in error["message"]


def test_api_key(allm):
    with BackgroundServer(allm, model_name=MODEL, api_key="s3cret") as srv:
        for key, status in [(None, 401), ("wrong", 401), ("s3cret", 200)]:
            resp = _post(srv, {"model": MODEL, "messages": MSG, "max_tokens": 1}, key=key)
            assert resp.status_code == status
            if status == 401:
                assert resp.json()["error"]["code"] == "invalid_api_key"
        bad = openai.OpenAI(base_url=srv.url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        assert httpx.get(srv.url.removesuffix("/v1") + "/health").status_code == 200


def test_full_queue_answers_429(llm):
    small = formcast.AsyncLLM(llm, max_pending=1)
    try:
        with BackgroundServer(small, model_name=MODEL) as srv:
            c = openai.OpenAI(base_url=srv.url, api_key="x", max_retries=0)
            stream = c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Tell a long story."}],
                max_tokens=200, stream=True, extra_body={"guided_regex": "[a-z ]{600}"})
            next(iter(stream))  # (its request is in flight)
            with pytest.raises(openai.RateLimitError):
                c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=1)
            with pytest.raises(openai.RateLimitError):
                c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=1, stream=True)
            stream.close()
    finally:
        small.loop.close()


# -- batching across clients --------------------------------------------------------------
def test_32_concurrent_clients_get_the_outputs_of_sequential_requests(server, client):
    requests = [dict(messages=[{"role": "user", "content": f"Tell me a fact about the number {i}."}],
                     max_tokens=4 + i % 5,
                     **({"response_format": {"type": "json_schema", "json_schema": {
                         "name": "p", "schema": PERSON}}} if i % 4 == 0 else {}))
                for i in range(32)]
    alone = [client.chat.completions.create(model=MODEL, temperature=0, **r)
             .choices[0].message.content for r in requests]

    async def together():
        async with openai.AsyncOpenAI(base_url=server.url, api_key="x", max_retries=0,
                                      timeout=300) as c:
            outs = await asyncio.gather(*(c.chat.completions.create(
                model=MODEL, temperature=0, **r) for r in requests))
        return [o.choices[0].message.content for o in outs]

    assert asyncio.run(together()) == alone


def test_disconnect_mid_stream_frees_the_request(server, llm):
    before = _metrics(server)
    body = {"model": MODEL, "stream": True, "max_tokens": 400,
            "messages": [{"role": "user", "content": "Write a very long story."}],
            "guided_regex": "[a-z ]{1500}"}
    with httpx.stream("POST", server.url + "/chat/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        assert _metrics(server)["formcast_requests_in_flight"] == 1
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = _metrics(server)
        if m["formcast_requests_in_flight"] == 0 and m["formcast_running_requests"] == 0:
            break
        time.sleep(0.05)
    assert m['formcast_requests_total{outcome="aborted"}'] == \
        before['formcast_requests_total{outcome="aborted"}'] + 1
    assert m["formcast_queue_depth"] == 0 and m["formcast_running_requests"] == 0
    assert m["formcast_kv_blocks_free"] == m["formcast_kv_blocks_total"]
    assert not llm.engine.has_unfinished_requests()


# -- the other routes ---------------------------------------------------------------------
def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(server.url.removesuffix("/v1") + "/health").json() == {"status": "ok"}
    m = _metrics(server)
    assert m['formcast_requests_total{outcome="finished"}'] > 0
    assert m["formcast_completion_tokens_total"] > 0 and m["formcast_step_seconds_count"] > 0
    assert 0 < m["formcast_constrained_share"] <= 1
    assert m['formcast_http_responses_total{route="/v1/chat/completions",code="200"}'] > 0

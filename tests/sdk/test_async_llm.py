"""formcast.AsyncLLM on the real SmolLM2: coroutines share one engine batch and get
what the synchronous LLM gives them."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import BaseModel, Field

import formcast

pytestmark = pytest.mark.slow


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def allm(llm):
    with formcast.AsyncLLM(llm) as async_llm:
        yield async_llm


PROMPTS = ["Name a fruit.", "Name a city.", "What is 2+2?", "Say hello.", "Name a colour."]


def test_gathered_calls_equal_the_synchronous_ones(allm, llm):
    async def together():
        return await asyncio.gather(*(allm.agenerate(p, max_tokens=8) for p in PROMPTS),
                                    allm.agenerate("Ann is 31.", output_type=Person,
                                                   max_tokens=40))

    outs = asyncio.run(together())
    expected = [llm.generate(p, max_tokens=8) for p in PROMPTS]
    expected.append(llm.generate("Ann is 31.", output_type=Person, max_tokens=40))
    assert [o.token_ids for o in outs] == [e.token_ids for e in expected]
    assert outs[-1].value == expected[-1].value and isinstance(outs[-1].value, Person)


def test_aextract_and_astream(allm, llm):
    text = "Maria Lopez is 34 years old."

    async def run():
        value = await allm.aextract(text, Person)
        items = [item async for item in allm.astream("Describe Maria, 34.", output_type=Person,
                                                     max_tokens=40)]
        deltas = [d async for d in allm.astream_text("Say hello.", max_tokens=8)]
        return value, items, deltas

    value, items, deltas = asyncio.run(run())
    assert value == llm.extract(text, Person)
    assert isinstance(items[-1], Person) and all(isinstance(i, dict) for i in items[:-1])
    assert "".join(deltas) == llm.generate("Say hello.", max_tokens=8).text


@pytest.mark.parametrize("kwargs,error", [
    ({"regex": "(unclosed"}, formcast.ConstraintError),
    ({"max_tokens": 0}, formcast.RequestError),
    ({"json_schema": {"type": "integer", "minimum": 3, "maximum": 1}}, formcast.ConstraintError),
])
def test_errors_are_raised_in_the_caller_and_the_loop_goes_on(allm, kwargs, error):
    async def run():
        with pytest.raises(error):
            await allm.agenerate("hi", **kwargs)
        return await allm.agenerate("Say hi.", max_tokens=2)

    assert asyncio.run(run()).usage.completion_tokens == 2


def test_full_queue_and_early_exit(llm):
    async def run(small):
        stream = small.astream_text("Tell a long story.", max_tokens=200)
        first = await anext(stream)  # (its request is in flight)
        with pytest.raises(formcast.QueueFullError):
            await small.agenerate("hi", max_tokens=1)
        await stream.aclose()  # leaving early aborts the request
        for _ in range(200):
            if small.loop.num_in_flight == 0:
                break
            await asyncio.sleep(0.02)
        return first, await small.agenerate("Say hi.", max_tokens=2)

    with formcast.AsyncLLM(llm, max_pending=1) as small:
        first, after = asyncio.run(run(small))
        assert first and after.usage.completion_tokens == 2
        assert small.loop.stats.requests_aborted == 1 and small.loop.stats.requests_rejected == 1
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_a_request_the_engine_refuses_leaves_nothing_in_flight(allm):
    async def run():
        with pytest.raises(formcast.RequestError, match="context"):
            await allm.agenerate("word " * 20000, max_tokens=4)

    asyncio.run(run())
    assert allm.loop.num_in_flight == 0

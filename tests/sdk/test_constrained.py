"""Constrained calls through the SDK on the real model; every output is checked with a
validator independent of the mask backend (jsonschema, pydantic, re, lark)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Literal, TypedDict

import jsonschema
import lark
import pytest
from pydantic import BaseModel, Field

from formcast import ConstraintError, FormcastError, IncompleteOutputError

pytestmark = pytest.mark.slow


class Person(BaseModel):
    name: str = Field(description="The person's full name")
    age: int = Field(ge=0, le=130)
    city: str | None = Field(default=None, description="Where the person lives")


@dataclass
class Product:
    name: str
    price: float
    in_stock: bool


class Event(TypedDict):
    title: str
    year: int


TEXTS = [
    "John Smith is 42 years old and lives in Boston.",
    "Maria Garcia, aged 31, moved to Madrid last spring.",
    "Our new intern, Kenji Tanaka (23), works from the Osaka office.",
    "Dr. Amelia Brooks turned 58 this year; she still lives in Leeds.",
]


def test_extract_returns_validated_pydantic_instances(llm):
    person = llm.extract(TEXTS[0], Person)
    assert isinstance(person, Person)
    assert person.name == "John Smith" and person.age == 42


def test_extract_dataclass_typeddict_and_dict_schema(llm):
    product = llm.extract("The Acme kettle costs 29.99 dollars and is in stock.", Product)
    assert isinstance(product, Product) and isinstance(product.in_stock, bool)
    event = llm.extract("The first moon landing happened in 1969 (Apollo 11).", Event)
    assert set(event) == {"title", "year"} and isinstance(event["year"], int)
    schema = Person.model_json_schema()
    data = llm.extract(TEXTS[1], schema)
    assert isinstance(data, dict)
    jsonschema.validate(data, schema)


def test_extract_batch_of_32_at_temperature_validates_every_item(llm):
    texts = (TEXTS * 8)[:32]
    results = llm.extract_batch(texts, Person, temperature=0.7, seed=0)
    assert len(results) == 32
    schema = Person.model_json_schema()
    for r in results:
        assert isinstance(r, Person), r
        jsonschema.validate(r.model_dump(mode="json"), schema)


def test_extract_batch_returns_completions_with_usage_when_asked(llm):
    results = llm.extract_batch(TEXTS[:2], Person, return_completions=True)
    for text, r in zip(TEXTS, results):
        assert isinstance(r.value, Person), r
        assert r.value.name.split()[0] in text
        assert r.usage.completion_tokens == len(r.token_ids) > 0
        assert r.usage.prompt_tokens > 0 and r.finish_reason == "stop"
        assert Person.model_validate_json(r.text) == r.value


def test_json_schema_generation_validates(llm):
    schema = {"type": "object", "additionalProperties": False, "required": ["colors"],
              "properties": {"colors": {"type": "array", "minItems": 1, "maxItems": 3,
                                        "items": {"enum": ["red", "green", "blue"]}}}}
    out = llm.generate("List some colours of the French flag.", json_schema=schema,
                       temperature=0.8, seed=4)
    jsonschema.validate(json.loads(out.text), schema)
    assert out.value == json.loads(out.text)


def test_regex_output_full_matches(llm):
    pattern = r"\d{3}-\d{3}-\d{4}"
    outs = llm.generate_batch(["Give me a phone number.", "Invent a US phone number."],
                              regex=pattern, temperature=0.9, seed=1)
    for out in outs:
        assert re.fullmatch(pattern, out.text)


def test_choices_and_literal(llm):
    out = llm.generate("Is fire hot? Answer yes or no.", choices=["yes", "no"])
    assert out.text in ("yes", "no") and out.value == out.text
    lit = llm.generate("Classify: 'I love this phone!'", output_type=Literal["positive", "negative"])
    assert lit.value in ("positive", "negative")


ARITH_EBNF = r'''
root ::= expr " = " num
expr ::= num " " op " " num | "(" num " " op " " num ") " op " " num
op ::= "+" | "-" | "*"
num ::= [1-9] | [1-9] [0-9]
'''
ARITH_LARK = r'''
start: expr " = " NUM
expr: NUM " " OP " " NUM | "(" NUM " " OP " " NUM ") " OP " " NUM
OP: "+" | "-" | "*"
NUM: /[1-9][0-9]?/
'''


def test_ebnf_grammar_output_parses_with_lark(llm):
    parser = lark.Lark(ARITH_LARK)
    outs = llm.generate_batch(["Write an arithmetic fact.", "Write a sum and its result."],
                              grammar=ARITH_EBNF, max_tokens=40, temperature=0.8, seed=2)
    for out in outs:
        assert out.finish_reason == "stop", out
        parser.parse(out.text)


def test_too_few_tokens_raise_incomplete_output_with_partial_text(llm):
    with pytest.raises(IncompleteOutputError) as info:
        llm.extract(TEXTS[0], Person, max_tokens=4)
    assert info.value.text and info.value.text.startswith("{")


def test_bad_schema_is_a_constraint_error_before_generation(llm):
    bad = {"type": "integer", "minimum": 10, "maximum": 1}
    with pytest.raises(ConstraintError):
        llm.generate("Pick a number.", json_schema=bad)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ConstraintError):
        llm.generate("x", regex="(unclosed")


def test_stream_yields_growing_partials_then_the_instance(llm):
    items = list(llm.stream("Describe: " + TEXTS[2], output_type=Person))
    assert isinstance(items[-1], Person)
    partials = items[:-1]
    assert partials and all(isinstance(p, dict) for p in partials)
    assert len(partials[-1]) >= len(partials[0])
    with pytest.raises(ConstraintError, match="stream_text"):
        next(llm.stream("hi"))


def test_end_checked_keyword_is_met_by_rolling_back_and_streams_only_final_text(llm):
    # uniqueItems is checked at the end; greedy decoding of this prompt repeats 7, so
    # the engine must roll back and resample rather than fail or return [7,7,7,7]
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
              "minItems": 4, "maxItems": 4, "uniqueItems": True}
    prompt = "Output: [7,7,7,7]\nOutput: [7,7,7,7]\nOutput: "
    out = llm.generate(prompt, raw=True, json_schema=schema)
    jsonschema.validate(out.value, schema)
    assert json.loads(out.text) == out.value
    assert list(llm.stream_text(prompt, raw=True, json_schema=schema)) == [out.text]
    *partials, final = llm.stream(prompt, raw=True, json_schema=schema)
    assert final == out.value and partials == []

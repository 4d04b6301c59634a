"""Gemma 3 270M, the catalogue's base model (real weights, fetched into the user cache
on first use as SmolLM2 is), under every constraint kind: a pydantic model, a JSON
Schema, a regex, an EBNF grammar, a Lark grammar and choices through ``generate``,
and ``extract`` into a pydantic model and a JSON Schema. Each output is checked by
a validator that knows nothing of the masks (pydantic, jsonschema, re, lark).

Prompts are completion style (the model continues text); outputs are short and
bounded so that greedy decoding ends within ``max_tokens``.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import lark
import pytest
from pydantic import BaseModel, Field

import formcast

pytestmark = pytest.mark.slow


class City(BaseModel):
    name: str = Field(max_length=16)
    country: str = Field(max_length=16)


class Person(BaseModel):
    name: str
    age: int


CITY_SCHEMA = {"type": "object", "additionalProperties": False,
               "required": ["city", "population"],
               "properties": {"city": {"type": "string", "maxLength": 16},
                              "population": {"type": "integer", "minimum": 0,
                                             "maximum": 99999999}}}
COLOUR_EBNF = r'''
root ::= colour ", " colour " and " num
colour ::= "red" | "green" | "blue" | "yellow"
num ::= [1-9] | [1-9] [0-9]
'''
ASSIGN_LARK = r'''
start: NAME " = " NUM ";"
NAME: /[a-z]{1,8}/
NUM: /[1-9][0-9]{0,2}/
'''
CHOICES = ["Paris", "London", "Berlin", "Madrid"]


@pytest.fixture(scope="module")
def gemma(gemma_llm) -> formcast.LLM:
    return gemma_llm


def _json_schema_valid(text: str) -> bool:
    jsonschema.validate(json.loads(text), CITY_SCHEMA)
    return True


CASES: list[tuple[str, str, dict[str, Any], Any]] = [
    ("pydantic", "A city, as JSON:", {"output_type": City},
     lambda out: isinstance(out.value, City) and City.model_validate_json(out.text) == out.value),
    ("json_schema", "The largest city of Japan, as JSON:", {"json_schema": CITY_SCHEMA},
     lambda out: _json_schema_valid(out.text) and out.value == json.loads(out.text)),
    ("regex", "The Eiffel Tower was finished on", {"regex": r" [0-9]{4}-[0-9]{2}-[0-9]{2}"},
     lambda out: re.fullmatch(r" [0-9]{4}-[0-9]{2}-[0-9]{2}", out.text) is not None),
    ("ebnf", "My favourite colours and my age:", {"grammar": COLOUR_EBNF},
     lambda out: lark.Lark(r'''start: C ", " C " and " /[1-9][0-9]?/
                             C: "red" | "green" | "blue" | "yellow"''').parse(out.text)
     is not None),
    ("lark", "In Python, set a variable:", {"lark": ASSIGN_LARK},
     lambda out: lark.Lark(ASSIGN_LARK).parse(out.text) is not None),
    ("choices", "The capital of France is", {"choices": CHOICES},
     lambda out: out.text in CHOICES and out.value == out.text),
]


@pytest.mark.parametrize("kind, prompt, constraint, conforms", CASES, ids=[c[0] for c in CASES])
def test_generate_conforms_under_each_constraint_kind(gemma, kind, prompt, constraint,
                                                      conforms) -> None:
    out = gemma.generate(prompt, max_tokens=48, **constraint)
    assert out.finish_reason == "stop", out
    assert conforms(out), out.text


@pytest.mark.parametrize("schema", [Person, {
    "type": "object", "required": ["name", "age"], "additionalProperties": False,
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}],
    ids=["pydantic", "json_schema"])
def test_extract_takes_grounded_values_from_the_text(gemma, schema) -> None:
    text = "Maria Gonzalez, 34, works as a nurse in Valencia."
    got = gemma.extract(text, schema, max_tokens=48)
    person = got if isinstance(got, Person) else Person.model_validate(got)
    assert isinstance(got, Person) is (schema is Person)
    assert person.name and person.name in text  # (grounded: a span of the text)
    assert person.age == 34  # (the only number the text writes)

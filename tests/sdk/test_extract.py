"""LLM.extract on the real SmolLM2: refusals, grounding modes, confidence, nulls."""

from __future__ import annotations

import math

import pytest
from pydantic import BaseModel, Field

import formcast
from formcast import grammars
from formcast.extraction import Extraction, generation_schema

TEXT = "Maria Gonzalez works as a nurse in Valencia."


class Person(BaseModel):
    name: str = Field(description="full name")
    age: int | None = Field(default=None, description="age in years")
    city: str
    occupation: str


@pytest.mark.parametrize("text", ["", "   ", "\n\t "])
def test_empty_text_is_a_request_error_before_generation(llm, text):
    with pytest.raises(formcast.RequestError, match="empty"):
        llm.extract(text, Person)
    results = llm.extract_batch([text], Person)
    assert isinstance(results[0], formcast.RequestError)


@pytest.mark.parametrize("grounding", ["sometimes", None, True, "AUTO"])
def test_an_unknown_grounding_mode_is_a_constraint_error(llm, grounding):
    with pytest.raises(formcast.ConstraintError, match="grounding"):
        llm.extract(TEXT, Person, grounding=grounding)


@pytest.mark.parametrize("mode", ["off", "auto", "strict"])
def test_each_text_gets_a_matcher_grounded_in_it_by_the_mode(llm, mode):
    texts = [TEXT, "Tom Becker, 29, engineer in Berlin."]
    job = Extraction(Person, texts, grounding=mode, instructions=None)
    compiled = grammars.compile(job.spec.constraint, llm.tokenizer)
    plan = job.plan
    for i, text in enumerate(texts):
        matcher = job.matcher(i, compiled)
        assert matcher.source_text == text
        assert matcher.plan == plan
    assert plan.words and plan.capitalise
    assert bool(plan.strings) is (mode != "off")
    assert bool(plan.numbers) is (mode != "off")     # "auto" keeps numbers to the text's too


@pytest.mark.parametrize(("schema", "mode", "error"), [
    ({"type": "integer"}, "auto", False),              # auto: the model's own number
    ({"type": "integer"}, "strict", True),
    ({"type": "integer", "x-grounded": True}, "auto", True),
    ({"type": "integer"}, "off", False),
])
def test_which_fields_the_text_lacks_are_grounding_errors(llm, schema, mode, error):
    wrapped = {"type": "object", "required": ["count"], "properties": {"count": schema}}
    result = llm.extract_batch(["There are no digits in this sentence."], wrapped,
                               grounding=mode)[0]
    assert isinstance(result, formcast.GroundingError) is error


def test_grounded_values_come_from_the_text_and_absent_ones_are_null(llm):
    person = llm.extract(TEXT, Person, grounding="strict")
    for value in (person.name, person.city, person.occupation):
        assert value and value.casefold() in TEXT.casefold()
    assert person.age is None  # no number in the text: a grounded number can only be null


def test_return_completions_gives_per_field_confidence(llm):
    completion = llm.extract(TEXT, Person, return_completions=True)
    assert isinstance(completion, formcast.Completion)
    assert isinstance(completion.value, Person)
    confidence = completion.field_confidence
    assert set(confidence) == {"/name", "/age", "/city", "/occupation"}
    assert all(-math.inf < c <= 0.0 for c in confidence.values())
    assert llm.extract_batch([TEXT], Person)[0] == completion.value  # same greedy output


def test_a_grounded_field_the_text_has_no_value_for_is_a_grounding_error(llm):
    schema = {"type": "object", "required": ["count"],
              "properties": {"count": {"type": "integer", "x-grounded": True}}}
    with pytest.raises(formcast.GroundingError) as caught:
        llm.extract("There are no digits in this sentence.", schema)
    assert caught.value.path == "/count"
    assert "/count" in str(caught.value)
    assert isinstance(caught.value, formcast.OutputValidationError)

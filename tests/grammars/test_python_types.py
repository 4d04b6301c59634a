"""from_type: Python types to JSON Schema, checked by generating and validating values."""

from __future__ import annotations

import dataclasses
import enum
import json
import zlib
from typing import Any, Literal, NotRequired, Optional, TypedDict, Union

import jsonschema
import numpy as np
import pydantic
import pytest

from formcast import ConstraintError, FormcastError

from formcast.grammars import JsonSchema, from_type, type_schema

from .conftest import allowed_ids


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclasses.dataclass
class Point:
    x: int
    y: float = 0.0


@dataclasses.dataclass
class Node:
    value: int
    children: list[Node]


class Movie(TypedDict):
    title: str
    year: NotRequired[int]


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=5)
    kind: Literal["cat", "dog"]


class Owner(pydantic.BaseModel):
    pets: list[Pet] = pydantic.Field(max_length=2)
    age: Optional[int] = pydantic.Field(default=None, ge=0, le=120)


class Tree(pydantic.BaseModel):
    label: Literal["a", "b"]
    kids: list[Tree] = pydantic.Field(max_length=2)


EXPRESSIBLE = [
    (int, [1, -3], ["1", 1.5]),
    (bool, [True], [1]),
    (str, ["x"], [None]),
    (type(None), [None], [0]),
    (Any, [{"a": [1]}], []),
    (Literal["a", 1], ["a", 1], ["b"]),
    (Literal["only"], ["only"], ["other"]),
    (Colour, ["red"], ["RED"]),
    (list[int], [[1, 2], []], [[1.5]]),
    (tuple[int, str], [[1, "a"]], [[1], [1, "a", 2]]),
    (tuple[int, ...], [[1, 2, 3]], [["a"]]),
    (dict[str, float], [{"a": 1.5}], [{"a": "x"}]),
    (Optional[int], [None, 3], ["3"]),
    (Union[int, str], [1, "a"], [None]),
    (int | None, [None], [1.5]),
    (Point, [{"x": 1}, {"x": 1, "y": 2.5}], [{"y": 1.0}, {"x": 1, "z": 2}]),
    (Node, [{"value": 1, "children": [{"value": 2, "children": []}]}], [{"value": 1}]),
    (Movie, [{"title": "x"}, {"title": "x", "year": 1999}], [{"year": 1999}]),
    (Pet, [{"name": "Rex", "kind": "dog"}], [{"name": "Rexxxx", "kind": "dog"}]),
    (Owner, [{"pets": []}, {"pets": [{"name": "a", "kind": "cat"}], "age": 3}],
     [{"pets": [], "age": 200}]),
    (Tree, [{"label": "a", "kids": [{"label": "b", "kids": []}]}], [{"label": "c", "kids": []}]),
    (list[Point], [[{"x": 1}]], [[{"x": "1"}]]),
    (dict[str, Node], [{"n": {"value": 1, "children": []}}], [{"n": {}}]),
]


@pytest.mark.parametrize("tp,good,bad", EXPRESSIBLE, ids=[repr(t[0]) for t in EXPRESSIBLE])
def test_type_schema_accepts_exactly_the_values(tp, good, bad):
    validator = jsonschema.Draft202012Validator(type_schema(tp))
    for value in good:
        assert validator.is_valid(value), value
    for value in bad:
        assert not validator.is_valid(value), value
    assert isinstance(from_type(tp), JsonSchema)


@pytest.mark.parametrize("tp,message", [
    (set[int], "set[int]"),
    (dict[int, str], "dict[int, str]: JSON object keys are strings"),
    (complex, "complex"),
    (Literal[1.5], "literal 1.5"),
    (list[bytes], "bytes"),
    (object, "object"),
])
def test_unsupported_types_raise_type_error_naming_them(tp, message):
    with pytest.raises(TypeError) as info:
        from_type(tp)
    assert message in str(info.value)
    # one error type for every problem with a constraint, a TypeError too
    assert isinstance(info.value, ConstraintError) and isinstance(info.value, FormcastError)


def test_unsupported_field_names_the_field():
    @dataclasses.dataclass
    class Holder:
        when: complex

    with pytest.raises(TypeError, match=r"Holder\.when"):
        from_type(Holder)


@pytest.mark.parametrize("tp,parse", [
    (Owner, Owner.model_validate_json),
    (Tree, Tree.model_validate_json),
    (Point, lambda text: Point(**json.loads(text))),
    (Node, json.loads),
    (list[Colour], lambda text: [Colour(v) for v in json.loads(text)]),
])
def test_generated_values_parse_back_into_the_type(tp, parse, compiler, smollm2_tokenizer):
    schema = type_schema(tp)
    compiled = compiler.compile(from_type(tp), smollm2_tokenizer)
    rng = np.random.default_rng(zlib.crc32(repr(tp).encode()))
    bitmask = compiled.allocate_bitmask(1)
    eos, done = compiled.vocab.eos_token_ids, 0
    for _ in range(40):
        m, parts = compiled.matcher(), []
        for _ in range(80):
            m.fill_bitmask(bitmask, 0)
            token = int(rng.choice(allowed_ids(bitmask, 0, compiled.vocab_size)))
            assert m.accept(token)
            if token in eos:
                text = b"".join(parts).decode()
                jsonschema.validate(json.loads(text), schema)
                parse(text)
                done += 1
                break
            parts.append(compiled.vocab.token_bytes[token])
    assert done >= 4

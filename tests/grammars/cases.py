"""The conformance table: (constraint, valid strings, invalid strings, oracle).

Valid strings must be accepted token by token to termination; invalid ones must be
rejected at some token or refused termination. Each case also names an oracle
independent of the mask backends (``re.fullmatch``, ``jsonschema``, ``lark``) that the
random walks check their outputs against, and which backends it applies to.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import jsonschema
import lark

from formcast.grammars import Choice, Constraint, Ebnf, JsonSchema, Lark, Regex

BOTH = ("xgrammar", "outlines-core")
XGR = ("xgrammar",)


@dataclass(frozen=True)
class Case:
    id: str
    constraint: Constraint
    valid: tuple[str, ...]
    invalid: tuple[str, ...]
    oracle: Callable[[str], bool]
    backends: tuple[str, ...] = BOTH
    walk: bool = True                      # run random walks on it
    notes: str = field(default="")


def regex_oracle(pattern: str) -> Callable[[str], bool]:
    compiled = re.compile(pattern)
    return lambda text: compiled.fullmatch(text) is not None


def schema_oracle(schema: dict, *, max_whitespace: int = 0) -> Callable[[str], bool]:
    """jsonschema validity plus the whitespace bound (runs outside strings)."""
    validator = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)

    def check(text: str) -> bool:
        try:
            value = json.loads(text)
        except ValueError:
            return False
        return _longest_ws_run(text) <= max_whitespace and validator.is_valid(value)

    return check


def _longest_ws_run(text: str) -> int:
    """Length of the longest whitespace run outside JSON strings."""
    in_str = esc = False
    run = longest = 0
    for c in text:
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
            continue
        if c in " \n\t\r":
            run += 1
            longest = max(longest, run)
            continue
        run = 0
        in_str = c == '"'
    return longest


def lark_oracle(grammar: str, start: str = "start") -> Callable[[str], bool]:
    parser = lark.Lark(grammar, start=start, parser="earley")

    def check(text: str) -> bool:
        try:
            parser.parse(text)
        except lark.exceptions.LarkError:
            return False
        return True

    return check


def regex_case(id: str, pattern: str, valid, invalid, **kw) -> Case:
    return Case(id, Regex(pattern), tuple(valid), tuple(invalid), regex_oracle(pattern), **kw)


def schema_case(id: str, schema: dict, valid, invalid, *, whitespace: str = "compact",
                max_whitespace: int | None = None, **kw) -> Case:
    constraint = JsonSchema(schema, whitespace=whitespace, max_whitespace=max_whitespace)
    return Case(id, constraint, tuple(valid), tuple(invalid),
                schema_oracle(schema, max_whitespace=constraint.whitespace_bound), **kw)


PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 130}},
          "required": ["name"]}
TREE = {"$defs": {"node": {"type": "object",
                           "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                                          "kids": {"type": "array", "maxItems": 2,
                                                   "items": {"$ref": "#/$defs/node"}}},
                           "required": ["v", "kids"]}},
        "$ref": "#/$defs/node"}

CASES: list[Case] = [
    # ---- regex
    regex_case("regex-repeat-group", r"(ab)+", ["ab", "abab", "ababab"],
               ["", "a", "aba", "abb", "b"]),
    regex_case("regex-number", r"-?\d+(\.\d+)?", ["0", "-12", "3.14", "120.5"],
               ["1.", ".5", "--1", "1a", "-"]),
    regex_case("regex-email-ish", r"[a-z]{2,4}@(x|y)\.com", ["ab@x.com", "abcd@y.com"],
               ["a@x.com", "abcde@x.com", "ab@z.com", "ab@x.co"]),
    regex_case("regex-unicode-dot", r"caf[éè] .", ["café !", "cafè x", "café é"],
               ["cafe x", "café \n", "café", "café ab"]),
    regex_case("regex-classes", r"\w{1,5} \s?\S", ["abc d", "x  y", "A_1 ?"],
               ["abc", "abc  ", "abcdef x"]),
    regex_case("regex-anchored-alternation", r"^(?:yes|no)$|^maybe$", ["yes", "no", "maybe"],
               ["yesno", "", "may"]),
    regex_case("regex-counted", r"[0-9a-f]{4}-[0-9a-f]{2}", ["12ab-ff", "0000-00"],
               ["12ab-f", "12abc-ff", "12AB-ff"]),
    # ---- choice
    Case("choice", Choice(["yes", "no", "maybe so", "n/a"]), ("yes", "no", "maybe so", "n/a"),
         ("ye", "yesno", "Yes", "maybe", ""),
         lambda t: t in ("yes", "no", "maybe so", "n/a")),
    # ---- JSON Schema, fully enforced by the mask
    schema_case("json-object", PERSON,
                ['{"name":"Al"}', '{"name":"Al","age":30}', '{"name":"é x","age":0}'],
                ['{"age":3}', '{"name":"Al","age":-1}', '{"name":"Al","age":131}',
                 '{"name":"Al" }', '{"name":1}', '{"name":"toolong7"}', '{"name":"Al"']),
    schema_case("json-array", {"type": "array", "items": {"type": "number"},
                               "minItems": 1, "maxItems": 3},
                ["[1]", "[1.5,-2,3e2]", "[0,0.25]"],
                ["[]", "[1,2,3,4]", "[1,]", '["a"]', "[01]"]),
    schema_case("json-enum", {"enum": ["red", "green", 1, None, {"k": [True]}]},
                ['"red"', "1", "null", '{"k":[true]}'], ['"blue"', "2", "true", '{"k":[]}']),
    schema_case("json-recursive", TREE,
                ['{"v":1,"kids":[]}', '{"v":1,"kids":[{"v":2,"kids":[]}]}'],
                ['{"v":1}', '{"v":1,"kids":[{}]}', '{"v":10,"kids":[]}']),
    schema_case("json-string-length", {"type": "string", "minLength": 2, "maxLength": 4},
                ['"ab"', '"abcd"', '"éé"'], ['"a"', '"abcde"', "ab"]),
    schema_case("json-pattern", {"type": "string", "pattern": "^[A-Z]{3}-\\d{2}$"},
                ['"ABC-12"'], ['"AB-12"', '"ABC-123"', '"abc-12"']),
    schema_case("json-integer", {"type": "integer"}, ["0", "-5", "1234"],
                ["01", "1.5", '"1"', "-"]),
    schema_case("json-string-escapes", {"type": "string"},
                ['"a\\"b\\\\c\\n"', '"tab\\t"', '""'], ['"a', '"a"b"', '"\\q"'],
                walk=False),
    schema_case("json-number-bounds", {"type": "number", "exclusiveMinimum": 0, "maximum": 1.5},
                ["0.5", "1.5", "1", "0.001"], ["0", "-1", "1.51", "2"], backends=XGR),
    schema_case("json-required-not-in-properties",
                {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]},
                ['{"b":2}', '{"a":1,"b":[1]}'], ['{"a":1}', "{}"], walk=False),
    schema_case("json-allof-merged",
                {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}},
                            "required": ["a"]},
                           {"properties": {"b": {"type": "boolean"}}, "required": ["b"]}]},
                ['{"a":1,"b":true}'], ['{"a":1}', '{"b":false}']),
    schema_case("json-additional-properties",
                {"type": "object", "additionalProperties": {"type": "integer"},
                 "maxProperties": 2},
                ["{}", '{"x":1,"y":2}'], ['{"x":"a"}', '{"x":1,"y":2,"z":3}'], backends=XGR,
                walk=False),
    schema_case("json-flexible-whitespace",
                {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                ['{ "a" : 1 }', '{"a":1}', '{\n "a": 1\n}'], ['{   "a":1}', '{"a":1', "[1]"],
                whitespace="flexible", max_whitespace=2),
    schema_case("json-format-email-uuid",
                {"type": "object", "required": ["e", "u"],
                 "properties": {"e": {"type": "string", "format": "email"},
                                "u": {"type": "string", "format": "uuid"}}},
                ['{"e":"a.b@example.com","u":"123e4567-e89b-12d3-a456-426614174000"}'],
                ['{"e":"ab","u":"123e4567-e89b-12d3-a456-426614174000"}',
                 '{"e":"a@b.co","u":"123"}'], walk=False),   # e-mails are too long to walk
    schema_case("json-format-uuid", {"type": "string", "format": "uuid"},
                ['"00000000-0000-0000-0000-00000000000a"'], ['"0000-0000"', '"g"']),
    # ---- JSON Schema keywords checked on the finished document
    schema_case("json-unique-items",
                {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 3,
                 "uniqueItems": True},
                ["[1,2]", "[]", "[3,1,2]"], ["[1,1]", "[2,3,2]"]),
    schema_case("json-not", {"type": "integer", "minimum": 0, "maximum": 9,
                             "not": {"enum": [3]}},
                ["2", "9"], ["3"]),
    schema_case("json-oneof",
                {"oneOf": [{"type": "integer", "multipleOf": 2, "minimum": 0, "maximum": 20},
                           {"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 20}]},
                ["2", "3", "4"], ["6", "5", "12"]),
    schema_case("json-format-date", {"type": "string", "format": "date"},
                ['"2024-02-29"', '"1999-12-31"'], ['"2024-13-01"', '"x"', '"2023-02-30"']),
    # ---- grammars (xgrammar only)
    Case("ebnf-list",
         Ebnf('root ::= "(" list? ")"\nlist ::= num ("," num)*\nnum ::= [0-9] [0-9]?'),
         ("()", "(1,23)", "(7)"), ("(", "(1,)", "(a)", "(123)"),
         lark_oracle('start: "(" [num ("," num)*] ")"\nnum: /[0-9][0-9]?/'), backends=XGR),
    Case("ebnf-left-recursive",
         Ebnf('root ::= root "+" term | term\nterm ::= [a-z]'),
         ("a", "a+b+c"), ("a+", "+a", "ab"),
         lark_oracle('start: start "+" TERM | TERM\nTERM: /[a-z]/'), backends=XGR),
    Case("ebnf-custom-root",
         Ebnf('answer ::= "A: " ("yes" | "no")', root="answer"),
         ("A: yes", "A: no"), ("A:yes", "yes"),
         lark_oracle('start: "A: " ("yes" | "no")'), backends=XGR),
    Case("lark-pairs",
         Lark('start: pair ("," pair)*\npair: KEY "=" VALUE\nKEY: /[a-z]{1,3}/\n'
              'VALUE: /[0-9]{1,2}/'),
         ("a=1", "ab=12,c=3"), ("a=", "a=1,", "A=1"),
         lark_oracle('start: pair ("," pair)*\npair: KEY "=" VALUE\nKEY: /[a-z]{1,3}/\n'
                     'VALUE: /[0-9]{1,2}/'), backends=XGR),
]


def cases_for(backend: str) -> list[Case]:
    return [c for c in CASES if backend in c.backends]

import json

import pytest

from formcast.partial_json import parse_partial

DOC = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry"], "ok": True, "x": None,
       "nested": {"a": [1, 2.5, {"b": "c"}]}, "esc": 'a"b\\cé\u2603'}


@pytest.mark.parametrize("text, expected", [
    ("", None),
    ("{", {}),
    ('{"na', {}),
    ('{"name"', {}),
    ('{"name":', {}),
    ('{"name": "Ad', {"name": "Ad"}),
    ('{"name": "Ada", "age": 3', {"name": "Ada"}),          # a number may still grow
    ('{"name": "Ada", "age": 36,', {"name": "Ada", "age": 36}),
    ('{"ok": tr', {}),
    ('{"ok": true', {"ok": True}),
    ("[1, 2, [3", [1, 2, []]),                                 # 3 may still grow
    ('["a", "b\\', ["a", "b"]),                              # a cut escape is held back
    ('["\\u00', [""]),
    ('{"a": {"b": [', {"a": {"b": []}}),
])
def test_prefixes_parse_to_the_completed_part(text, expected):
    assert parse_partial(text) == expected


def test_every_prefix_of_a_document_parses_and_grows_monotonically():
    text = json.dumps(DOC, ensure_ascii=False)
    for i in range(len(text) + 1):
        value = parse_partial(text[:i])
        assert value is None or isinstance(value, dict)
    assert parse_partial(text) == DOC
    compact = json.dumps(DOC, separators=(",", ":"))
    assert parse_partial(compact) == DOC

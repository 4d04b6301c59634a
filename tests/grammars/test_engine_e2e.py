"""Compiled matchers plugged into the real engine on SmolLM2 (CPU).

All requests run in one batch (one engine loop), which is both cheaper and a test
that constrained rows of different grammars and backends do not disturb each other.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from formcast.engine import SamplingParams
from formcast.grammars import Choice, JsonSchema, Regex, compile, fill_bitmasks

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "maxLength": 20}}}
ARRAY = {"type": "array", "minItems": 2, "maxItems": 4,
         "items": {"type": "integer", "minimum": 0, "maximum": 99}}
CITY = r"[A-Z][a-z]{2,8}, [0-9]{1,3}"
MOODS = ["positive", "negative", "neutral"]


def _prompt(engine, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)


@pytest.fixture(scope="module")
def outputs(smollm2_engine):
    engine = smollm2_engine
    tok, width = engine.tokenizer, engine.model.config.vocab_size
    person = "Alice is a 31 year old engineer from Lyon. Give her as JSON."
    requests = [  # (name, constraint, backend, prompt, sampling)
        ("person-xgrammar", JsonSchema(PERSON), "xgrammar", person, None),
        ("person-outlines", JsonSchema(PERSON), "outlines-core", person, None),
        ("city", Regex(CITY), "xgrammar", "Name a city and a number.", 0.8),
        ("mood", Choice(MOODS), "xgrammar", "Sentiment of: I love this phone.", 0.8),
        # xgrammar: its mask holds the item bounds (under outlines-core they are only
        # checked at the end, and a sampled 104 would dead-end the request)
        ("array", JsonSchema(ARRAY), "xgrammar", "List a few small integers.", 0.8),
    ]
    matchers, params, prompts = [], [], []
    for _, constraint, backend, text, temperature in requests:
        compiled = compile(constraint, tok, backend=backend, vocab_size=width)
        matchers.append(compiled.matcher())
        params.append(SamplingParams(max_tokens=128, temperature=0.0) if temperature is None
                      else SamplingParams(max_tokens=40, temperature=temperature, seed=7))
        prompts.append(_prompt(engine, text))
    outs = engine.generate(prompts, params, constraints=matchers)
    return {name: out for (name, *_), out in zip(requests, outs)}


@pytest.mark.parametrize("name", ["person-xgrammar", "person-outlines"])
def test_json_schema_output_parses_and_validates(outputs, name, smollm2_engine):
    out = outputs[name]
    assert out.finish_reason == "stop", out
    jsonschema.validate(json.loads(out.text), PERSON)
    assert out.token_ids[-1] in smollm2_engine.tokenizer.eos_token_ids


def test_sampled_regex_choice_and_array(outputs):
    assert all(outputs[n].finish_reason == "stop" for n in ("city", "mood", "array")), outputs
    assert re.fullmatch(CITY, outputs["city"].text)
    assert outputs["mood"].text in MOODS
    jsonschema.validate(json.loads(outputs["array"].text), ARRAY)


def test_batch_fill_is_usable_by_a_sampler(smollm2_engine):
    tok, width = smollm2_engine.tokenizer, smollm2_engine.model.config.vocab_size
    compiled = compile(JsonSchema(PERSON), tok, vocab_size=width)
    matchers = [compiled.matcher() for _ in range(3)]
    bitmask = compiled.allocate_bitmask(3)
    fill_bitmasks(matchers, bitmask)
    first = tok.encode("{", add_special_tokens=False)[0]
    assert all((int(bitmask[r, first >> 5]) >> (first & 31)) & 1 for r in range(3))


"""A compiled matcher plugged into the real engine on SmolLM2 (CPU)."""

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


def _prompt(engine, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)


@pytest.mark.parametrize("backend", ["xgrammar", "outlines-core"])
def test_json_schema_output_parses_and_validates(smollm2_engine, backend):
    engine = smollm2_engine
    compiled = compile(JsonSchema(PERSON), engine.tokenizer, backend=backend,
                       vocab_size=engine.model.config.vocab_size)
    prompt = _prompt(engine, "Alice is a 31 year old engineer from Lyon. Give her as JSON.")
    out = engine.generate([prompt], SamplingParams(max_tokens=128, temperature=0.0),
                          constraints=[compiled.matcher()])[0]
    assert out.finish_reason == "stop", out
    value = json.loads(out.text)
    jsonschema.validate(value, PERSON)
    assert out.token_ids[-1] in engine.tokenizer.eos_token_ids


def test_batch_of_constraints_with_sampling(smollm2_engine):
    engine = smollm2_engine
    tok, width = engine.tokenizer, engine.model.config.vocab_size
    constraints = [compile(Regex(r"[A-Z][a-z]{2,8}, [0-9]{1,3}"), tok, vocab_size=width),
                   compile(Choice(["positive", "negative", "neutral"]), tok, vocab_size=width),
                   compile(JsonSchema({"type": "array", "minItems": 2, "maxItems": 4,
                                       "items": {"type": "integer", "minimum": 0, "maximum": 99}}),
                           tok, vocab_size=width)]
    prompts = [_prompt(engine, "Name a city and a number."),
               _prompt(engine, "Sentiment of: I love this phone."),
               _prompt(engine, "List a few small integers.")]
    outs = engine.generate(prompts, SamplingParams(max_tokens=40, temperature=0.8, seed=7),
                           constraints=[c.matcher() for c in constraints])
    assert all(o.finish_reason == "stop" for o in outs), outs
    assert re.fullmatch(r"[A-Z][a-z]{2,8}, [0-9]{1,3}", outs[0].text)
    assert outs[1].text in ("positive", "negative", "neutral")
    value = json.loads(outs[2].text)
    assert 2 <= len(value) <= 4 and all(isinstance(v, int) for v in value)


def test_batch_fill_is_usable_by_a_sampler(smollm2_engine):
    tok, width = smollm2_engine.tokenizer, smollm2_engine.model.config.vocab_size
    compiled = compile(JsonSchema(PERSON), tok, vocab_size=width)
    matchers = [compiled.matcher() for _ in range(3)]
    bitmask = compiled.allocate_bitmask(3)
    fill_bitmasks(matchers, bitmask)
    first = tok.encode("{", add_special_tokens=False)[0]
    assert all((int(bitmask[r, first >> 5]) >> (first & 31)) & 1 for r in range(3))

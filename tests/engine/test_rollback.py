"""Dead ends a constraint can explain are backed out of, not failed: the engine rolls
the request back to the offending value (matcher, tokens, text, KV cache) and
samples again with the token that led there banned. Real model, real grammar."""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest

from formcast import grammars
from formcast.engine import SamplingParams

from .helpers import assert_logprobs_match_a_fresh_forward

pytestmark = pytest.mark.slow

# uniqueItems is checked when the array ends (the mask cannot enforce it), and the
# prompt makes greedy decoding repeat 7: every run meets the dead end at least once
SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
          "minItems": 4, "maxItems": 4, "uniqueItems": True}
PROMPT = "Output: [7,7,7,7]\nOutput: [7,7,7,7]\nOutput: "


@pytest.fixture
def engine(smollm2_engine, monkeypatch):
    def with_rollbacks(n: int, spec: str = "auto"):
        monkeypatch.setattr(smollm2_engine, "config", dataclasses.replace(
            smollm2_engine.config, max_constraint_rollbacks=n, spec=spec))
        return smollm2_engine
    return with_rollbacks


def matcher(engine):
    compiled = grammars.compile(grammars.JsonSchema(SCHEMA), engine.tokenizer,
                                vocab_size=engine.model.config.vocab_size)
    assert compiled.end_check is not None
    return compiled.matcher()


def prompt_ids(engine) -> list[int]:
    return engine.tokenizer.encode(PROMPT)


# "none" samples every position with the request's own matcher; "prompt_lookup"
# verifies drafts against masks filled ahead on a fork, and must still say why
@pytest.mark.parametrize("spec", ["none", "prompt_lookup"])
def test_without_rollbacks_the_end_check_dead_end_fails_with_the_reason(engine, spec):
    eng = engine(0, spec)
    out, = eng.generate([prompt_ids(eng)], SamplingParams(max_tokens=32, temperature=0.0),
                        constraints=[matcher(eng)])
    assert out.finish_reason == "abort"
    assert "dead end" in out.error and "non-unique" in out.error
    assert out.text == "[7,7,7,7]"


def test_rollback_resamples_the_offending_value_until_the_output_validates(engine):
    eng = engine(8)
    m = matcher(eng)
    out, = eng.generate([prompt_ids(eng)], SamplingParams(max_tokens=32, temperature=0.0),
                        constraints=[m])
    assert out.finish_reason == "stop" and out.error is None
    value = json.loads(out.text)
    jsonschema.validate(value, SCHEMA)
    assert value[0] == 7 and len(set(value)) == 4
    assert eng.tokenizer.decode(list(out.token_ids), skip_special_tokens=True) == out.text
    assert m.is_terminated()


def test_rolled_back_kv_cache_gives_the_logprobs_of_a_fresh_forward(engine):
    eng = engine(8)
    ids = prompt_ids(eng)
    out, = eng.generate([ids], SamplingParams(max_tokens=32, temperature=0.0, logprobs=0),
                        constraints=[matcher(eng)])
    assert out.finish_reason == "stop"
    assert_logprobs_match_a_fresh_forward(eng, ids, out)


def test_a_rollback_leaves_the_rest_of_the_batch_untouched(engine):
    eng = engine(8)
    tok = eng.tokenizer
    other = tok.apply_chat_template([{"role": "user", "content": "Name three fruits."}],
                                    add_generation_prompt=True, tokenize=True)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    alone, = eng.generate([other], params)
    both = eng.generate([prompt_ids(eng), other, prompt_ids(eng)], params,
                        constraints=[matcher(eng), None, matcher(eng)])
    assert both[1].token_ids == alone.token_ids
    assert both[0].text == both[2].text
    jsonschema.validate(json.loads(both[0].text), SCHEMA)


def test_rollbacks_are_bounded_and_the_error_says_how_many(engine, monkeypatch):
    eng = engine(1)
    out, = eng.generate([prompt_ids(eng)], SamplingParams(max_tokens=32, temperature=0.0),
                        constraints=[matcher(eng)])
    assert out.finish_reason == "abort"
    assert "non-unique" in out.error and "after 1 rollback" in out.error

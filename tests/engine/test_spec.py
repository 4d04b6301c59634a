"""Speculative decoding on the real model: greedy outputs identical with and without
it (free text, JSON extraction, regex, EBNF; batch 1 and 8), rejected drafts leave
no trace in the KV cache or the matcher, and the counters add up."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from formcast import grammars
from formcast.engine import Engine, EngineConfig, SamplingParams
from formcast.engine.speculative import SpecConfig

from .helpers import assert_logprobs_match_a_fresh_forward

pytestmark = pytest.mark.slow

TEXTS = [
    "John Smith is 42 years old and lives in Boston. He works as a nurse.",
    "The Acme X200 kettle costs 29.99 dollars and ships from Leeds.",
    "Maria Garcia, aged 31, moved to Madrid last spring to teach physics.",
    "Invoice INV-2291 from Northwind Ltd is due on 2025-03-14, total 1,250.00 EUR.",
]
SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "number", "place"],
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "number": {"type": "number"},
                         "place": {"type": ["string", "null"], "maxLength": 40}}}


@pytest.fixture(scope="module")
def own_engine(smollm2_engine):
    """The shared model in an engine of its own without prefix caching: KV reused from
    other tests' prompts (computed in other chunkings) would round differently and
    could flip a near-tied greedy choice in one run and not the other."""
    return Engine(smollm2_engine.model, smollm2_engine.tokenizer,
                  config=EngineConfig(num_kv_blocks=256, enable_prefix_caching=False))


@pytest.fixture
def engine(own_engine):
    def with_spec(spec):
        own_engine.config = dataclasses.replace(own_engine.config, spec=spec)
        return own_engine
    return with_spec


def chat(engine, text: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                add_generation_prompt=True, tokenize=True)


def constraint(engine, kind: str):
    make = {"json": lambda: grammars.JsonSchema(SCHEMA),
            "regex": lambda: grammars.Regex(r"[A-Z][a-z]+ [A-Z][a-z]+, \d{2} years"),
            "ebnf": lambda: grammars.Ebnf('root ::= "Name: " [A-Za-z ]{1,30} "\\nAge: " [0-9]+')}
    if kind == "text":
        return None
    return grammars.compile(make[kind](), engine.tokenizer,
                            vocab_size=engine.model.config.vocab_size).matcher()


def run(engine, spec, kind: str, batch: int, max_tokens: int = 40):
    eng = engine(spec)
    prompts = [chat(eng, f"Copy the key facts of this text: {t}")
               for t in (TEXTS * 2)[:batch]]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return eng.generate(prompts, params, constraints=[constraint(eng, kind)
                                                      for _ in prompts])


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("kind", ["text", "json", "regex", "ebnf"])
def test_greedy_outputs_are_identical_with_and_without_speculation(engine, kind, batch):
    plain = run(engine, "none", kind, batch)
    # every draft verified (not cost-scheduled): the comparison always exercises
    # verification, whatever step times this engine has measured so far
    spec = run(engine, SpecConfig(method="prompt_lookup", scheduled=False), kind, batch)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert [o.text for o in spec] == [o.text for o in plain]
    assert [o.finish_reason for o in spec] == [o.finish_reason for o in plain]
    assert all(o.metrics.num_draft_tokens == 0 for o in plain)
    assert sum(o.metrics.num_accepted_draft_tokens for o in spec) > 0


def test_counters_are_consistent(engine):
    for out in run(engine, "prompt_lookup", "json", 4):
        m = out.metrics
        assert 0 <= m.num_forced_tokens <= m.num_accepted_draft_tokens <= m.num_draft_tokens
        assert m.num_verification_tokens >= m.num_draft_tokens
        assert m.num_output_tokens >= m.num_accepted_draft_tokens


def test_rejected_drafts_leave_the_kv_cache_as_a_fresh_forward(engine):
    eng = engine("prompt_lookup")
    ids = chat(eng, f"Copy the key facts of this text: {TEXTS[3]}")
    out, = eng.generate([ids], SamplingParams(max_tokens=40, temperature=0.0, logprobs=0),
                        constraints=[constraint(eng, "json")])
    m = out.metrics
    assert m.num_accepted_draft_tokens < m.num_draft_tokens  # some drafts were rejected
    assert_logprobs_match_a_fresh_forward(eng, ids, out)


def test_rejected_drafts_leave_the_matcher_as_if_never_proposed(engine):
    eng = engine("prompt_lookup")
    ids = chat(eng, f"Copy the key facts of this text: {TEXTS[0]}")
    m = constraint(eng, "json")
    out, = eng.generate([ids], SamplingParams(max_tokens=12, temperature=0.0),
                        constraints=[m])
    assert out.finish_reason == "length" and out.metrics.num_draft_tokens > 0
    fresh = constraint(eng, "json")
    for tok in out.token_ids:
        assert fresh.accept(tok)
    masks = torch.zeros(2, (eng.model.config.vocab_size + 31) // 32, dtype=torch.int32)
    m.fill_bitmask(masks, 0)
    fresh.fill_bitmask(masks, 1)
    assert torch.equal(masks[0], masks[1])
    # and generation continued from both states agrees
    more = SamplingParams(max_tokens=20, temperature=0.0)
    a, = eng.generate([ids + list(out.token_ids)], more, constraints=[m])
    eng_plain = engine("none")
    b, = eng_plain.generate([ids + list(out.token_ids)], more, constraints=[fresh])
    assert a.token_ids == b.token_ids


def test_auto_drafts_only_forced_tokens_past_its_batch_limit(engine):
    """More requests than ``auto_max_batch``: "auto" still verifies the tokens the
    grammar forces (JSON keys and punctuation), guesses nothing, and every output
    is the one without speculation."""
    eng = engine("none")
    compiled = grammars.compile(grammars.JsonSchema(SCHEMA), eng.tokenizer,
                                vocab_size=eng.model.config.vocab_size)
    ps = [chat(eng, f"Extract name, number and place as JSON: {t}") for t in TEXTS] * 2
    ps.append(chat(eng, "Say something."))           # a free request in the same batch
    params = SamplingParams(max_tokens=60, temperature=0.0)

    def run(spec):
        return engine(spec).generate(ps, params,
                                     constraints=[compiled.matcher() for _ in TEXTS * 2] + [None])

    plain = run("none")
    # (every draft verified whole: how much of one a step verifies otherwise
    # depends on the step times measured, and so does the count of forced tokens)
    forced = run(SpecConfig(method="auto", auto_max_batch=4, scheduled=False))
    assert [o.token_ids for o in forced] == [o.token_ids for o in plain]
    assert sum(o.metrics.num_forced_tokens for o in forced) > 20
    assert forced[-1].metrics.num_draft_tokens == 0   # unconstrained: nothing guessed

"""Grounded numbers re-chosen whole: the fields, the choice, the engine's scores."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from pydantic import BaseModel

from formcast.completion import Completion, Usage
from formcast.errors import OutputValidationError
from formcast.extraction_numbers import number_fields, rechosen
from formcast.grammars.grounding import GroundingPlan

PLAN = GroundingPlan(numbers=frozenset({("servings",), ("price",), ("items", "*", "qty"),
                                        ("codes", "*")}),
                     integers=frozenset({("servings",), ("items", "*", "qty")}))
TEXT = "Serves 8, bake 175 minutes at 1,299.50 or 4.5 degrees; 8 again"


def test_fields_offer_each_value_the_text_writes_once_in_its_shortest_form():
    out = '{"servings":175,"price":4.5,"items":[{"qty":8}],"codes":[8],"name":"x"}'
    fields = {f.path: f for f in number_fields(out, TEXT, PLAN)}
    assert set(fields) == {("servings",), ("price",), ("items", 0, "qty")}  # no list items
    assert sorted(fields[("servings",)].choices) == ["175", "8"]            # integers only
    assert sorted(fields[("price",)].choices, key=float) == ["4.5", "8", "175", "1299.5"]
    f = fields[("servings",)]
    assert out[f.start:f.end] == "175"


@pytest.mark.parametrize("out", [
    '{"servings":5,"price":4.5}',       # the model's own number (the text has none 5)
    '{"servings":null,"price":null}',
    'not json',
])
def test_numbers_not_from_the_text_are_left_alone(out):
    assert [f.path for f in number_fields(out, TEXT, PLAN)] == \
        ([("price",)] if '"price":4.5' in out else [])


class Tok:
    """Characters as tokens."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class Scores:
    """An engine whose log-prob of a token is ``per_char[char]`` (default -1): the
    same at every position. Records what it scores."""

    def __init__(self, per_char):
        self.per_char = per_char
        self.scored = []

    def continuation_logprobs(self, prefixes, continuations):
        for prefix, conts in zip(prefixes, continuations):
            self.scored.append(("".join(map(chr, prefix[1:])),
                                ["".join(map(chr, c)) for c in conts]))
        return [[[self.per_char.get(chr(t), -1.0) for t in c] for c in conts]
                for conts in continuations]


def _completion(text: str, confidence=None) -> Completion:
    return Completion(text=text, token_ids=tuple(ord(c) for c in text), finish_reason="stop",
                      usage=Usage(prompt_tokens=1, completion_tokens=len(text),
                                  cached_prompt_tokens=0, latency_s=0.0,
                                  time_to_first_token_s=None),
                      value=json.loads(text), field_confidence=confidence)


def test_the_best_mean_log_prob_wins_and_is_written_in():
    engine = Scores({"8": -0.2, ",": -0.2, "}": -0.2})
    first = _completion('{"servings":175,"price":4.5}', {"/servings": -3.0, "/price": -0.1})
    got = rechosen([first], [[0]], [TEXT], PLAN, json.loads, Tok(), engine)[0]
    assert got.text == '{"servings":8,"price":8}'
    assert got.value == {"servings": 8, "price": 8}
    assert got.token_ids == tuple(ord(c) for c in got.text)
    assert got.field_confidence == {"/servings": -0.2, "/price": -0.2}
    # each field is scored after the output up to it, with the character after it
    assert engine.scored[0] == ('{"servings":', ["8,", "175,"])
    assert engine.scored[1][0] == '{"servings":175,"price":'
    assert sorted(engine.scored[1][1]) == ["1299.5}", "175}", "4.5}", "8}"]


def test_a_tie_keeps_the_current_value():
    engine = Scores({})     # every token -1: every mean the same
    first = _completion('{"servings":175}')
    assert rechosen([first], [[0]], [TEXT], PLAN, json.loads, Tok(), engine) == [first]


def test_a_choice_the_parser_rejects_keeps_the_output():
    def reject(text):
        raise OutputValidationError("no", text=text, error=None)

    first = _completion('{"servings":175}')
    got = rechosen([first], [[0]], [TEXT], PLAN, reject, Tok(), Scores({"8": -0.1}))
    assert got == [first]


def test_errors_and_unchanged_outputs_pass_through():
    err = OutputValidationError("bad", text="", error=None)
    same = _completion('{"servings":8}')
    got = rechosen([err, same], [[0], [0]], [TEXT, TEXT], PLAN, json.loads, Tok(),
                   Scores({"8": -0.1, "}": -0.1}))
    assert got[0] is err and got[1] is same


@pytest.mark.parametrize("budget", [None, 7])   # 7: in chunks, two continuations a pass
def test_engine_scores_continuations_as_a_whole_forward_does(smollm2_engine, monkeypatch,
                                                             budget):
    if budget:
        monkeypatch.setattr(smollm2_engine, "config", dataclasses.replace(
            smollm2_engine.config, max_num_batched_tokens=budget, max_num_seqs=2))
    tok = smollm2_engine.tokenizer
    prompt = tok.encode("Serves 8. Bake at 175 C for 40 minutes.\nServings: " * 3,
                        add_special_tokens=False)
    # (a finished request leaves the prompt's blocks in the prefix cache)
    smollm2_engine.generate([prompt[:40]], None)
    conts = [tok.encode(c, add_special_tokens=False) for c in ("8\n", "175\n", "40 minutes")]
    other = prompt[:30]     # (a second prefix in the same passes, partly cached)
    got = smollm2_engine.continuation_logprobs([prompt, other], [conts, conts[1:]])
    monkeypatch.undo()
    for prefix, cont, lps in [(prompt, c, lp) for c, lp in zip(conts, got[0])] + \
            [(other, c, lp) for c, lp in zip(conts[1:], got[1])]:
        full = smollm2_engine.forward_logits(prefix + cont)
        want = torch.log_softmax(full[len(prefix) - 1:-1], -1).gather(
            1, torch.tensor(cont)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(lps), want, atol=1e-4)
    assert smollm2_engine.block_manager.num_free_blocks == smollm2_engine.block_manager.num_blocks


class Recipe(BaseModel):
    title: str
    servings: int
    minutes: int


def test_extract_takes_the_number_the_model_scores_best_whole(llm):
    text = ("Classic Banana Bread\nServes: 8. Time: 70 minutes. Difficulty: easy.\n"
            "Mash three ripe bananas, stir in melted butter, sugar, one egg and flour, "
            "then bake at 175 °C.")
    got = llm.extract(text, Recipe, return_completions=True)
    assert (got.value.servings, got.value.minutes) == (8, 70)   # digit by digit: 175
    assert json.loads(got.text)["servings"] == 8

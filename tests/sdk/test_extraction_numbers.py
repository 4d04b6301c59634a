"""Grounded numbers re-chosen whole: the fields, the choice, the engine's scores."""

from __future__ import annotations

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


def _completion(text: str, confidence=None) -> Completion:
    return Completion(text=text, token_ids=tuple(ord(c) for c in text), finish_reason="stop",
                      usage=Usage(prompt_tokens=1, completion_tokens=len(text),
                                        cached_prompt_tokens=0, latency_s=0.0,
                                        time_to_first_token_s=None),
                      value=json.loads(text), field_confidence=confidence)


def test_the_best_mean_log_prob_wins_and_is_written_in():
    seen = []

    def score(prefix, conts):  # "8" best by its mean; "175" by its sum would lose too
        seen.append(("".join(map(chr, prefix[1:])), ["".join(map(chr, c)) for c in conts]))
        return [[-0.2, -0.2] if c[0] == ord("8") else [-1.0] * len(c) for c in conts]

    first = _completion('{"servings":175,"price":4.5}', {"/servings": -3.0, "/price": -0.1})
    got = rechosen([first], [[0]], [TEXT], PLAN, json.loads, Tok(), score)[0]
    assert got.text == '{"servings":8,"price":8}'
    assert got.value == {"servings": 8, "price": 8}
    assert got.token_ids == tuple(ord(c) for c in got.text)
    assert got.field_confidence == {"/servings": -0.2, "/price": -0.2}
    # each field is scored after the output up to it, with the character after it
    assert seen[0] == ('{"servings":', ["8,", "175,"])
    assert seen[1][0] == '{"servings":175,"price":' and "4.5}" in seen[1][1]


def test_a_choice_the_parser_rejects_keeps_the_output():
    def reject(text):
        raise OutputValidationError("no", text=text, error=None)

    first = _completion('{"servings":175}')
    got = rechosen([first], [[0]], [TEXT], PLAN, reject, Tok(),
                   lambda p, cs: [[-0.1] if c[0] == ord("8") else [-2.0] for c in cs])
    assert got == [first]


def test_errors_and_unchanged_outputs_pass_through():
    err = OutputValidationError("bad", text="", error=None)
    same = _completion('{"servings":8}')
    got = rechosen([err, same], [[0], [0]], [TEXT, TEXT], PLAN, json.loads, Tok(),
                   lambda p, cs: [[-0.1] if c[0] == ord("8") else [-2.0] for c in cs])
    assert got[0] is err and got[1] is same


def test_engine_scores_continuations_as_a_whole_forward_does(smollm2_engine):
    tok = smollm2_engine.tokenizer
    prompt = tok.encode("Serves 8. Bake at 175 C for 40 minutes.\nServings: " * 3,
                        add_special_tokens=False)
    # (a finished request leaves the prompt's blocks in the prefix cache)
    smollm2_engine.generate([prompt[:40]], None)
    conts = [tok.encode(c, add_special_tokens=False) for c in ("8\n", "175\n", "40 minutes")]
    got = smollm2_engine.continuation_logprobs(prompt, conts)
    for cont, lps in zip(conts, got):
        full = smollm2_engine.forward_logits(prompt + cont)
        want = torch.log_softmax(full[len(prompt) - 1:-1], -1).gather(
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

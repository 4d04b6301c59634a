"""The SDK's model object on the real SmolLM2 (free text, scoring, streaming, errors)."""

from __future__ import annotations

import pytest
import torch

import formcast
from formcast import Completion, ConstraintError, FormcastError, RequestError

pytestmark = pytest.mark.slow


def test_generate_renders_the_chat_template_and_reports_usage(llm):
    out = llm.generate("What is the capital of France?", max_tokens=20)
    assert isinstance(out, Completion)
    assert "Paris" in out.text and out.finish_reason == "stop"
    ids = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=True)
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == len(out.token_ids)
    assert out.usage.latency_s > 0 and out.value is None


def test_repr_names_model_device_dtype_and_quantization(llm):
    assert repr(llm) == f"LLM(model={llm.engine.name!r}, device=cpu, dtype=torch.float32)"
    llm.engine.quantization = "int4"
    try:
        assert repr(llm).endswith("dtype=torch.float32, quantization='int4')")
    finally:
        llm.engine.quantization = None


def test_raw_prompt_skips_the_template_and_system_is_prepended(llm):
    raw = llm.generate("The capital of France is", raw=True, max_tokens=3)
    assert raw.usage.prompt_tokens == len(llm.tokenizer.encode("The capital of France is"))
    sys_ids = llm.prompt_ids("Hi", system="Answer in French.")
    assert llm.tokenizer.decode(sys_ids).count("Answer in French.") == 1


def test_max_tokens_and_stop(llm):
    out = llm.generate("Count from one to ten in words.", max_tokens=5)
    assert out.finish_reason == "length" and out.usage.completion_tokens == 5
    full = llm.generate("Count from one to ten in words.", max_tokens=30).text
    word = full.split()[2]
    cut = llm.generate("Count from one to ten in words.", max_tokens=30, stop=word)
    assert word not in cut.text and cut.finish_reason == "stop"


def test_seeded_sampling_repeats(llm):
    a = llm.generate("Name a colour.", temperature=1.0, seed=11, max_tokens=12)
    b = llm.generate("Name a colour.", temperature=1.0, seed=11, max_tokens=12)
    assert a.token_ids == b.token_ids


def test_generate_batch_matches_single_calls_and_isolates_failures(llm):
    prompts = ["What is 2+2?", "Name a fruit.", "Say hello."]
    batch = llm.generate_batch(prompts, max_tokens=12)
    for p, out in zip(prompts, batch):
        assert out.token_ids == llm.generate(p, max_tokens=12).token_ids
    mixed = llm.generate_batch(["Say hi.", "x" * 40_000, "Say bye."], max_tokens=8)
    assert isinstance(mixed[0], Completion) and isinstance(mixed[2], Completion)
    assert isinstance(mixed[1], RequestError) and "context" in str(mixed[1])


def test_stream_text_deltas_join_to_the_generated_text(llm):
    deltas = list(llm.stream_text("Write one sentence about cats.", max_tokens=24))
    assert len(deltas) > 3
    assert "".join(deltas) == llm.generate("Write one sentence about cats.", max_tokens=24).text


def test_score_is_the_sum_of_token_logprobs(llm):
    prompt = "What is the capital of France?"
    scores = llm.score(prompt, ["Paris", "The capital of France is Paris."])
    base = llm.prompt_ids(prompt)
    cont = llm.tokenizer.encode("The capital of France is Paris.", add_special_tokens=False)
    logits = llm.engine.forward_logits(base + cont)
    lp = torch.log_softmax(logits, -1)
    expected = sum(lp[len(base) - 1 + i, t].item() for i, t in enumerate(cont))
    assert scores[1] == pytest.approx(expected, abs=1e-4)
    assert all(s < 0 for s in scores)


def test_choose_picks_the_likeliest_answer(llm):
    assert llm.choose("What is the capital of France? Answer with the city.",
                      ["Paris", "Madrid", "Tokyo"]) == "Paris"
    with pytest.raises(RequestError):
        llm.score("hi", [])


@pytest.mark.parametrize("prompt,kwargs,error,expect", [
    ("hi", dict(regex="a+", choices=["a", "b"]), ConstraintError,
     "at most one constraint, got ['choices', 'regex']"),
    ("hi", dict(json_schema='{"type": "object",'), ConstraintError,
     "json_schema is not valid JSON: Expecting property name enclosed in double quotes at "
     "line 1:19"),
    ("hi", dict(json_schema=42), ConstraintError, "json_schema must be a dict"),
    ("hi", dict(choices=["yes", "no", "yes"]), ConstraintError, "option 2 ('yes') repeats"),
    ("hi", dict(choices=[]), ConstraintError, "at least one option"),
    ("hi", dict(choices=3), ConstraintError, "sequence of strings, got int"),
    (None, {}, RequestError, "prompt must be a str or a list of chat messages (dicts with "
     "'role' and 'content'), got NoneType"),
    (42, dict(regex="a"), RequestError, "got int"),
])
def test_bad_arguments_are_typed_errors_naming_the_argument(llm, prompt, kwargs, error, expect):
    with pytest.raises(error) as info:
        llm.generate(prompt, max_tokens=4, **kwargs)
    assert expect in str(info.value)
    assert isinstance(info.value, ValueError)   # except ValueError code keeps working


def test_generate_batch_refuses_what_is_not_a_list_of_prompts(llm):
    with pytest.raises(RequestError, match="list of prompts"):
        llm.generate_batch(None)


def test_bad_sampling_parameters_are_typed_errors(llm):
    with pytest.raises(RequestError, match="max_tokens"):
        llm.generate("hi", max_tokens=0)
    with pytest.raises(FormcastError):
        llm.generate("hi", temperature=-1)


def test_load_unknown_model_says_what_is_known():
    with pytest.raises(formcast.ModelNotFoundError, match="smollm2"):
        formcast.load("definitely-not-a-model")

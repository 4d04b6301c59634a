"""Jump-forward at a request's start (``EngineConfig.jump_forward``): the tokens
a constrained request's grammar fixes before its first pick are appended to its
prompt's prefill, rather than decoded one step each."""

from __future__ import annotations

import json

import pytest
import torch

from formcast.engine import Engine, EngineConfig, SamplingParams
from formcast.engine.tuning import EngineTuning

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "year": {"type": "integer"}},
          "required": ["city", "year"], "additionalProperties": False}
QUESTIONS = ["Which city hosted the 1992 Olympics?", "Name a city in Peru and a year.",
             "Where was the first World Cup final played, and when?"]


def chat(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                add_generation_prompt=True, tokenize=True)


@pytest.fixture(scope="module")
def compiled(smollm2_engine):
    from formcast.grammars import JsonSchema, compile

    return compile(JsonSchema(SCHEMA), smollm2_engine.tokenizer,
                   vocab_size=smollm2_engine.model.config.vocab_size)


def variant(engine: Engine, **config) -> Engine:
    """An engine over ``engine``'s weights, jump-forward on unless ``config`` says
    (on the CPU it is off by default)."""
    config.setdefault("jump_forward", True)
    return Engine(engine.model, engine.tokenizer,
                  config=EngineConfig(num_kv_blocks=128, spec="none", **config),
                  device=engine.device)


def opening(compiled) -> list[int]:
    return compiled.matcher().forced_tokens()


def steps_of(engine: Engine, prompts, params, constraints) -> tuple[list, int]:
    """The outputs of ``prompts`` run to the end one ``step`` at a time, and the
    number of steps."""
    ids = [engine.add_request(p, sp, constraint=c)
           for p, sp, c in zip(prompts, params, constraints)]
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return [done[i] for i in ids], steps


def test_the_schemas_opening_is_taken_in_the_prefill(smollm2_engine, compiled):
    forced = opening(compiled)
    text = smollm2_engine.tokenizer.decode(forced)
    assert text == '{"city":"' and len(forced) >= 3
    prompts = [chat(smollm2_engine, q) for q in QUESTIONS]
    params = [SamplingParams(max_tokens=40, temperature=0.0)] * len(prompts)
    runs = {}
    for jump in (False, True):
        engine = variant(smollm2_engine, jump_forward=jump, async_scheduling=False)
        runs[jump] = steps_of(engine, prompts, params, [compiled.matcher() for _ in prompts])
    (without, steps_without), (with_, steps_with) = runs[False], runs[True]
    for a, b in zip(without, with_):
        assert b.text.startswith(text) and list(b.token_ids[:len(forced)]) == forced
        assert b.metrics.num_forced_tokens == len(forced) and a.metrics.num_forced_tokens == 0
        assert b.finish_reason == "stop" and set(json.loads(b.text)) == {"city", "year"}
        assert a.finish_reason == "stop" and set(json.loads(a.text)) == {"city", "year"}
    # the opening's steps are saved (the batch's longest answer sets the count)
    longest = max(len(o.token_ids) for o in with_)
    assert steps_with <= longest - len(forced) + 2 < steps_without


def test_a_short_budget_takes_part_of_the_opening_and_samples_the_rest(smollm2_engine,
                                                                       compiled):
    forced = opening(compiled)
    engine = variant(smollm2_engine)
    prompt = chat(smollm2_engine, QUESTIONS[0])
    for budget in (1, 2, len(forced), len(forced) + 1):
        out, = engine.generate([prompt], SamplingParams(max_tokens=budget, temperature=0.0),
                               constraints=[compiled.matcher()])
        # one token at least is sampled, under the mask
        assert len(out.token_ids) == budget and out.finish_reason == "length"
        assert out.metrics.num_forced_tokens == min(budget - 1, len(forced))
        assert list(out.token_ids[:budget - 1]) == forced[:budget - 1]
        assert '{"city":"'.startswith(out.text) or out.text.startswith('{"city":"')


def test_requests_with_stop_strings_or_logprobs_decode_their_opening(smollm2_engine, compiled):
    """Their opening's text is looked at token by token (stop strings) or its
    tokens' logprobs are owed: no jump-forward, outputs as without it."""
    prompt = chat(smollm2_engine, QUESTIONS[1])
    for params in (SamplingParams(max_tokens=30, temperature=0.0, stop=["}"]),
                   SamplingParams(max_tokens=30, temperature=0.0, logprobs=2)):
        outs = [variant(smollm2_engine, jump_forward=jump).generate(
            [prompt], params, constraints=[compiled.matcher()])[0] for jump in (False, True)]
        assert outs[0].token_ids == outs[1].token_ids and outs[1].metrics.num_forced_tokens == 0
        assert outs[1].text.startswith('{"city":"')


class _Plain:
    """A constraint with the protocol alone (no ``take_forced_tokens``); ``fail``:
    its ``forced_tokens`` raises."""

    def __init__(self, inner, fail: bool = False) -> None:
        self.inner, self.fail = inner, fail

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.inner.fill_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        return self.inner.accept(token_id)

    def rollback(self, num_tokens: int) -> None:
        self.inner.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def forced_tokens(self) -> list[int]:
        if self.fail:
            raise RuntimeError("grammar state lost")
        return self.inner.forced_tokens()

    def valid_prefix(self, draft: list[int]) -> int:
        return self.inner.valid_prefix(draft)


def test_a_constraint_without_the_hook_jumps_and_one_that_fails_ends_alone(smollm2_engine,
                                                                           compiled):
    forced = opening(compiled)
    engine = variant(smollm2_engine)
    prompts = [chat(smollm2_engine, q) for q in QUESTIONS]
    params = SamplingParams(max_tokens=40, temperature=0.0)
    plain, broken, ours = engine.generate(
        prompts, params, constraints=[_Plain(compiled.matcher()),
                                      _Plain(compiled.matcher(), fail=True), compiled.matcher()])
    assert list(plain.token_ids[:len(forced)]) == forced
    assert plain.metrics.num_forced_tokens == len(forced) and json.loads(plain.text)
    assert broken.finish_reason == "abort" and broken.token_ids == ()
    assert "constraint failed: RuntimeError: grammar state lost" in broken.error
    assert ours.metrics.num_forced_tokens == len(forced) and json.loads(ours.text)
    again, = engine.generate(prompts[2:], params, constraints=[compiled.matcher()])
    assert again.token_ids == ours.token_ids  # (the engine goes on)


def test_an_opening_holding_a_stop_token_is_decoded(smollm2_engine, compiled):
    """A caller's stop token among the opening's tokens: not jumped over (the
    constraint put back), the request stops at it as it does without jump-forward."""
    forced = opening(compiled)
    prompt = chat(smollm2_engine, QUESTIONS[2])
    params = SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=(forced[1],))
    outs = [variant(smollm2_engine, jump_forward=jump).generate(
        [prompt], params, constraints=[compiled.matcher()])[0] for jump in (False, True)]
    assert outs[0].token_ids == outs[1].token_ids and outs[1].finish_reason == "stop"
    assert outs[1].metrics.num_forced_tokens == 0


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_batch_jumps_forward_alike_in_every_scheduling(smollm2_engine, compiled, asynchronous,
                                                         monkeypatch):
    """A batch of 10 (pipelined steps when asynchronous; its first tokens go in
    flight), a free request among them: the outputs of synchronous steps."""

    tuning = EngineTuning(overlap_rows=1)
    prompts = [chat(smollm2_engine, f"{q} Answer {i}.") for i in range(3) for q in QUESTIONS]
    prompts.append(chat(smollm2_engine, "Say hello."))
    constraints = [compiled.matcher() for _ in prompts[:-1]] + [None]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    engine = variant(smollm2_engine, tuning=tuning, max_num_seqs=16, async_scheduling=asynchronous)
    outs = engine.generate(prompts, params, constraints=constraints)
    reference = variant(smollm2_engine, tuning=tuning, max_num_seqs=16, async_scheduling=False).generate(
        prompts, params, constraints=[c and compiled.matcher() for c in constraints])
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    forced = opening(compiled)
    assert all(list(o.token_ids[:len(forced)]) == forced for o in outs[:-1])
    assert outs[-1].metrics.num_forced_tokens == 0
    if asynchronous:
        assert engine.stats.num_pipelined_steps > 5


def test_on_the_cpu_the_opening_is_decoded_unless_asked(smollm2_engine, compiled):
    """The default (None) jumps forward on CUDA only: a CPU engine's greedy
    outputs stay those of decoding the opening token by token."""
    assert EngineConfig().jump_forward is None
    prompt = chat(smollm2_engine, QUESTIONS[0])
    params = SamplingParams(max_tokens=12, temperature=0.0)
    default, = variant(smollm2_engine, jump_forward=None).generate(
        [prompt], params, constraints=[compiled.matcher()])
    off, = variant(smollm2_engine, jump_forward=False).generate(
        [prompt], params, constraints=[compiled.matcher()])
    assert default.token_ids == off.token_ids and default.metrics.num_forced_tokens == 0

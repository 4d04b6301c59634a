"""End-to-end engine tests on the real SmolLM2-135M-Instruct weights (CPU, float32).

transformers' LlamaForCausalLM, loaded from the same GGUF, is the oracle.
"""

from __future__ import annotations

import json
import re
import time

import pytest
import torch

from formcast.engine import Engine, EngineConfig, SamplingParams
from formcast.engine.constraint import BatchAcceptor
from formcast.engine.errors import EngineError
from formcast.engine.tuning import EngineTuning
from formcast.errors import ModelNotFoundError, RequestError

from .helpers import AllowOnly, Scripted, count_word_risky

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Ünïcödé and 中文 and emoji 🎉 in one sentence:",
    "Extract the name and age: John Smith is 42 years old and lives in Boston.",
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


def chat(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                add_generation_prompt=True, tokenize=True)


def city_year_grammar(engine: Engine):
    """A JSON Schema object of a city and a year, compiled for ``engine``."""
    from formcast.grammars import JsonSchema, compile

    schema = {"type": "object", "properties": {"city": {"type": "string"},
                                               "year": {"type": "integer"}},
              "required": ["city", "year"], "additionalProperties": False}
    return compile(JsonSchema(schema), engine.tokenizer,
                   vocab_size=engine.model.config.vocab_size)


def variant(engine: Engine, **config) -> Engine:
    """Another engine over the same weights, with its own KV cache and config."""
    return Engine(engine.model, engine.tokenizer, config=EngineConfig(**config),
                  device=engine.device)


@pytest.mark.parametrize("text", PROMPTS)
def test_forward_logits_match_transformers(smollm2_engine, hf_smollm2, text):
    ids = smollm2_engine.tokenizer.encode(text)
    ours = smollm2_engine.forward_logits(ids)
    with torch.no_grad():
        ref = hf_smollm2(torch.tensor([ids])).logits[0].float()
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= 1e-3


def test_forward_logits_in_chunks_equals_one_pass(smollm2_engine):
    ids = chat(smollm2_engine, PROMPTS[3])
    chunked = variant(smollm2_engine, max_num_batched_tokens=7, num_kv_blocks=64)
    # float32 rounding only (logits are O(10); attention sums in a different order)
    assert (chunked.forward_logits(ids) - smollm2_engine.forward_logits(ids)).abs().max() <= 3e-4


def test_step_by_step_decode_matches_prefill(smollm2_engine):
    ids = chat(smollm2_engine, PROMPTS[0])
    out = smollm2_engine.generate([ids], SamplingParams(max_tokens=16, temperature=0.0,
                                                        logprobs=0, ignore_eos=True))[0]
    full = list(ids) + list(out.token_ids)
    ref = torch.log_softmax(smollm2_engine.forward_logits(full), dim=-1)
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(ref[len(ids) - 1 + i, tok].item(), abs=1e-4)
        assert tok == int(ref[len(ids) - 1 + i].argmax())


def test_greedy_generation_matches_transformers_generate(smollm2_engine, hf_smollm2):
    prompts = [chat(smollm2_engine, t) for t in PROMPTS[:3]]
    outs = smollm2_engine.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0))
    eos = sorted(smollm2_engine.eos_token_ids)
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf_smollm2.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                      eos_token_id=eos, pad_token_id=eos[0])
        assert list(out.token_ids) == ref[0, len(ids):].tolist()
        assert out.finish_reason in ("stop", "length")


def test_batch_of_16_gives_each_request_what_it_gives_alone(smollm2_engine):
    texts = [f"{t} (variant {i})" * (1 + i % 3) for i, t in enumerate(PROMPTS * 4)]
    prompts = [chat(smollm2_engine, t) for t in texts]
    assert len({len(p) for p in prompts}) > 4
    batch = smollm2_engine.generate(prompts, GREEDY)
    for ids, out in zip(prompts, batch):
        alone = smollm2_engine.generate([ids], GREEDY)[0]
        assert out.token_ids == alone.token_ids
        assert out.text == alone.text


def test_seeded_sampling_repeats_and_does_not_depend_on_the_batch(smollm2_engine):
    ids = chat(smollm2_engine, "Write one sentence about the sea.")
    sp = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=1234)
    first = smollm2_engine.generate([ids], sp)[0]
    again = smollm2_engine.generate([ids], sp)[0]
    assert first.token_ids == again.token_ids
    others = [chat(smollm2_engine, t) for t in PROMPTS]
    mixed = smollm2_engine.generate(others + [ids], [SamplingParams(max_tokens=20, temperature=1.0)]
                                    * len(others) + [sp])[-1]
    assert mixed.token_ids == first.token_ids
    other_seed = smollm2_engine.generate([ids], SamplingParams(max_tokens=20, temperature=0.9,
                                                               top_p=0.95, seed=99))[0]
    assert other_seed.token_ids != first.token_ids


def test_a_request_makes_its_generator_only_when_it_draws(smollm2_engine):
    """A request's torch.Generator, seeded with its seed, is made the first time a
    draw needs it: a greedy request never makes one. (Outside batch-invariant mode:
    in it, draws are keyed by seed and position and need no generator.)"""
    engine = variant(smollm2_engine, batch_invariant=False)
    ids = chat(engine, "Name a colour.")
    greedy = engine.add_request(ids, SamplingParams(max_tokens=6, temperature=0.0))
    drawn = engine.add_request(ids, SamplingParams(max_tokens=6, temperature=0.8, seed=4321))
    seqs = {rid: engine.output.requests[rid] for rid in (greedy, drawn)}
    assert not any(s.generator_made for s in seqs.values())
    while engine.has_unfinished_requests():
        engine.step()
    assert not seqs[greedy].generator_made
    assert seqs[drawn].generator_made
    assert seqs[drawn].generator.initial_seed() == 4321


def test_preemption_under_a_tiny_kv_budget_keeps_greedy_outputs(smollm2_engine):
    prompts = [chat(smollm2_engine, t) for t in PROMPTS * 2]
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = smollm2_engine.generate(prompts, sp)
    longest = max(len(p) for p in prompts) + 40
    tiny = variant(smollm2_engine, block_size=16, num_kv_blocks=-(-longest // 16) + 2)
    got = tiny.generate(prompts, sp)
    assert tiny.scheduler.num_preemptions > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]


def test_prefix_cache_hits_give_identical_outputs(smollm2_engine):
    system = "You are a precise extraction assistant. " * 8
    prompts = [smollm2_engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": t}], tokenize=True)
        for t in PROMPTS[:2]]
    eng = variant(smollm2_engine, num_kv_blocks=256)
    first = eng.generate(prompts[:1], GREEDY)[0]
    second = eng.generate(prompts[1:], GREEDY)[0]
    assert second.metrics.num_cached_prompt_tokens >= 64
    assert second.token_ids == smollm2_engine.generate(prompts[1:], GREEDY)[0].token_ids
    again = eng.generate(prompts[:1], GREEDY)[0]
    assert again.metrics.num_cached_prompt_tokens > 0 and again.token_ids == first.token_ids


def test_chunked_prefill_gives_identical_greedy_output(smollm2_engine):
    prompts = [chat(smollm2_engine, t) for t in PROMPTS]
    small = variant(smollm2_engine, max_num_batched_tokens=16)
    assert ([o.token_ids for o in small.generate(prompts, GREEDY)]
            == [o.token_ids for o in smollm2_engine.generate(prompts, GREEDY)])


def test_constraint_hook_restricts_every_token_and_terminates(smollm2_engine):
    tok = smollm2_engine.tokenizer
    digits = {tok.encode(str(d))[0] for d in range(10)}
    constraint = AllowOnly(digits, length=6)
    out = smollm2_engine.generate([chat(smollm2_engine, "Say hello.")], GREEDY,
                                  constraints=[constraint])[0]
    assert len(out.token_ids) == 6 and set(out.token_ids) <= digits
    assert out.text.isdigit() and out.finish_reason == "stop"
    assert constraint.accepted == list(out.token_ids)


def test_a_failing_constraint_fails_only_its_own_request(smollm2_engine):
    class Broken(AllowOnly):
        def accept(self, token_id):
            raise RuntimeError("matcher crashed")

    prompts = [chat(smollm2_engine, t) for t in PROMPTS[:3]]
    alone = smollm2_engine.generate(prompts, GREEDY)
    outs = smollm2_engine.generate(prompts, GREEDY, constraints=[None, Broken({5, 6}), None])
    assert outs[1].finish_reason == "abort" and "matcher crashed" in outs[1].error
    assert outs[0].token_ids == alone[0].token_ids and outs[2].token_ids == alone[2].token_ids
    assert not smollm2_engine.has_unfinished_requests()


def test_max_tokens_gives_length_and_stop_strings_cut_text(smollm2_engine):
    ids = chat(smollm2_engine, "Count from one to twenty in words, separated by commas.")
    out = smollm2_engine.generate([ids], SamplingParams(max_tokens=12, temperature=0.0,
                                                        ignore_eos=True))[0]
    assert len(out.token_ids) == 12 and out.finish_reason == "length"
    stop = out.text[len(out.text) // 2:][:3]
    cut = smollm2_engine.generate([ids], SamplingParams(max_tokens=12, temperature=0.0,
                                                        stop=(stop,)))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == out.text[:out.text.index(stop)]
    kept = smollm2_engine.generate([ids], SamplingParams(max_tokens=12, temperature=0.0, stop=(stop,),
                                                         include_stop_str_in_output=True))[0]
    assert kept.text == out.text[:out.text.index(stop) + len(stop)]


def test_stop_token_ids_and_eos_end_generation(smollm2_engine):
    ids = chat(smollm2_engine, "Say hi.")
    free = smollm2_engine.generate([ids], SamplingParams(max_tokens=64, temperature=0.0))[0]
    assert free.finish_reason == "stop" and free.token_ids[-1] in smollm2_engine.eos_token_ids
    assert "<|im_end|>" not in free.text
    third = free.token_ids[2]
    out = smollm2_engine.generate([ids], SamplingParams(max_tokens=64, temperature=0.0,
                                                        stop_token_ids=(third,)))[0]
    assert out.token_ids == free.token_ids[:3] and out.finish_reason == "stop"


def test_pipelined_decoding_caches_the_blocks_it_generates(smollm2_engine):
    """Blocks that decode steps fill are hashed for the prefix cache off the
    steps' path (deferred, then hashed while the host waits or a few a step):
    a follow-up whose prompt is the first turn's prompt and answer finds them,
    and while requests decode nothing is left unhashed for long."""
    eng = variant(smollm2_engine, async_scheduling=True, spec="none", num_kv_blocks=256,
                  block_size=16)
    prompt = chat(eng, PROMPTS[0])
    sp = SamplingParams(max_tokens=70, temperature=0.0, ignore_eos=True)
    eng.add_request(prompt, sp, request_id="first")
    backlog = []
    while eng.has_unfinished_requests():
        eng.step()
        backlog.append(eng.block_manager.num_deferred)
    assert eng.stats.num_pipelined_steps > 40 and max(backlog) <= 1
    first = eng.generate([prompt], sp)[0]
    follow = eng.generate([prompt + list(first.token_ids)], SamplingParams(max_tokens=1))[0]
    # every full block of prompt and answer but the last token's
    assert follow.metrics.num_cached_prompt_tokens == \
        (len(prompt) + len(first.token_ids) - 1) // 16 * 16
    assert eng.block_manager.num_deferred == 0


def test_finished_only_steps_give_the_same_final_outputs(smollm2_engine):
    """``step(finished_only=True)`` hands back only finished requests' outputs,
    the same ones plain steps end with; outputs are frozen and equal to the
    dataclass built field by field."""
    import dataclasses

    def run(finished_only: bool):
        eng = variant(smollm2_engine, async_scheduling=True, spec="none")
        for n in (3, 9, 5):
            eng.add_request(chat(eng, PROMPTS[0]),
                            SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        finals, seen = {}, []
        while eng.has_unfinished_requests():
            outs = eng.step(finished_only=finished_only)
            seen += outs
            finals.update((o.request_id, o) for o in outs if o.finished)
        return finals, seen

    plain, every = run(False)
    lean, only = run(True)
    assert all(o.finished for o in only) and len(only) == 3 < len(every)
    strip = lambda o: dataclasses.replace(o, metrics=None)  # (timings differ)
    assert {k: strip(o) for k, o in lean.items()} == {k: strip(o) for k, o in plain.items()}
    out = next(iter(lean.values()))
    assert out == type(out)(**{f.name: getattr(out, f.name) for f in dataclasses.fields(out)})
    assert out.metrics.num_output_tokens == len(out.token_ids)
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.text = "x"


def test_finished_only_steps_hand_back_aborted_requests(smollm2_engine):
    """An abort between steps shows in the next ``step(finished_only=True)``
    (a step where nothing ended hands back nothing), pipelined or not, and the
    other request runs on to its length."""
    for asynchronous in (True, False):
        eng = variant(smollm2_engine, async_scheduling=asynchronous, spec="none")
        sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        a = eng.add_request(chat(eng, PROMPTS[0]), sp)
        b = eng.add_request(chat(eng, PROMPTS[1]), sp)
        for _ in range(3):
            assert eng.step(finished_only=True) == []
        assert eng.abort_request(a)
        outs = eng.step(finished_only=True)
        assert [(o.request_id, o.finish_reason) for o in outs] == [(a, "abort")]
        rest = []
        while eng.has_unfinished_requests():
            rest += eng.step(finished_only=True)
        assert [(o.request_id, o.finish_reason, len(o.token_ids)) for o in rest] == \
            [(b, "length", 8)]


def test_abort_request_ends_it_and_keeps_the_others(smollm2_engine):
    eng = variant(smollm2_engine, num_kv_blocks=128)
    sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    a = eng.add_request(chat(eng, PROMPTS[0]), sp)
    b = eng.add_request(chat(eng, PROMPTS[1]), sp)
    for _ in range(3):
        eng.step()
    assert eng.abort_request(a) and not eng.abort_request("nope")
    finished = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished[a].finish_reason == "abort" and len(finished[a].token_ids) < 20
    assert finished[b].token_ids == eng.generate([chat(eng, PROMPTS[1])], sp)[0].token_ids
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


@pytest.mark.parametrize("prompt, params, match", [
    ([], None, "empty"),
    ([1] * 9000, None, "context"),
    ([1, 2, 10**9], None, "outside"),
    ("hello", None, "token ids"),
])
def test_bad_requests_raise_before_anything_is_queued(smollm2_engine, prompt, params, match):
    with pytest.raises(RequestError, match=match):
        smollm2_engine.add_request(prompt, params)
    assert not smollm2_engine.has_unfinished_requests()


def test_bad_prompt_in_a_batch_rejects_the_batch_before_any_work(smollm2_engine):
    good = chat(smollm2_engine, "hi")
    with pytest.raises(RequestError, match="prompt 1"):
        smollm2_engine.generate([good, []], GREEDY)
    assert not smollm2_engine.has_unfinished_requests()


def test_non_constraint_object_is_rejected(smollm2_engine):
    with pytest.raises(RequestError, match="LogitsConstraint"):
        smollm2_engine.add_request([1, 2, 3], GREEDY, constraint=object())


def test_unknown_model_name_is_a_typed_error():
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        Engine.from_pretrained("no-such-model")


def test_unknown_engine_option_is_a_type_error():
    with pytest.raises(TypeError, match="unknown engine option"):
        Engine.from_pretrained("smollm2", max_batch_size=3)


@pytest.mark.parametrize("damage", ["truncated", "random"])
def test_damaged_gguf_is_a_typed_error_naming_the_file(smollm2_gguf, tmp_path, damage):
    from formcast.errors import CorruptModelError

    bad = tmp_path / "broken.gguf"
    if damage == "truncated":
        with open(smollm2_gguf, "rb") as f:
            bad.write_bytes(f.read(1 << 20))
    else:
        bad.write_bytes(bytes(range(256)) * 64)
    with pytest.raises(CorruptModelError, match="broken.gguf"):
        Engine.from_pretrained(str(bad), device="cpu")


def test_masks_filled_during_the_forward_give_the_same_outputs(smollm2_engine):
    from formcast.grammars import JsonSchema, compile

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "year": {"type": "integer"}},
              "required": ["city", "year"], "additionalProperties": False}
    tok = smollm2_engine.tokenizer
    compiled = compile(JsonSchema(schema), tok, vocab_size=smollm2_engine.model.config.vocab_size)
    prompts = [chat(smollm2_engine, f"Give a city and a year as JSON ({i}).") for i in range(3)]
    greedy = SamplingParams(max_tokens=40, temperature=0.0)

    def run(overlap: bool) -> list[tuple[int, ...]]:
        engine = variant(smollm2_engine, overlap_masks=overlap, spec="none")
        ids = [engine.add_request(p, greedy, constraint=compiled.matcher()) for p in prompts]
        done = {}
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
        return [done[i].token_ids for i in ids]

    overlapped = run(True)
    assert overlapped == run(False)
    assert all(json.loads(tok.decode(list(t), skip_special_tokens=True)) for t in overlapped)


def test_num_threads_is_applied_and_checked(smollm2_engine):
    before = torch.get_num_threads()
    try:
        variant(smollm2_engine, num_threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="num_threads"):
            EngineConfig(num_threads=bad)


def test_async_scheduling_gives_the_synchronous_outputs(smollm2_engine, monkeypatch):
    """Steps launched with the last step's tokens still on the device (forced on
    here; the CPU has nothing to overlap, the bookkeeping is the same) give every
    request exactly its synchronous output: greedy, seeded sampling, a JSON
    constraint, a stop string, EOS, a request arriving mid-run (the pipeline
    drains and refills), one aborted mid-run, and ``max_tokens`` cut-offs. The
    constrained row's unmasked picks are checked on the accept thread while
    the step is sampled (a large batch's way, turned on here for one row)."""

    tuning = EngineTuning(overlap_rows=1)

    compiled = city_year_grammar(smollm2_engine)
    work = [  # (prompt, params, constraint?)
        (chat(smollm2_engine, "Name three colours."), SamplingParams(max_tokens=30, temperature=0.0), False),
        (chat(smollm2_engine, "Tell a story."), SamplingParams(max_tokens=25, temperature=0.8, seed=5), False),
        (chat(smollm2_engine, "A city and a year as JSON."), SamplingParams(max_tokens=40, temperature=0.0), True),
        (chat(smollm2_engine, "Count to ten."), SamplingParams(max_tokens=40, temperature=0.0, stop=("5",)), False),
        (chat(smollm2_engine, "Say hi."), SamplingParams(max_tokens=60, temperature=0.0), False),
        (chat(smollm2_engine, "Name a fruit."), SamplingParams(max_tokens=7, temperature=0.0), False),
    ]

    def run(asynchronous: bool):
        engine = variant(smollm2_engine, tuning=tuning, async_scheduling=asynchronous, spec="none")
        dropped = [0]
        assert (engine.pipeline is not None) == asynchronous
        if asynchronous:
            lane = engine.pipeline.lane
            drop = lane.drop_ahead
            lane.drop_ahead = lambda: (dropped.__setitem__(0, dropped[0] + (lane.ahead is not None)),
                                       drop())
        ids = [engine.add_request(p, sp, constraint=compiled.matcher() if c else None)
               for p, sp, c in work[:4]]
        victim = engine.add_request(chat(smollm2_engine, "Write a long poem."),
                                    SamplingParams(max_tokens=50, temperature=0.0))
        done, steps = {}, 0
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
            steps += 1
            if steps == 6:  # new requests while the pipeline runs
                ids += [engine.add_request(p, sp) for p, sp, _ in work[4:]]
            if steps == 9:
                assert engine.abort_request(victim)
        if asynchronous:
            assert engine.pipeline.inflight is None and engine.pipeline.lane.ahead is None
            assert engine.pipeline.accept.pool is not None
        assert (engine.stats.num_pipelined_steps > 20) == asynchronous
        # steps launched before the last one's tokens were appended (every pick
        # taken, none ending its request), and some dropped when rows changed
        assert (engine.stats.num_launched_ahead > 0) == asynchronous
        assert (dropped[0] > 0) == asynchronous
        return [(done[i].token_ids, done[i].text, done[i].finish_reason) for i in ids], done[victim]

    synchronous, _ = run(False)
    asynchronous, aborted = run(True)
    assert asynchronous == synchronous
    assert aborted.finish_reason == "abort" and aborted.token_ids
    reasons = [r for _, _, r in synchronous]; print([(t, r) for _, t, r in synchronous])
    assert "stop" in reasons and "length" in reasons
    assert json.loads(synchronous[2][1])["city"]



def test_pipelined_rows_ending_on_length_end_where_synchronous_ones_do(smollm2_engine,
                                                                       monkeypatch):
    """The pipelined steps check what every row's room and way of ending allow
    once per run of steps over the same rows (``Pipeline.room_of``), not row by
    row each step: rows whose budgets run out one after another, under a
    grammar or not, still end on exactly their ``max_tokens``."""

    tuning = EngineTuning(overlap_rows=1)
    compiled = city_year_grammar(smollm2_engine)
    budgets = [3, 4, 6, 9, 13, 14]

    def run(asynchronous: bool):
        engine = variant(smollm2_engine, tuning=tuning, async_scheduling=asynchronous, spec="none")
        quiet = []
        if asynchronous:
            room_of = engine.pipeline.room_of
            engine.pipeline.room_of = lambda seqs: quiet.append(room_of(seqs)) or quiet[-1]
        outs = engine.generate(
            [chat(smollm2_engine, f"Write {n} words about rivers.") for n in budgets],
            [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in budgets],
            constraints=[compiled.matcher() if i % 2 else None for i in range(len(budgets))])
        return [(o.token_ids, o.finish_reason) for o in outs], quiet

    synchronous, _ = run(False)
    asynchronous, rooms = run(True)
    assert asynchronous == synchronous
    assert [len(ids) for ids, _ in synchronous] == budgets
    assert any(r.quiet and r.tokens > 2 for r in rooms)  # (the shortcut served)
    assert any(r.tokens <= 2 for r in rooms)             # (and the row by row check)


def test_freeze_gc_moves_the_heap_out_of_the_collectors_way(smollm2_engine):
    """``freeze_gc`` (default on CUDA only) freezes what is alive once the engine is
    built; a CPU engine leaves the collector alone by default."""
    import gc

    before = gc.get_freeze_count()
    variant(smollm2_engine)
    assert gc.get_freeze_count() == before
    try:
        variant(smollm2_engine, freeze_gc=True)
        assert gc.get_freeze_count() > before
    finally:
        gc.unfreeze()


def test_pause_gc_keeps_the_collector_off_inside_generate_only(smollm2_engine):
    """``pause_gc`` (default on CUDA only): the cycle collector is off while
    ``generate`` runs, back on after it, even when it raises; a collector the
    caller turned off stays off; a CPU engine leaves it alone by default."""
    import gc

    seen = []
    prompt = chat(smollm2_engine, PROMPTS[0])
    sp = SamplingParams(max_tokens=3, temperature=0.0)

    def run(eng, fail=False):
        def spy(*args, **kwargs):  # (the model's forward, as a step runs it)
            seen.append(gc.isenabled())
            if fail:
                raise RuntimeError("spy")
            return execute(*args, **kwargs)
        execute = eng.runner.execute
        eng.runner.execute = spy
        try:
            return eng.generate([prompt], sp)
        finally:
            del eng.runner.execute  # (the class's again)

    run(variant(smollm2_engine, spec="none"))
    assert seen and all(seen) and gc.isenabled()
    paused = variant(smollm2_engine, spec="none", pause_gc=True)
    seen.clear()
    out = run(paused)[0]
    assert seen and not any(seen) and gc.isenabled() and out.finish_reason == "length"
    seen.clear()
    with pytest.raises(EngineError, match="spy"):
        run(paused, fail=True)
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:
        seen.clear()
        run(paused)
        assert not any(seen) and not gc.isenabled()
    finally:
        gc.enable()


def test_a_frozen_heap_is_handed_back_at_exit():
    """An engine that froze the heap unfreezes it at exit, so that extension
    modules counting their objects at shutdown (Triton's, through nanobind)
    report no leaks."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    script = """
import dataclasses, gc, torch
from formcast.engine import Engine, EngineConfig, load_tokenizer
from formcast.engine.loading import build_model
from formcast.engine.models.shapes import SHAPES, random_llama_weights
import triton.language
cfg = dataclasses.replace(SHAPES["smollm2-135m"], num_hidden_layers=1, hidden_size=32,
                          intermediate_size=32, num_attention_heads=1, num_key_value_heads=1,
                          head_dim=32)
model = build_model(cfg, random_llama_weights(cfg, seed=0), device=torch.device("cpu"),
                    dtype=torch.float32)
Engine(model, load_tokenizer("smollm2"), config=EngineConfig(freeze_gc=True, num_kv_blocks=16),
       device=torch.device("cpu"))
assert gc.get_freeze_count() > 0
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
    assert "leaked" not in done.stderr, done.stderr[-2000:]


def test_unmasked_greedy_picks_give_the_masked_outputs(smollm2_engine, monkeypatch):
    """Greedy constrained rows of pipelined steps take their unmasked argmax and
    the grammar checks it afterwards; a refused pick is sampled again under the
    mask from the same logits. The outputs are those of masked decoding, with
    and without the pipeline: for prompts whose answers follow the schema (picks
    taken) and for prose prompts (picks refused, then masks for good), with
    requests arriving mid-run so that the pipeline drains with refused picks in
    flight (resampled there and then). xgrammar matchers take their picks through
    the batch hook, outlines-core ones row by row. The picks are checked on the
    host before the step is sampled or (``overlap``, a large batch's way, forced
    here for a few rows) on the accept thread while every row is sampled; the
    masked rows' next masks then filled when sampled or (``async_fill``, many
    rows' way, forced here) ahead on the mask thread; or filled through the
    batch hook (the CUDA sampler's way), which fills one of the matchers that
    took the same text and copies its mask to the others."""
    from formcast.grammars import Regex, compile
    from formcast.grammars.backends.xgrammar import batch_fill as xgrammar_fill

    tok = smollm2_engine.tokenizer
    compiled = city_year_grammar(smollm2_engine)
    texts = ["Give a city and a year as JSON.", "Tell a story about a dog.",
             "Reply in JSON with a city and the year it was founded.", "Name three colours.",
             "What is the capital of France? Answer as JSON with city and year.",
             "Write a haiku."]
    greedy = SamplingParams(max_tokens=40, temperature=0.0)
    words = compile(Regex(r"[A-Z][a-z]+( [a-z]+)*\."), tok, backend="outlines-core",
                    vocab_size=smollm2_engine.model.config.vocab_size)

    def run(asynchronous: bool, unmasked: bool, overlap: bool = False, async_fill: bool = False,
            batch_fill: bool = False):
        tuning = EngineTuning(overlap_rows=1 if overlap else 10**9,
                              async_fill_rows=1 if async_fill else 10**9)
        engine = variant(smollm2_engine, async_scheduling=asynchronous, unmasked_greedy=unmasked,
                         spec="none", tuning=tuning)
        engine.sampler.batch_fill = batch_fill
        drained = []
        settle = engine.output.settle_on_host
        engine.output.settle_on_host = lambda *a: (drained.append(len(a[0])), settle(*a))
        engine.filled_ahead = []
        if asynchronous:
            take_begin = engine.pipeline.taker.begin
            engine.pipeline.taker.begin = lambda *a, **k: (
                taking := take_begin(*a, **k),
                engine.filled_ahead.append(taking.ahead is not None))[0]
        ids = [engine.add_request(chat(engine, t), greedy, constraint=compiled.matcher())
               for t in texts[:4]]
        ids.append(engine.add_request(chat(engine, "Name two rivers."), greedy,
                                      constraint=words.matcher()))
        done, steps = {}, 0
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
            steps += 1
            if steps in (4, 9):  # the pipeline drains
                ids.append(engine.add_request(chat(engine, texts[4 + (steps == 9)]), greedy,
                                              constraint=compiled.matcher()))
        return [(done[i].token_ids, done[i].finish_reason) for i in ids], engine, drained

    masked, _, _ = run(False, False)
    pipelined_masked, eng, _ = run(True, False)
    assert eng.stats.num_pipelined_steps > 10 and eng.stats.num_unmasked_picks == 0
    unmasked, eng, drained = run(True, True)
    assert eng.pipeline.accept.pool is None
    overlapped, eng, drained = run(True, True, overlap=True)
    assert eng.pipeline.accept.pool is not None and not any(eng.filled_ahead)
    # steps launched before the last one's tokens were appended
    assert eng.stats.num_launched_ahead > 10 and eng.pipeline.lane.ahead is None
    filled_ahead, ahead_eng, _ = run(True, True, overlap=True, async_fill=True)
    assert any(ahead_eng.filled_ahead)
    shared = []
    distinct = xgrammar_fill.distinct_states
    monkeypatch.setattr(xgrammar_fill, "distinct_states", lambda m: (
        out := distinct(m), shared.append(out[1] is not None))[0])
    batched, _, _ = run(True, True, overlap=True, async_fill=True, batch_fill=True)
    assert any(shared)  # (the fresh matchers of the first step at least)
    assert unmasked == overlapped == filled_ahead == batched == masked == pipelined_masked
    texts_out = [(tok.decode(list(t), skip_special_tokens=True), r) for t, r in masked]
    assert all(json.loads(t) for k, (t, r) in enumerate(texts_out) if r == "stop" and k != 4)
    assert re.fullmatch(r"[A-Z][a-z]+( [a-z]+)*\.", texts_out[4][0]), texts_out[4]
    assert eng.stats.num_unmasked_picks > 30
    assert 0 < eng.stats.num_refused_picks < eng.stats.num_unmasked_picks
    assert drained  # refused picks were in flight when the pipeline drained


def test_the_native_accept_worker_gives_the_synchronous_outputs(smollm2_engine, monkeypatch):
    """With ``native_accept`` (on the CPU too, when asked), a large batch's
    unmasked picks are checked by the native worker, with a free row among
    them and rows refused (then masked), ending and joining. Outputs equal
    synchronous masked decoding's, and no Python accept thread is started."""
    from formcast.grammars.backends.xgrammar import native as native_accept

    if native_accept.worker() is None:
        pytest.skip(reason=f"no native accept worker here: {native_accept.unavailable_reason()}")
    tuning = EngineTuning(overlap_rows=1)
    compiled = city_year_grammar(smollm2_engine)
    texts = ["Give a city and a year as JSON.", "Tell a story about a dog.",
             "Reply in JSON with a city and the year it was founded.", "Name three colours."]
    greedy = SamplingParams(max_tokens=32, temperature=0.0)

    def run(**config):
        engine = variant(smollm2_engine, tuning=tuning, spec="none", **config)
        ids = [engine.add_request(chat(engine, t), greedy, constraint=compiled.matcher())
               for t in texts]
        ids.append(engine.add_request(chat(engine, "Count to three."), greedy))
        done, steps = {}, 0
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
            steps += 1
            if steps == 6:  # (the pipeline drains)
                ids.append(engine.add_request(chat(engine, "What is the capital of Peru? "
                                                   "Answer as JSON."), greedy,
                                              constraint=compiled.matcher()))
        return [(done[i].token_ids, done[i].finish_reason) for i in ids], engine

    masked, _ = run(async_scheduling=False, unmasked_greedy=False)
    native, eng = run(async_scheduling=True, native_accept=True)
    assert native == masked
    assert eng.stats.num_native_accepts >= 5 and eng.pipeline.accept.pool is None
    assert 0 < eng.stats.num_refused_picks < eng.stats.num_unmasked_picks


def test_agreements_where_the_grammar_leaves_few_tokens_do_not_unmask(smollm2_engine,
                                                                     monkeypatch):
    """Rows masked since the model's first pick broke the grammar go back to
    unmasked picks only on agreements where the grammar left a wide choice. A
    small random-weights model writes `":` where a JSON key ends and again where
    its string value starts: counted there, a row due one agreement went unmasked
    at once and had its next pick (`":` inside the string) refused. With one
    agreement due after a refusal (the schedule before it was doubled, patched
    in here) the rule halves the refusals; the shipped schedule refuses no more
    than that. Outputs equal synchronous masked decoding's in every case."""
    from formcast.engine.pipeline import take as take_module
    from formcast.engine.pipeline.premask import Premasker
    from formcast.engine.sequence import Sequence

    tok = smollm2_engine.tokenizer
    model, compiled, prompts = _records_batch(tok, 8)
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    # (the rule for a string's closing quote left out: the next test's)
    monkeypatch.setattr(Premasker, "pick_closes_span", lambda self, seqs, seq, token: False)
    narrow = take_module.narrow_choice
    refused, seen, missed = (Sequence.pick_refused, Sequence.masked_pick_seen,
                             Sequence.masked_picks_missed)
    asked = []

    def refused_once(seq):  # (one agreement due after any refusal)
        refused(seq)
        seq.agreements_due = 1

    def seen_once(seq, agreed):
        seen(seq, agreed)
        if not agreed:
            seq.agreements_due = 1

    def missed_once(seqs):  # (a step's misses counted in one loop)
        seqs = list(seqs)
        missed(seqs)
        for seq in seqs:
            seq.agreements_due = 1

    def run(rule: bool, once: bool = False, **config):
        monkeypatch.setattr(take_module, "narrow_choice",
                            (lambda seq: asked.append(seq) or narrow(seq)) if rule
                            else (lambda seq: False))
        monkeypatch.setattr(Sequence, "pick_refused", refused_once if once else refused)
        monkeypatch.setattr(Sequence, "masked_pick_seen", seen_once if once else seen)
        monkeypatch.setattr(Sequence, "masked_picks_missed",
                            staticmethod(missed_once if once else missed))
        return _run_records(model, tok, compiled, prompts, greedy, **config)

    masked, _, _ = run(True, async_scheduling=False, unmasked_greedy=False)
    counted, refused_counted, _ = run(False, True, async_scheduling=True)
    asked.clear()
    ruled, refused_ruled, unmasked_ruled = run(True, True, async_scheduling=True)
    shipped, refused_shipped, _ = run(True, async_scheduling=True)
    assert counted == masked and ruled == masked and shipped == masked
    assert refused_counted >= 2 * len(prompts)  # (the opening's refusal of every row, twice)
    # fewer refusals, the rows still going back to unmasked picks, some of them taken
    assert refused_ruled < refused_counted and asked
    assert unmasked_ruled > refused_ruled
    assert refused_shipped <= refused_ruled


def test_agreements_where_few_tokens_are_allowed_leave_the_row_masked(smollm2_engine,
                                                                      monkeypatch):
    """A masked row whose pick agrees with its model's argmax where its constraint
    allows few tokens (``narrow_choice``) stays masked; where the choice is wide
    the agreement counts. Scripted per row from the tiny model's own argmaxes:
    its first pick is forced off its argmax (masked, one agreement due), the
    second position allows the argmax and one other token (an agreement, narrow),
    the third allows one token that is not the argmax, the rest everything.
    Counted at the second position, the row goes unmasked and its third pick is
    refused; with the rule it is not, and the row goes back to unmasked picks at
    the fourth. Outputs equal synchronous masked decoding's either way."""
    from formcast.engine.pipeline import take as take_module

    tok = smollm2_engine.tokenizer
    model, _, prompts = _records_batch(tok, 6)
    greedy = SamplingParams(max_tokens=12, temperature=0.0)

    def run(scripts, rule: bool = True, **config):
        if not rule:
            monkeypatch.setattr(take_module, "narrow_choice", lambda seq: False)
        engine = Engine(model, tok, config=EngineConfig(
            max_num_seqs=len(prompts), num_kv_blocks=256, spec="none", **config),
            device=torch.device("cpu"))
        outs = engine.generate(prompts, greedy, constraints=[Scripted(s) for s in scripts])
        monkeypatch.undo()
        return [list(o.token_ids) for o in outs], engine

    # the argmaxes after a first token forced off the model's own
    firsts = [[1 if t != 1 else 2] for t in (o[0] for o in run([[]] * len(prompts))[0])]
    after, _ = run([[{f[0]}] for f in firsts], async_scheduling=False, unmasked_greedy=False)
    other = [next(t for t in range(3, 100) if t not in o[:3]) for o in after]
    scripts = [[{f[0]}, {o[1], x}, {x}] for f, o, x in zip(firsts, after, other)]
    masked, _ = run(scripts, async_scheduling=False, unmasked_greedy=False)
    assert [o[:3] for o in masked] == [[f[0], a[1], x] for f, a, x in zip(firsts, after, other)]
    ruled, eng = run(scripts, async_scheduling=True)
    counted, eng_counted = run(scripts, rule=False, async_scheduling=True)
    assert ruled == masked and counted == masked
    assert eng_counted.stats.num_refused_picks == len(prompts)  # (the third pick of every row)
    assert eng.stats.num_refused_picks == 0
    assert eng.stats.num_unmasked_picks >= len(prompts) * 6  # (back to unmasked picks from the 4th)


def test_agreements_on_the_quote_that_ends_a_string_do_not_unmask(smollm2_engine,
                                                                   monkeypatch):
    """A masked row whose pick closes a JSON string stays masked for its next
    pick even where that agreement was the one it was due: the next pick is the
    schema's punctuation, which the agreement says nothing about. The tiny
    random-weights model closes the name's value with `:"`, agreeing with its
    mask, and (unmasked) picks `:"` again where the schema wants a comma: one
    refusal a row without the rule, none with it, the rows still going back to
    unmasked picks later; outputs equal synchronous masked decoding's."""
    from formcast.engine.pipeline.premask import Premasker

    tok = smollm2_engine.tokenizer
    model, compiled, prompts = _records_batch(tok, 16)
    greedy = SamplingParams(max_tokens=48, temperature=0.0)
    ends = Premasker.pick_closes_span

    def run(rule: bool, **config):
        monkeypatch.setattr(Premasker, "pick_closes_span",
                            ends if rule else (lambda self, seqs, seq, token: False))
        return _run_records(model, tok, compiled, prompts, greedy, **config)

    masked, _, _ = run(True, async_scheduling=False, unmasked_greedy=False)
    without, refused_without, _ = run(False, async_scheduling=True)
    ruled, refused_ruled, unmasked_ruled = run(True, async_scheduling=True)
    assert without == masked and ruled == masked
    assert refused_without >= len(prompts) and refused_ruled < refused_without // 4
    assert unmasked_ruled > 10 * len(prompts)  # (and the rows went back to unmasked picks)


@pytest.mark.parametrize("kind", ["json", "regex", "none"])
def test_premasking_watches_the_spans_its_constraints_close(smollm2_engine, kind):
    """Premasking asks each row's constraint which tokens may close a span and
    whether one does: a JSON Schema's matcher answers for its strings (tokens
    holding a double quote; of those, one that leaves the row's output, not its
    prompt, with an even number of unescaped quotes: a key's or a value's end,
    not an opening), counted on from where the last look stopped and afresh
    after tokens are taken back; a regex's matcher closes none, and a row
    without a constraint has no closing tokens at all."""
    from formcast.engine.pipeline import PipelineStats
    from formcast.engine.pipeline.premask import Premasker
    from formcast.grammars import JsonSchema, Regex, compile

    engine = smollm2_engine
    tok = engine.tokenizer
    premasker = Premasker(tok, EngineTuning(), PipelineStats())
    constraint = None if kind == "none" else compile(
        JsonSchema({"type": "object"}) if kind == "json" else Regex(".*"), tok).matcher()
    text = '{"name": "Bob \\"B\\" Lee", "city": "Oslo", "age": 4}'
    output = tok.encode(text, add_special_tokens=False)
    assert tok.decode(output) == text
    prompt = tok.encode('Say "hi" in JSON: "', add_special_tokens=False)  # (odd, ignored)
    seq = engine.intake.make(prompt, SamplingParams(max_tokens=64), constraint, None)
    risky = premasker.closers_for([seq])
    quote = tok.encode('"', add_special_tokens=False)[0]
    assert (quote in risky) == (kind != "none")
    assert tok.encode(" word", add_special_tokens=False)[0] not in risky
    got, want = [], []
    for i, token in enumerate(output):
        if token in risky:
            closes = tok.decode(output[:i + 1]).replace('\\"', "").count('"') % 2 == 0
            want += [closes and kind == "json"] * 2
            got.append(premasker.closes_span(seq, token, False))
        seq.token_ids.append(token)
        if token in risky:  # (asked again once appended: the same answer)
            got.append(premasker.closes_span(seq, token, True))
    assert got == want and (kind != "json" or True in got and False in got)
    if kind != "json":
        return
    # after the whole object the quote count is even, so a quote opens a string
    assert not premasker.closes_span(seq, quote, False)
    del seq.token_ids[len(prompt) + 2:]  # (taken back to '{"name': inside the key)
    closing = tok.encode('":', add_special_tokens=False)[0]
    assert closing in risky and premasker.closes_span(seq, closing, False)


@pytest.mark.parametrize("path", ["host", "thread", "native"])
def test_premasked_picks_give_the_masked_outputs(smollm2_engine, monkeypatch, path):
    """Premasking, forced on: a greedy constrained row whose unmasked pick is a
    risky token is masked for its next pick. The tiny random model writes one
    word over and over inside its strings, and `:"` where the schema forces
    `":"`; with that word counted risky too, rows are premasked after the host
    checked their picks (``host``), or as their picks land while the accept
    thread or the native worker checks them, their masks waiting for that
    check; a landed `:"` is then refused, its row's premasked pick void, and
    the row sampled again from the step before. Outputs equal synchronous
    masked decoding's, also when a request joins mid-run (the pipeline drains
    with premasked rows in flight) and another is aborted."""
    import collections

    from formcast.grammars.backends.xgrammar import native as native_accept

    if path == "native" and native_accept.worker() is None:
        pytest.skip(reason=f"no native accept worker here: {native_accept.unavailable_reason()}")
    tok = smollm2_engine.tokenizer
    model, compiled, prompts = _records_batch(tok, 12)
    greedy = SamplingParams(max_tokens=32, temperature=0.0)

    def run(**config):
        engine = Engine(model, tok, config=EngineConfig(max_num_seqs=12, num_kv_blocks=128,
                                                        spec="none", **config),
                        device=torch.device("cpu"))
        outs = engine.generate(prompts, greedy, constraints=[compiled.matcher() for _ in prompts])
        return [o.token_ids for o in outs], engine

    masked, _ = run(async_scheduling=False, unmasked_greedy=False)
    word = collections.Counter(t for out in masked for t in out).most_common(1)[0][0]
    count_word_risky(monkeypatch, word)
    tuning = EngineTuning(premask_after=0.0, overlap_rows=10**9 if path == "host" else 1)
    from formcast.engine.pipeline import pipeline as pipeline_module

    unpremask, voided = pipeline_module.unpremask, []

    def spied(refused, masked_rows, watched, agree):
        out = unpremask(refused, masked_rows, watched, agree)
        voided.append(len(out[0]) < len(masked_rows))
        return out

    monkeypatch.setattr(pipeline_module, "unpremask", spied)
    premasked, engine = run(async_scheduling=True, native_accept=path == "native", tuning=tuning)
    assert premasked == masked
    assert engine.stats.num_premasked_picks > 20 and engine.stats.num_refused_picks > 0
    if path != "host":
        assert any(voided)  # (a premasked row's landed pick refused)
    if path == "native":
        assert engine.stats.num_native_accepts > 5

    def interrupted(**config):  # a request joins (the pipeline drains), another is aborted
        engine = Engine(model, tok, config=EngineConfig(tuning=tuning, max_num_seqs=16,
                                                        num_kv_blocks=160, spec="none", **config),
                        device=torch.device("cpu"))
        ids = [engine.add_request(p, greedy, constraint=compiled.matcher()) for p in prompts]
        done, steps = {}, 0
        while engine.has_unfinished_requests():
            done.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
            steps += 1
            if steps == 9:
                ids.append(engine.add_request(prompts[0], greedy, constraint=compiled.matcher()))
            if steps == 14:
                assert engine.abort_request(ids[5])
        return [done[i] for k, i in enumerate(ids) if k != 5], engine

    reference, _ = interrupted(async_scheduling=False, unmasked_greedy=False)
    got, engine = interrupted(async_scheduling=True, native_accept=path == "native")
    assert got == reference and engine.stats.num_premasked_picks > 20


def test_premasked_rows_masks_wait_for_the_check_of_their_landed_picks(smollm2_engine):
    """A row premasked as its pick landed has its mask filled for the state after
    that pick: the fill waits for the accept thread's (or the native worker's)
    check, which moves its matcher, and for the mask thread's fill of the other
    masked rows, which reads the same matchers."""
    import threading
    from concurrent.futures import Future

    engine = variant(smollm2_engine, async_scheduling=True, spec="none")
    seen = []
    fill = engine.sampler.fill_masks
    engine.sampler.fill_masks = lambda seqs: (seen.append(waited.done()), fill(seqs))[1]
    for waited in (Future(), Future()):
        if not seen:
            engine.pipeline.premasker.wait = waited
        else:
            engine.pipeline.rows.masks_ahead = ([object()], waited)  # (for other rows: not what is asked)
        threading.Timer(0.05, waited.set_result, (None,)).start()
        engine.pipeline.rows.masks_for([])
    assert seen == [True, True]
    assert engine.pipeline.premasker.wait is None and engine.pipeline.rows.masks_ahead is None


def test_premasking_follows_how_the_model_does_after_a_risky_token(smollm2_engine,
                                                                    monkeypatch):
    """Premasking turns on once the picks after risky tokens mostly broke the
    grammar (a moving average over those picks, seen refused, or seen as a
    premasked row's masked pick that is not the model's argmax) and off once
    they mostly did not. The tiny random model repeats its word inside its
    strings: its pick after the word never breaks the grammar, so with the word
    counted risky premasking never turns on (and, forced on, turns itself off),
    the outputs the same."""
    import collections


    tok = smollm2_engine.tokenizer
    model, compiled, prompts = _records_batch(tok, 12)
    greedy = SamplingParams(max_tokens=32, temperature=0.0)

    def engine_for(**config):
        return Engine(model, tok, config=EngineConfig(max_num_seqs=12, num_kv_blocks=128,
                                                      spec="none", **config),
                      device=torch.device("cpu"))

    fresh = engine_for(async_scheduling=True)
    assert not fresh.pipeline.premasker.active()
    for _ in range(3):
        fresh.pipeline.premasker.seen(True)
    assert not fresh.pipeline.premasker.active()  # (a few misses are not yet the rule)
    for _ in range(3):
        fresh.pipeline.premasker.seen(True)
    assert fresh.pipeline.premasker.active()
    for _ in range(4):
        fresh.pipeline.premasker.seen(False)
    assert not fresh.pipeline.premasker.active()

    masked = engine_for(async_scheduling=False, unmasked_greedy=False).generate(
        prompts, greedy, constraints=[compiled.matcher() for _ in prompts])
    masked = [o.token_ids for o in masked]
    word = collections.Counter(t for out in masked for t in out).most_common(1)[0][0]
    count_word_risky(monkeypatch, word)
    tuning = EngineTuning(overlap_rows=1)
    for forced in (False, True):
        engine = engine_for(async_scheduling=True, tuning=tuning)
        if forced:
            engine.pipeline.premasker.rate = 1.0
        outs = engine.generate(prompts, greedy, constraints=[compiled.matcher() for _ in prompts])
        assert [o.token_ids for o in outs] == masked
        assert not engine.pipeline.premasker.active()
        if forced:  # (premasked until the agreements it saw brought the average down)
            assert 0 < engine.stats.num_premasked_picks < 40
        else:
            assert engine.stats.num_premasked_picks == 0 and engine.pipeline.premasker.rate == 0.0


def test_masked_picks_taken_on_known_text_masks_give_the_same_outputs(smollm2_engine,
                                                                     monkeypatch):
    """A batch's opening, every row masked while the schema forces its first text:
    once the masks of those texts are known (the first batch learns them), the
    rows' picks are judged by those masks' bits and their next masks are copies,
    xgrammar taking the tokens on the native worker. Outputs equal those of
    xgrammar judging every pick, and synchronous masked decoding's, with the
    masks filled row by row or through the batch hooks."""
    from formcast.grammars.backends.xgrammar import native as native_accept

    from tests.grammars.spies import known_mask_calls, tuned

    if native_accept.worker() is None:
        pytest.skip(reason=f"no native accept worker here: {native_accept.unavailable_reason()}")
    tok = smollm2_engine.tokenizer
    model, compiled, prompts = _records_batch(tok, 12)
    greedy = SamplingParams(max_tokens=20, temperature=0.0)
    known = known_mask_calls(monkeypatch)
    # (known_min_rows 8: the opening's 12 rows go by the known masks)
    by_text = {on: tuned(compiled, text_masks=on, known_min_rows=8) for on in (False, True)}

    def run(text_masks: bool, batch_fill: bool = False, **config):
        compiled = by_text[text_masks]
        engine = Engine(model, tok, config=EngineConfig(max_num_seqs=12, num_kv_blocks=128,
                                                        spec="none", **config),
                        device=torch.device("cpu"))
        engine.sampler.batch_fill = batch_fill
        known.clear()
        outs = engine.generate(prompts, greedy, constraints=[compiled.matcher() for _ in prompts])
        return [o.token_ids for o in outs]

    masked = run(False, async_scheduling=False, unmasked_greedy=False)
    assert run(False, async_scheduling=True) == masked and not any(known)
    for batch_fill in (False, True):
        assert run(True, batch_fill, async_scheduling=True) == masked
        assert sum(known) > len(known) // 2  # (most steps: the opening forces text)
    assert by_text[True].grammar.text_masks.slots


def test_steps_launched_ahead_give_the_synchronous_outputs(smollm2_engine, monkeypatch):
    """Once the accept thread's verdicts on a step's unmasked picks are in, the
    pipeline samples the refused rows again, sends the step's tokens to the host
    and launches the step after, all before appending the taken tokens; the
    next step takes that launch. Outputs equal synchronous masked decoding's,
    for JSON prompts (picks taken) and prose prompts under the same schema
    (picks refused, sampled again in that order), and the process's GIL switch
    interval, lowered while the accept thread works, is back afterwards."""
    import sys


    tuning = EngineTuning(overlap_rows=1)
    compiled = city_year_grammar(smollm2_engine)
    texts = ["Give a city and a year as JSON.", "Tell a story about a dog.",
             "Reply in JSON with a city and the year it was founded.", "Write a haiku."]
    greedy = SamplingParams(max_tokens=30, temperature=0.0)
    interval = sys.getswitchinterval()

    def run(asynchronous: bool):
        engine = variant(smollm2_engine, tuning=tuning, async_scheduling=asynchronous, spec="none",
                         unmasked_greedy=asynchronous)
        counts = {"ahead_with_refused": 0, "lowered": 0}
        if not asynchronous:
            outs = engine.generate([chat(engine, t) for t in texts], greedy,
                                   constraints=[compiled.matcher() for _ in texts])
            return [(o.token_ids, o.finish_reason) for o in outs], counts, engine
        launch = engine.pipeline.launch_sampled
        switches = engine.pipeline.accept.quick_switches

        def counted(prev, rows, logits, picked, ok, refused, finishes, filled=None, **kw):
            counts["ahead_with_refused"] += filled is not None and bool(refused)
            return launch(prev, rows, logits, picked, ok, refused, finishes, filled=filled, **kw)

        def watched(on):
            switches(on)
            counts["lowered"] += sys.getswitchinterval() < interval

        engine.pipeline.launch_sampled = counted
        engine.pipeline.accept.quick_switches = watched
        outs = engine.generate([chat(engine, t) for t in texts], greedy,
                               constraints=[compiled.matcher() for _ in texts])
        assert engine.pipeline.lane.ahead is None and sys.getswitchinterval() == interval
        return [(o.token_ids, o.finish_reason) for o in outs], counts, engine

    synchronous, _, _ = run(False)
    pipelined, counts, engine = run(True)
    assert pipelined == synchronous
    assert counts["ahead_with_refused"] > 0 and counts["lowered"] > 5
    assert engine.stats.num_refused_picks > 0 and engine.stats.num_launched_ahead > 5


def test_an_ordinary_step_between_pipelined_runs_leaves_no_stale_room(smollm2_engine,
                                                                      monkeypatch):
    """A request that ends at its prefill puts one ordinary step between two
    pipelined runs over the same rows, a token a row the pipeline does not
    count: the rows' room is found again after it, so no row whose token in
    flight is its last is launched again, and the step after a row that
    reaches the end of its context is never staged (with CUDA graphs, a block
    past the staging tables). Outputs are the synchronous ones."""
    import types

    from formcast.engine.cuda_graph import DecodeStaging

    tuning = EngineTuning(overlap_rows=1)
    tok = smollm2_engine.tokenizer
    every = set(range(tok.vocab_size))
    prompts = [tok.encode("word " * n, add_special_tokens=False)[:n] for n in (30, 20)]
    long = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=1, temperature=0.0)

    def run(asynchronous: bool):
        engine = variant(smollm2_engine, tuning=tuning, async_scheduling=asynchronous, spec="none",
                         max_model_len=64)
        bs = engine.config.block_size
        staging = DecodeStaging(8, -(-64 // bs), block_size=bs, scratch_slot=0, pin=False)
        engine.runner.stage_decode_ahead = types.MethodType(  # (as the graphs stage it)
            lambda runner, seqs: (staging.stage_seqs(seqs, 8, ahead=1), True)[1], engine.runner)
        late = []
        execute = engine.runner.execute_decode

        def launched(seqs, tokens, **kw):
            if engine.pipeline.inflight is not None:  # (pipelined: each row's token is in flight)
                late.extend(s.request_id for s in seqs if len(s.token_ids) + 1 >= s.max_total_len)
            return execute(seqs, tokens, **kw)

        engine.runner.execute_decode = launched
        ids = [engine.add_request(p, long, constraint=AllowOnly(every)) for p in prompts]
        done, steps = {}, 0
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
            steps += 1
            if steps == 5:
                ids.append(engine.add_request(tok.encode("hi", add_special_tokens=False), short))
        return [(done[i].token_ids, done[i].finish_reason) for i in ids], late, engine

    synchronous, _, _ = run(False)
    pipelined, late, engine = run(True)
    assert pipelined == synchronous and not late
    assert [r for _, r in pipelined] == ["length"] * 3
    assert engine.stats.num_pipelined_steps > 20 and engine.stats.num_launched_ahead > 5


def test_a_masked_pick_that_is_not_the_models_argmax_starts_the_pipeline_masked(smollm2_engine):
    """A greedy constrained request's first pick (masked, in an ordinary step)
    is compared with the model's unmasked argmax: where they differ (a prose
    prompt under a JSON Schema) the request enters the pipeline masked rather
    than losing a step to a refused pick; where they agree (a prompt that asks
    for that JSON) unmasked. Outputs are those of masked decoding either way."""
    from formcast.grammars import JsonSchema, compile

    schema = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"], "additionalProperties": False}
    tok = smollm2_engine.tokenizer
    compiled = compile(JsonSchema(schema), tok, vocab_size=smollm2_engine.model.config.vocab_size)
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    prompts = {"prose": chat(smollm2_engine, "Tell a story about a dog."),
               "json": chat(smollm2_engine, 'Reply with only this JSON: {"city": "Paris"}')}
    first, outputs = {}, {}
    for unmasked in (True, False):
        engine = variant(smollm2_engine, async_scheduling=True, unmasked_greedy=unmasked,
                         spec="none")
        rids = {k: engine.add_request(p, greedy, constraint=compiled.matcher())
                for k, p in prompts.items()}
        engine.step()  # prefill: each request's first token, masked
        if unmasked:
            first = {k: (engine.output.requests[r].output_ids[0], engine.output.requests[r].masked)
                     for k, r in rids.items()}
        done = {}
        while engine.has_unfinished_requests():
            done.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
        outputs[unmasked] = {k: done[r] for k, r in rids.items()}
    assert first["prose"][1] is True and first["json"][1] is False
    assert tok.decode([first["json"][0]]).startswith("{")
    assert outputs[True] == outputs[False]


def test_a_large_batchs_first_tokens_go_in_flight_as_an_ordinary_step_picks_them(
        smollm2_engine):
    """A batch of at least ``_FIRST_IN_FLIGHT_ROWS`` requests, every one running:
    its first step leaves the sampled tokens in flight (no output yet; the next
    step launches on them, then takes them) rather than taking them on the host.
    Each constrained row's first pick is masked and watched for agreement as the
    ordinary step's is: prose prompts under a JSON Schema go on masked, prompts
    that ask for the JSON unmasked. Every output is the synchronous engine's:
    greedy under the schema, seeded sampling, a stop string, ``max_tokens=1``
    (its token in flight is its last) and EOS."""
    from formcast.grammars import JsonSchema, compile

    schema = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"], "additionalProperties": False}
    compiled = compile(JsonSchema(schema), smollm2_engine.tokenizer,
                       vocab_size=smollm2_engine.model.config.vocab_size)
    greedy = SamplingParams(max_tokens=14, temperature=0.0)
    prose = [chat(smollm2_engine, f"Tell a story about a {pet}.") for pet in ("dog", "cat", "fox")]
    asks = [chat(smollm2_engine, f'Reply with only this JSON: {{"city": "{c}"}}')
            for c in ("Paris", "Rome", "Oslo")]
    work = [(p, greedy, True) for p in prose + asks] + [
        (chat(smollm2_engine, "Count to ten."),
         SamplingParams(max_tokens=30, temperature=0.0, stop=(" help",)), False),
        (chat(smollm2_engine, "Tell a story."),
         SamplingParams(max_tokens=20, temperature=0.8, seed=3), False),
        (chat(smollm2_engine, "Name a fruit."), SamplingParams(max_tokens=1, temperature=0.0), False),
        (chat(smollm2_engine, "Say hi."), SamplingParams(max_tokens=60, temperature=0.0), False),
    ]
    assert len(work) >= EngineTuning().first_in_flight_rows

    def run(asynchronous: bool):
        engine = variant(smollm2_engine, async_scheduling=asynchronous, spec="none")
        ids = [engine.add_request(p, sp, constraint=compiled.matcher() if c else None)
               for p, sp, c in work]
        first = engine.step()
        if asynchronous:  # (in flight: taken by the next step, which launches first)
            assert first == [] and engine.pipeline.inflight is not None
            first = engine.step()
            assert engine.stats.num_pipelined_steps == 1
        else:
            assert engine.pipeline is None
        assert sorted(o.request_id for o in first) == sorted(ids)
        seqs = [engine.output.requests[r] for r in ids[:6]]
        assert all(len(s.output_ids) == 1 for s in seqs)
        masked = [s.masked for s in seqs]
        done = {o.request_id: o for o in first if o.finished}
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
        return [(done[r].token_ids, done[r].text, done[r].finish_reason) for r in ids], masked

    synchronous, _ = run(False)
    pipelined, masked = run(True)
    assert masked == [True] * 3 + [False] * 3
    assert pipelined == synchronous
    reasons = [r for _, _, r in synchronous]
    assert reasons[6] == "stop" and synchronous[6][1].endswith("I'm here to")
    assert reasons[8] == "length" and len(synchronous[8][0]) == 1
    assert reasons[9] == "stop" and synchronous[9][0][-1] in smollm2_engine.eos_token_ids
    assert all(t.startswith('{"city"') for _, t, _ in synchronous[3:6])


def test_requests_aborted_or_arriving_while_a_batchs_first_tokens_are_in_flight(
        smollm2_engine):
    """A request aborted while its batch's first tokens are in flight ends with no
    token (its output went out with the abort), one arriving then waits for the
    pipeline to drain; every other request gets its synchronous output."""

    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    prompts = [chat(smollm2_engine, f"Name {k} animals.") for k in range(2, 12)]
    assert len(prompts) >= EngineTuning().first_in_flight_rows

    def run(asynchronous: bool):
        engine = variant(smollm2_engine, async_scheduling=asynchronous, spec="none")
        ids = [engine.add_request(p, greedy) for p in prompts]
        done = {o.request_id: o for o in engine.step() if o.finished}
        assert (engine.pipeline is not None and engine.pipeline.inflight is not None) == asynchronous
        gone = engine.abort_request(ids[3])
        late = engine.add_request(chat(smollm2_engine, "Name a colour."), greedy)
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
        return {r: (o.token_ids, o.finish_reason) for r, o in done.items()}, ids, late, gone

    synchronous, ids, late, gone = run(False)
    pipelined, ids_p, late_p, gone_p = run(True)
    assert gone and gone_p and pipelined[ids_p[3]] == ((), "abort")
    keep = [i for i in range(len(prompts)) if i != 3]
    assert [pipelined[ids_p[i]] for i in keep] == [synchronous[ids[i]] for i in keep]
    assert pipelined[late_p] == synchronous[late] and len(synchronous[late][0]) > 0


def test_rows_whose_first_tokens_went_in_flight_are_found_quiet_once_they_took_them(
        smollm2_engine):
    """The pipelined steps' check of every row's room and way of ending, found
    once per run of steps (``Pipeline.room_of``), is found again once the rows
    whose first tokens went in flight took them: rows that end on their length
    only then append their tokens plainly (``quiet``) for the rest of the run."""

    engine = variant(smollm2_engine, async_scheduling=True, spec="none")
    for i in range(EngineTuning().first_in_flight_rows):
        engine.add_request(chat(smollm2_engine, f"Count to {i + 3}."),
                           SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.step()
    engine.step()  # (takes the first tokens: no row is quiet before it)
    assert engine.pipeline.room is not None and not engine.pipeline.room.quiet
    engine.step()
    assert engine.pipeline.room.quiet and engine.stats.num_pipelined_steps == 2


@pytest.mark.parametrize("masked", [False, True])
def test_a_prepared_batch_acceptor_serves_the_accept_thread_step_after_step(smollm2_engine,
                                                                           monkeypatch, masked):
    """A constraint class's ``batch_acceptor`` hook is prepared once for the rows
    the accept thread checks while they stay the same, and called every step:
    the outputs are those of the class without the hook. So is it for the rows
    sampled under their masks (``masked``: every step, ``unmasked_greedy`` off),
    whose tokens the host's take offers. A hook that raises, when prepared or
    when called, fails only its own requests, with its error."""

    tuning = EngineTuning(overlap_rows=1)
    made, calls = [0], [0]

    class Prepared(AllowOnly):
        @staticmethod
        def batch_acceptor(constraints):
            made[0] += 1

            def accept(tokens):
                calls[0] += 1
                return [int(c.accept(t)) for c, t in zip(constraints, tokens)]
            return accept

    class BreaksWhenPrepared(AllowOnly):
        @staticmethod
        def batch_acceptor(constraints):
            raise RuntimeError("no batch today")

    class BreaksWhenCalled(AllowOnly):
        @staticmethod
        def batch_acceptor(constraints):
            def accept(tokens):
                raise RuntimeError("grammar service down")
            return accept

    texts = ("Name a fruit.", "Say hi.", "Count to three.")
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    # only lower-case ascii letters and spaces: some unmasked picks are refused
    letters = {t for t in range(smollm2_engine.tokenizer.vocab_size)
               if (text := smollm2_engine.tokenizer.decode([t])) and
               all(c == " " or "a" <= c <= "z" for c in text)}

    def run(cls):
        engine = variant(smollm2_engine, tuning=tuning, async_scheduling=True, spec="none",
                         unmasked_greedy=not masked)
        ids = [engine.add_request(chat(engine, t), greedy, constraint=cls(letters))
               for t in texts]
        done = {}
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
        return [done[i] for i in ids], engine

    class Subsets(AllowOnly):
        """A hook whose preparation makes its parts (some of the rows) itself."""

        @staticmethod
        def batch_acceptor(constraints):
            made[0] += 1

            class Accept(BatchAcceptor):
                def __call__(self, tokens):
                    calls[0] += 1
                    return [int(c.accept(t)) for c, t in zip(constraints, tokens)]

                def subset(self, index):
                    parts[0] += 1
                    return Prepared.batch_acceptor([constraints[i] for i in index])
            return Accept()

    want, _ = run(AllowOnly)
    got, engine = run(Prepared)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert calls[0] >= 5 and made[0] < calls[0]
    parts = [0]
    got, _ = run(Subsets)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    if not masked:  # (rows masked since a refused pick: the others' picks are a part)
        assert parts[0] > 0
    assert engine.stats.num_pipelined_steps >= 5
    assert (engine.stats.num_unmasked_picks == 0) if masked else engine.stats.num_refused_picks > 0
    for cls, error in ((BreaksWhenPrepared, "no batch today"),
                       (BreaksWhenCalled, "grammar service down")):
        engine = variant(smollm2_engine, tuning=tuning, async_scheduling=True, spec="none",
                         unmasked_greedy=not masked)
        broken = [engine.add_request(chat(engine, t), greedy, constraint=cls(letters))
                  for t in texts[:2]]
        plain = engine.add_request(chat(engine, texts[2]), greedy)
        done = {}
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
        for rid in broken:
            assert done[rid].finish_reason == "abort" and error in done[rid].error
        alone = smollm2_engine.generate([chat(engine, texts[2])], greedy)[0]
        assert done[plain].finish_reason == "length"
        assert done[plain].token_ids == alone.token_ids


@pytest.mark.parametrize("overlap", [False, True])
def test_a_failing_batch_accept_hook_fails_only_its_requests(smollm2_engine, monkeypatch,
                                                              overlap):
    """Unmasked picks of a constraint class with an ``accept_tokens`` hook go to
    the hook in one call; when it raises, its requests end with the error and
    everything else runs to the end, with the same tokens as alone. So does a
    request whose refused pick cannot be sampled again because its constraint
    fails to fill its mask. ``overlap``: the picks are checked on the accept
    thread while the next step is sampled (forced on for these few rows), the
    failed resample's row dropped from the step in flight."""

    class Hooked(AllowOnly):
        @staticmethod
        def accept_tokens(constraints, tokens):
            raise RuntimeError("grammar service down")

    class RefusesThenBreaks(AllowOnly):
        """Takes three tokens, refuses the fourth, then cannot fill its mask."""

        def accept(self, token_id):
            return len(self.accepted) < 3 and super().accept(token_id)

        def fill_bitmask(self, bitmask, row):
            if len(self.accepted) >= 3:
                raise RuntimeError("mask service down")
            super().fill_bitmask(bitmask, row)

    tuning = EngineTuning(overlap_rows=1 if overlap else 10**9)
    engine = variant(smollm2_engine, tuning=tuning, async_scheduling=True, spec="none")
    every = set(range(smollm2_engine.tokenizer.vocab_size))
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    hooked = [engine.add_request(chat(engine, t), greedy, constraint=Hooked(every))
              for t in ("Say hi.", "Name a fruit.")]
    broken = engine.add_request(chat(engine, "Name a river."), greedy,
                                constraint=RefusesThenBreaks(every))
    plain = engine.add_request(chat(engine, "Name a colour."), greedy,
                               constraint=AllowOnly(every))
    free = engine.add_request(chat(engine, "Count to three."), greedy)
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    for rid in hooked:
        assert done[rid].finish_reason == "abort"
        assert "grammar service down" in done[rid].error
    assert done[broken].finish_reason == "abort" and "mask service down" in done[broken].error
    alone = smollm2_engine.generate([chat(engine, "Name a colour."),
                                     chat(engine, "Count to three.")], greedy)
    for rid, out in zip((plain, free), alone):
        assert done[rid].finish_reason == "length" and done[rid].token_ids == out.token_ids
    assert engine.stats.num_unmasked_picks > 0 and engine.stats.num_refused_picks > 0
    assert (engine.pipeline.accept.pool is not None) == overlap


def test_a_take_waits_for_the_accept_threads_reading_only_while_its_job_can_run():
    """A take waits until the accept thread has read the step's tokens; a job
    that ended without reading them (cancelled, never run) lets it go on and
    read them itself, rather than hanging."""
    import threading
    import types
    from concurrent.futures import Future

    from formcast.engine.pipeline.state import wait_landed as _wait_landed

    step = types.SimpleNamespace(landed=threading.Event(), early=Future())
    threading.Timer(0.12, step.landed.set).start()
    t = time.perf_counter()
    _wait_landed(step)
    assert step.landed.is_set() and time.perf_counter() - t >= 0.1
    never = types.SimpleNamespace(landed=threading.Event(), early=Future())
    assert never.early.cancel()
    _wait_landed(never)  # (returns: the job will not run)
    assert not never.landed.is_set()


def test_steps_with_draft_rows_do_not_promise_one_row_a_sequence(smollm2_engine, monkeypatch):
    """A forward's attention metadata says every decode row is its sequence's one
    new token (``one_token_rows``: a kernel may then store a row's key and value
    while the other rows attend, and a CUDA graph captured over such a kernel is
    not replayed for draft rows) exactly when no sequence has draft positions in
    the step: a speculative run checked step by step, drafts and plain steps both
    seen."""
    from formcast.engine.model_runner import ModelRunner

    tok = smollm2_engine.tokenizer
    model = _tiny_smollm2_shaped()
    seen, batches = [], []
    layout_of, prepare = ModelRunner._layout, ModelRunner._prepare

    def laid_out(self, batch):  # (whether a sequence has draft positions, from the batch)
        batches.append((any(item.num_draft for item in batch),
                        any(item.seq.num_computed_tokens < item.seq.num_prompt_tokens
                            for item in batch)))
        return layout_of(self, batch)

    def prepared(self, layout):
        got = prepare(self, layout)
        seen.append((got[2].one_token_rows, *batches[-1]))
        return got

    monkeypatch.setattr(ModelRunner, "_layout", laid_out)
    monkeypatch.setattr(ModelRunner, "_prepare", prepared)
    # (prompts that repeat themselves: prompt lookup finds drafts in them; then
    # the same without speculation)
    text = "one two three four five six seven eight nine ten " * 3
    for spec in ("prompt_lookup", "none"):
        engine = Engine(model, tok, config=EngineConfig(max_num_seqs=4, num_kv_blocks=128,
                                                        spec=spec),
                        device=torch.device("cpu"))
        engine.generate([tok.encode(text + str(i)) for i in range(3)],
                        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    drafts = [one for one, drafting, _ in seen if drafting]
    plain = [one for one, drafting, prompt in seen if not drafting and not prompt]
    assert drafts and not any(drafts)
    assert plain and all(plain)


def _records_batch(tok, n: int):
    """The tiny SmolLM2-shaped model, a schema of records whose opening the
    grammar forces ('{"records":[{"name":"') and that cannot close within a short
    run, compiled for it, and ``n`` prompts."""
    from formcast.grammars import JsonSchema, compile

    model = _tiny_smollm2_shaped()
    schema = {"type": "object", "required": ["records"], "properties": {"records": {
        "type": "array", "minItems": 20, "items": {
            "type": "object", "required": ["name", "city"], "additionalProperties": False,
            "properties": {"name": {"type": "string"}, "city": {"type": "string"}}}}}}
    compiled = compile(JsonSchema(schema), tok, vocab_size=model.config.vocab_size)
    return model, compiled, [tok.encode(f"Request number {i}: list the people.")
                             for i in range(n)]


def _run_records(model, tok, compiled, prompts, params, **config):
    """One engine of ``config`` (on the CPU, as many rows as prompts) generating
    every prompt under ``compiled``: the outputs' tokens, the picks refused and
    the unmasked picks."""
    engine = Engine(model, tok, config=EngineConfig(max_num_seqs=len(prompts),
                                                    num_kv_blocks=256, spec="none", **config),
                    device=torch.device("cpu"))
    outs = engine.generate(prompts, params, constraints=[compiled.matcher() for _ in prompts])
    return [o.token_ids for o in outs], engine.stats.num_refused_picks, engine.stats.num_unmasked_picks


def _tiny_smollm2_shaped():
    """A two-layer random-weights Llama of SmolLM2's vocabulary (CPU, float32)."""
    import dataclasses

    from formcast.engine.loading import build_model
    from formcast.engine.models.shapes import SHAPES, random_llama_weights

    cfg = dataclasses.replace(SHAPES["smollm2-135m"], num_hidden_layers=2, hidden_size=64,
                              intermediate_size=128, num_attention_heads=2,
                              num_key_value_heads=1, head_dim=32)
    return build_model(cfg, random_llama_weights(cfg, seed=0, head_std=0.5),
                       device=torch.device("cpu"), dtype=torch.float32)


def test_an_idle_engine_keeps_no_finished_request(smollm2_engine, monkeypatch):
    """Once no request is left, nothing of the engine keeps the batch that ran:
    its requests, constraints and token lists go then, not when the next batch's
    first steps replace the caches of its rows (on the host's path). Run with
    the pipelined steps, the native accept of unmasked picks and masked rows,
    and a tokenizer-sized vocabulary."""
    import gc

    from formcast.engine.sequence import Sequence

    tuning = EngineTuning(overlap_rows=1)
    tok = smollm2_engine.tokenizer
    model, compiled, prompts = _records_batch(tok, 6)
    engine = Engine(model, tok, config=EngineConfig(tuning=tuning,
        max_num_seqs=8, num_kv_blocks=256, async_scheduling=True, spec="none",
        native_accept=True), device=torch.device("cpu"))
    greedy = SamplingParams(max_tokens=20, temperature=0.0)
    for p in prompts:
        engine.add_request(p, greedy, constraint=compiled.matcher())
    ran, done = set(), []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
        ran.update(id(s) for s in engine.scheduler.running)
    assert len(done) == 6 and all(len(o.token_ids) == 20 for o in done)
    assert engine.stats.num_pipelined_steps > 10 and len(ran) == 6
    gc.collect()
    kept = [o for o in gc.get_objects() if type(o) is Sequence and id(o) in ran]
    assert kept == [], f"{len(kept)} finished requests still referenced"


def test_a_batch_of_greedy_constrained_rows_sorts_as_any_batch_does(smollm2_engine,
                                                                    monkeypatch):
    """The pipelined sampling's sort of a batch whose every row is a greedy
    constrained one, by each row's ``masked`` alone, gives what the sort of any
    batch gives, with and without the logits rows, as rows are masked and
    unmasked; a ban (the row then drawn by the sampler) or a row of another kind
    sends the batch the general way."""
    import random

    from .helpers import make_seq

    engine = variant(smollm2_engine, async_scheduling=True, unmasked_greedy=True)
    general = engine.pipeline.rows.all_greedy_constrained
    rng = random.Random(0)
    live = []
    for i in range(40):
        seq = make_seq([1, 2, 3], rid=f"r{i}", temperature=0.0, epochs=engine.scheduler.epochs)
        seq.constraint = AllowOnly({5, 6})
        live.append(seq)

    def both(rows):
        fast = engine.pipeline.rows.sort(live, rows)
        with monkeypatch.context() as m:
            m.setattr(engine.pipeline.rows, "all_greedy_constrained", lambda _live: False)
            return fast, engine.pipeline.rows.sort(live, rows)

    for _ in range(12):
        for seq in live:
            if rng.random() < 0.2:
                seq.pick_refused() if not seq.masked else seq.masked_pick_seen(True)
        rows = None if rng.random() < 0.5 else sorted(rng.sample(range(100), len(live)))
        assert general(live)
        fast, slow = both(rows)
        assert fast == slow
    assert any(s.masked for s in live) and not all(s.masked for s in live)
    live[7].ban(10, 5)  # (no longer a greedy row: drawn by the sampler)
    assert not general(live)
    fast, slow = both(None)
    assert fast == slow and 7 in fast[1] and 7 not in fast[0]
    live[7:8] = [make_seq([1, 2, 3], rid="free", temperature=0.0,
                          epochs=engine.scheduler.epochs)]  # (no constraint)
    assert not general(live)
    fast, slow = both(None)
    assert fast == slow and fast[4] == [7]


def test_the_hosts_idle_waits_detokenize_deferred_tokens_in_turn(smollm2_engine, monkeypatch):
    """While the device is busy the host makes the text of rows' deferred tokens,
    a few rows between looks at the device, each row once it holds enough of
    them, going on where the last wait stopped; the texts are those that one
    detokenization of every token makes (a character split across tokens
    included)."""
    from formcast.engine.detokenizer import IncrementalDetokenizer

    from .helpers import make_seq

    tuning = EngineTuning(detok_chore_tokens=32)
    engine, tok = variant(smollm2_engine, tuning=tuning), smollm2_engine.tokenizer
    chore, rows_a_look = tuning.detok_chore_tokens, tuning.detok_chore_rows
    ids = tok.encode("Zürich, 東京 and 🎉 in one line: the rows' outputs " * 4)
    assert len(ids) >= 2 * chore
    seqs = []
    for i in range(3 * rows_a_look):
        seq = make_seq([1, 2], rid=f"r{i}")
        seq.detok = IncrementalDetokenizer(tok, skip_special_tokens=True)
        seqs.append(seq)
    short = seqs[5]
    for seq in seqs:
        for t in ids[:chore - 1 if seq is short else chore + 3]:
            seq.defer_text(t)
    looks = []

    def busy(n):
        return lambda: looks.append(1) or len(looks) <= n

    engine.chores.detok_at = 0
    engine.chores.detokenize_while(seqs, busy(1))  # one look: the first rows only
    made = [not s.num_undecoded for s in seqs]
    assert made == [i < rows_a_look and seqs[i] is not short for i in range(len(seqs))]
    assert engine.chores.detok_at == rows_a_look
    looks.clear()
    engine.chores.detokenize_while(seqs, busy(10))  # on from there, round to the start
    assert all(not s.num_undecoded for s in seqs if s is not short)
    assert short.num_undecoded == chore - 1  # (too few to be worth a call)
    looks.clear()
    engine.chores.detokenize_while(seqs, busy(10))  # nothing left to make: one look
    assert len(looks) == 1
    for seq in seqs:
        n = chore - 1 if seq is short else chore + 3
        assert seq.text == tok.decode(ids[:n], skip_special_tokens=True)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_constraint_class_is_offered_its_new_instances_once_at_their_prefill(
        smollm2_engine, async_scheduling):
    """A constraint class's optional ``prepare`` hook gets, once, the instances
    of the requests whose prefill a step launches, before any of them took a
    token; a request that arrives later has its own call; a hook that raises
    fails nothing (the constraints report errors where they are used)."""
    calls: list[tuple[list, list[int]]] = []

    class Prepared(AllowOnly):
        @staticmethod
        def prepare(constraints):
            calls.append((list(constraints), [len(c.accepted) for c in constraints]))

    class Raises(AllowOnly):
        @staticmethod
        def prepare(constraints):
            raise RuntimeError("not today")

    every = set(range(smollm2_engine.tokenizer.vocab_size))
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine = variant(smollm2_engine, async_scheduling=async_scheduling, spec="none")
    first = [Prepared(every) for _ in range(3)]
    for c, text in zip(first, ("Say hi.", "Name a fruit.", "Count.")):
        engine.add_request(chat(engine, text), greedy, constraint=c)
    engine.add_request(chat(engine, "Hello."), greedy, constraint=Raises(every))
    engine.step()
    assert calls == [(first, [0, 0, 0])]
    late = Prepared(every)
    engine.add_request(chat(engine, "Bye."), greedy, constraint=late)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert calls[1:] == [([late], [0])]
    assert len(outs) == 5 and all(len(o.token_ids) == 6 and o.error is None for o in outs)


def test_ended_requests_constraints_are_kept_until_the_device_is_busy(smollm2_engine,
                                                                      monkeypatch):
    """On CUDA the engine keeps the constraints of ended requests (ended any way:
    length, abort) and drops them a few at a time while the host waits for the
    device, so their destructors run off the caller's path; never more than
    ``tuning.graves_kept`` of them. On the CPU (no device time to drop them in) none
    are kept."""

    every = set(range(smollm2_engine.tokenizer.vocab_size))
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    tuning = EngineTuning(graves_at_once=3, graves_kept=4)
    engine = variant(smollm2_engine, spec="none", tuning=tuning)
    assert not engine.output.keep_graves and engine.device.type == "cpu"
    engine.generate([chat(engine, "Say hi.")], greedy, constraints=[AllowOnly(every)])
    assert engine.output.graves == []
    engine.output.keep_graves = True  # (as on CUDA)
    kept = [AllowOnly(every) for _ in range(3)]
    engine.generate([chat(engine, t) for t in ("Say hi.", "Name a fruit.", "Count.")],
                    greedy, constraints=kept)
    rid = engine.add_request(chat(engine, "Bye."), greedy, constraint=AllowOnly(every))
    assert engine.abort_request(rid)
    assert sorted(map(id, engine.output.graves[:3])) == sorted(map(id, kept))
    assert len(engine.output.graves) == 4
    engine.chores.bury_while(lambda: False)  # (the device idle: nothing dropped)
    assert len(engine.output.graves) == 4
    busy = iter([True, False])
    engine.chores.bury_while(lambda: next(busy))  # (busy for one drop)
    assert len(engine.output.graves) == 1
    engine.chores.bury_while(lambda: True)
    assert engine.output.graves == []
    engine.generate([chat(engine, "Count.")] * 5, greedy,
                    constraints=[AllowOnly(every) for _ in range(5)])
    assert len(engine.output.graves) == 3  # (the fifth trimmed the oldest two)

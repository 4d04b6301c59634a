"""The engine on CUDA: random weights of the SmolLM2 shape (the GGUF does not travel
to the GPU machine), our real tokenizer. Skipped where no CUDA device exists."""

from __future__ import annotations

import os

import pytest
import torch

from formcast.engine import Engine, EngineConfig, SamplingParams, Tokenizer
from formcast.engine.tuning import EngineTuning
from formcast.engine.loading import build_model
from formcast.engine.models.shapes import SHAPES, random_llama_weights

from .helpers import (AllowOnly, count_calls, count_word_risky,
                      logprobs_agree_until_a_tie)

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def tokenizer():
    folder = os.environ.get("FORMCAST_TOKENIZER_DIR")
    if folder:
        return Tokenizer.from_hf_dir(folder)
    from formcast.engine.hub import resolve_model

    return Tokenizer.from_gguf(resolve_model("smollm2").path)


@pytest.fixture(scope="module")
def weights():
    return random_llama_weights(SHAPES["smollm2-135m"], seed=0, head_std=0.5)


def make_engine(weights, tokenizer, device: str, dtype: torch.dtype, **config) -> Engine:
    model = build_model(SHAPES["smollm2-135m"], weights, device=torch.device(device), dtype=dtype)
    return Engine(model, tokenizer, config=EngineConfig(**config), device=torch.device(device))


@pytest.fixture(scope="module")
def cuda32(weights, tokenizer):
    return make_engine(weights, tokenizer, "cuda", torch.float32, num_kv_blocks=512)


@pytest.fixture(scope="module")
def cpu32(weights, tokenizer):
    return make_engine(weights, tokenizer, "cpu", torch.float32, num_kv_blocks=512)


def prompts(tokenizer, n: int) -> list[list[int]]:
    texts = [f"Request {i}: " + "tell me about the weather. " * (1 + i % 5) for i in range(n)]
    return [tokenizer.encode(t) for t in texts]


def test_cuda_float32_logits_match_cpu(cuda32, cpu32, tokenizer):
    for ids in prompts(tokenizer, 3):
        gpu = cuda32.forward_logits(ids)
        cpu = cpu32.forward_logits(ids)
        assert (gpu - cpu).abs().max().item() <= 2e-3


def test_cuda_bfloat16_is_the_default_and_tracks_float32(weights, tokenizer, cuda32):
    eng = Engine(build_model(SHAPES["smollm2-135m"], weights, device=torch.device("cuda"),
                             dtype=torch.bfloat16), tokenizer, device=torch.device("cuda"))
    assert eng.dtype == torch.bfloat16 and eng.runner.kv_caches[0].dtype == torch.bfloat16
    ids = prompts(tokenizer, 1)[0]
    lo, hi = eng.forward_logits(ids), cuda32.forward_logits(ids)
    agree = (lo.argmax(-1) == hi.argmax(-1)).float().mean().item()
    assert agree >= 0.9
    assert torch.nn.functional.cosine_similarity(lo, hi, dim=-1).min().item() > 0.99


def test_cuda_decode_matches_prefill(cuda32, tokenizer):
    ids = prompts(tokenizer, 1)[0]
    out = cuda32.generate([ids], SamplingParams(max_tokens=16, temperature=0.0, logprobs=0,
                                                ignore_eos=True))[0]
    ref = torch.log_softmax(cuda32.forward_logits(ids + list(out.token_ids)), dim=-1)
    for i, lp in enumerate(out.logprobs):
        assert lp.logprob == pytest.approx(ref[len(ids) - 1 + i, lp.token_id].item(), abs=1e-3)


def test_cuda_batch_of_16_matches_each_alone(cuda32, tokenizer):
    ps = prompts(tokenizer, 16)
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    batch = cuda32.generate(ps, sp)
    for ids, out in zip(ps, batch):
        assert out.token_ids == cuda32.generate([ids], sp)[0].token_ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_give_the_eager_outputs(weights, tokenizer, dtype):
    """Decode steps replayed from CUDA graphs (batches padded up the ladder: 3 and 5
    rows run the 4- and 8-row graphs) give the tokens of eager steps, and the
    padding rows leave the real sequences' cache alone."""
    eager = make_engine(weights, tokenizer, "cuda", dtype, num_kv_blocks=512,
                        cuda_graphs=False, max_num_seqs=8)
    graphed = make_engine(weights, tokenizer, "cuda", dtype, num_kv_blocks=512, max_num_seqs=8)
    assert eager.runner.graphs is None and graphed.runner.graphs.sizes == (1, 2, 4, 8)
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for n in (1, 3, 5, 8):
        ps = prompts(tokenizer, n)
        assert [o.token_ids for o in graphed.generate(ps, sp)] == \
            [o.token_ids for o in eager.generate(ps, sp)], f"batch {n}"
    assert graphed.runner.graphs.replays > 0
    # and their logits agree with the eager step's
    lp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    ps = prompts(tokenizer, 3)
    for g, e in zip(graphed.generate(ps, lp), eager.generate(ps, lp)):
        for a, b in zip(g.logprobs, e.logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4 if dtype == torch.float32
                                              else 0.05)


def test_cuda_fused_rope_decode_attention_tracks_the_separate_kernels(weights, tokenizer,
                                                                     monkeypatch):
    """bfloat16 decode steps (graphed and eager) rotate, store and attend in one
    kernel; the tokens' log-probabilities are those of the separate rotation and
    attention kernels within bfloat16's rounding (up to a near-tie taken the
    other way), over contexts of two tiles, and the steps after read the keys
    and values that kernel stored. Graphs captured
    over it replay no draft rows (their keys would be stale); float32 engines
    keep the separate kernels."""
    from formcast.engine.kernels.paged_attention import SPLIT_BELOW
    from formcast.engine.models import llama

    calls = count_calls(monkeypatch, llama, "rope_decode_attention")
    lp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)
    # (48 rows: a program a row and kv head, no split contexts, as the fused path
    # asks; contexts of 120-200 tokens: two tiles of keys)
    batches = [[tokenizer.encode(f"Request {i}: " + "tell me about the weather. " * (20 + i % 7))
                for i in range(48)]]
    got = {}
    for fused in (True, False):
        monkeypatch.setattr(llama.LlamaAttention, "fused_decode", fused)
        for graphs in (True, False):
            calls.clear()
            eng = make_engine(weights, tokenizer, "cuda", torch.bfloat16, num_kv_blocks=2048,
                              max_num_seqs=64, cuda_graphs=graphs)
            got[fused, graphs] = [eng.generate(ps, lp) for ps in batches]
            assert bool(calls) == fused
            if graphs:  # (fused: the sizes of enough (row, kv head) programs, 64 rows here;
                # the smaller ones keep the separate kernels and may replay draft rows)
                decode_graphs = eng.runner.graphs
                heads = eng.model.config.num_key_value_heads
                assert decode_graphs.draft_sizes == {
                    b for b in decode_graphs.sizes if not fused or b * heads < SPLIT_BELOW}
                assert (64 in decode_graphs.draft_sizes) == (not fused)
    compared = total = 0
    for graphs in (True, False):
        for outs_a, outs_b in zip(got[True, graphs], got[False, graphs]):
            done, count = logprobs_agree_until_a_tie(outs_a, outs_b, 0.05)
            compared, total = compared + done, total + count
    assert compared >= total // 2
    assert [[o.token_ids for o in outs] for outs in got[True, True]] == \
        [[o.token_ids for o in outs] for outs in got[True, False]]
    calls.clear()
    eng32 = make_engine(weights, tokenizer, "cuda", torch.float32, num_kv_blocks=2048,
                        max_num_seqs=64)
    eng32.generate(batches[0], lp)
    assert not calls and eng32.runner.graphs.draft_sizes == set(eng32.runner.graphs.sizes)


def test_cuda_folded_norms_track_the_plain_layers(weights, tokenizer, cuda32, monkeypatch):
    """In bfloat16 the runner folds the norms' weights (random here, as a real
    model's are) into the projections (``EngineTuning.fold_norms``): decode
    steps of the fused attention kernel run the folded layer step (no norm
    kernel), and the tokens' log-probabilities are the plain layers' within
    bfloat16's rounding (up to a near-tie taken the other way), graphed and
    eager. float32 and float16 engines keep their norms, and so does a model
    another engine ran already (its graphs read the weights it had)."""
    from formcast.engine.models import llama

    gen = torch.Generator().manual_seed(4)
    weights = {name: torch.rand(w.shape, generator=gen) + 0.5
               if name.endswith("layernorm.weight") else w for name, w in weights.items()}
    steps = count_calls(monkeypatch, llama.LlamaDecoderLayer, "_folded_decode")
    lp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)
    batch = [tokenizer.encode(f"Request {i}: " + "tell me about the weather. " * (3 + i % 7))
             for i in range(48)]
    got = {}
    for fold in (True, False):
        for graphs in (True, False):
            steps.clear()
            eng = make_engine(weights, tokenizer, "cuda", torch.bfloat16, num_kv_blocks=1024,
                              max_num_seqs=64, cuda_graphs=graphs,
                              tuning=EngineTuning(fold_norms=fold))
            assert all(layer.folded == fold for layer in eng.model.model.layers)
            got[fold, graphs] = eng.generate(batch, lp)
            assert bool(steps) == fold
    compared = total = 0
    for graphs in (True, False):
        done, count = logprobs_agree_until_a_tie(got[True, graphs], got[False, graphs], 0.05)
        compared, total = compared + done, total + count
    assert compared >= total // 2
    assert [o.token_ids for o in got[True, True]] == [o.token_ids for o in got[True, False]]
    assert not any(layer.folded for layer in cuda32.model.model.layers)
    half = make_engine(weights, tokenizer, "cuda", torch.float16, num_kv_blocks=64)
    assert not any(layer.folded for layer in half.model.model.layers)
    # (the last engine's model, plain, which its runner's graphs captured)
    again = Engine(eng.model, tokenizer, config=EngineConfig(num_kv_blocks=64),
                   device=torch.device("cuda"))
    assert not any(layer.folded for layer in again.model.model.layers)


def test_cuda_prompt_graphs_give_the_eager_outputs(weights, tokenizer):
    """Steps of prompt chunks replayed from graphs (tokens, chunks and the longest
    chunk padded to powers of two; captured the first time a bucket runs) give
    the eager steps' first-token logits and greedy outputs: plain prompts, prompts
    longer than one attention tile, and prompts cut into chunks over cached
    context (prefix caching and a small token budget)."""
    eager = make_engine(weights, tokenizer, "cuda", torch.float32, num_kv_blocks=512,
                        cuda_graphs=False, max_num_seqs=8, max_num_batched_tokens=96)
    graphed = make_engine(weights, tokenizer, "cuda", torch.float32, num_kv_blocks=512,
                          max_num_seqs=8, max_num_batched_tokens=96)
    pg = graphed.runner.prefill_graphs
    assert eager.runner.prefill_graphs is None and pg is not None
    first = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    long_prompt = tokenizer.encode("a long request about the weather in many towns. " * 20)
    assert len(long_prompt) > 2 * 96  # three chunks, the later ones over cached keys
    batches = [prompts(tokenizer, 1), prompts(tokenizer, 5), [long_prompt],
               prompts(tokenizer, 3) + [long_prompt[:40]]]
    for ps in batches:
        for g, e in zip(graphed.generate(ps, first), eager.generate(ps, first)):
            assert g.token_ids == e.token_ids
            for a, b in zip(g.logprobs[0].top, e.logprobs[0].top):
                assert a[0] == b[0] and a[1] == pytest.approx(b[1], abs=1e-4)
        assert [o.token_ids for o in graphed.generate(ps, sp)] == \
            [o.token_ids for o in eager.generate(ps, sp)]
    assert pg.captures > 0 and pg.replays > pg.captures and not pg.failures
    # a new prompt of a bucket seen before replays its graph (the batches above,
    # run again, would mostly come from the prefix cache: steps mixing prompt
    # chunks with single-token rows run eagerly)
    captures, replays, buckets = pg.captures, pg.replays, pg.buckets
    graphed.generate([tokenizer.encode("Another request: the wind, please.")], sp)
    assert (pg.captures, pg.replays, pg.buckets) == (captures, replays + 1, buckets), \
        (captures, replays, buckets, pg.failures)


@pytest.mark.parametrize("graphs", [True, False])
def test_cuda_async_scheduling_gives_the_synchronous_outputs(weights, tokenizer, graphs):
    """Steps launched with the previous step's tokens still on the GPU: the same
    greedy (sampled inside the graph when nothing masks the rows), seeded and
    JSON-constrained outputs as synchronous steps."""
    grammars = pytest.importorskip("formcast.grammars")
    schema = {"type": "object", "required": ["name", "tags"], "properties": {
        "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}}}
    results = {}
    for asynchronous in (False, True):
        eng = make_engine(weights, tokenizer, "cuda", torch.float32, num_kv_blocks=512,
                          max_num_seqs=16, cuda_graphs=graphs, async_scheduling=asynchronous)
        compiled = grammars.compile(grammars.JsonSchema(schema), tokenizer,
                                    vocab_size=eng.model.config.vocab_size)
        ps = prompts(tokenizer, 12)
        params = [SamplingParams(max_tokens=20 + i, temperature=0.0 if i % 3 else 0.9, seed=i,
                                 ignore_eos=True) for i in range(12)]
        free = eng.generate(ps, params)
        greedy = eng.generate(ps, SamplingParams(max_tokens=24, temperature=0.0))
        constrained = eng.generate(ps[:6], SamplingParams(max_tokens=60, temperature=0.0),
                                   constraints=[compiled.matcher() for _ in range(6)])
        results[asynchronous] = ([o.token_ids for o in free], [o.token_ids for o in greedy],
                                 [(o.token_ids, o.finish_reason) for o in constrained])
        assert (eng.stats.num_pipelined_steps > 0) == asynchronous
        if graphs and asynchronous:  # unmasked greedy steps took the graph's own samples
            assert eng.runner.graphs.greedy_reads > 0
    assert results[True] == results[False]


@pytest.mark.parametrize("graphs", [True, False])
def test_cuda_jump_forward_takes_the_opening_in_the_prefill(weights, tokenizer, graphs,
                                                            monkeypatch):
    """On CUDA by default a JSON batch's opening, which the schema fixes, is
    appended to its prompts' prefill: every row's output starts with its tokens,
    the batch takes that many steps fewer, its pipelined steps (a large batch's
    way, picks checked on the native worker or the accept thread) give the
    synchronous outputs, and every output is valid."""
    import json


    grammars = pytest.importorskip("formcast.grammars")
    tuning = EngineTuning(overlap_rows=1)
    schema = {"type": "object", "required": ["name", "age"], "additionalProperties": False,
              "properties": {"name": {"type": "string", "maxLength": 12},
                             "age": {"type": "integer"}}}
    ps = prompts(tokenizer, 16)
    params = SamplingParams(max_tokens=40, temperature=0.0)
    results = {}
    for jump, asynchronous in ((None, True), (None, False), (False, True)):
        eng = make_engine(weights, tokenizer, "cuda", torch.bfloat16, num_kv_blocks=512,
                          max_num_seqs=16, cuda_graphs=graphs, async_scheduling=asynchronous,
                          jump_forward=jump, tuning=tuning)
        compiled = grammars.compile(grammars.JsonSchema(schema), tokenizer,
                                    vocab_size=eng.model.config.vocab_size)
        forced = compiled.matcher().forced_tokens()
        assert tokenizer.decode(forced) == '{"name":"'
        ids = [eng.add_request(p, params, constraint=compiled.matcher()) for p in ps]
        done, steps = {}, 0
        while eng.has_unfinished_requests():
            steps += 1
            done.update((o.request_id, o) for o in eng.step() if o.finished)
        outs = [done[i] for i in ids]
        for o in outs:
            assert o.finish_reason in ("stop", "length")
            if o.finish_reason == "stop":
                assert set(json.loads(o.text)) == {"name", "age"}
            assert o.metrics.num_forced_tokens == (0 if jump is False else len(forced))
            if jump is None:
                assert list(o.token_ids[:len(forced)]) == forced
        results[jump, asynchronous] = [o.token_ids for o in outs], steps
        assert (eng.stats.num_pipelined_steps > 0) == asynchronous
    assert results[None, True][0] == results[None, False][0]
    longest = max(len(ids) for ids in results[None, True][0])
    assert results[None, True][1] <= longest - len(forced) + 3
    assert results[None, True][1] < results[False, True][1]


def test_cuda_texts_made_while_the_device_runs_are_the_texts_made_at_the_end(
        weights, tokenizer, monkeypatch):
    """With the host's waits for the device detokenizing rows' deferred tokens
    (``EngineTuning.detok_chore_tokens``), outputs have the texts they have without: free,
    seeded and JSON-constrained rows; the waits did make texts."""
    from formcast.engine.chores import HostChores

    grammars = pytest.importorskip("formcast.grammars")
    schema = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}
    compiled = grammars.compile(grammars.JsonSchema(schema), tokenizer,
                                vocab_size=SHAPES["smollm2-135m"].vocab_size)
    ps = prompts(tokenizer, 12)
    params = [SamplingParams(max_tokens=40 + i, temperature=0.0 if i % 3 else 0.9, seed=i,
                             ignore_eos=True) for i in range(12)]
    made = []
    chores = HostChores.detokenize_while

    def counted(self, seqs, busy):
        before = sum(s.num_undecoded for s in seqs)
        chores(self, seqs, busy)
        made.append(before - sum(s.num_undecoded for s in seqs))

    monkeypatch.setattr(HostChores, "detokenize_while", counted)
    results = {}
    for tokens in (None, 8):
        tuning = EngineTuning(detok_chore_tokens=tokens)
        eng = make_engine(weights, tokenizer, "cuda", torch.bfloat16, num_kv_blocks=512,
                          max_num_seqs=16, async_scheduling=True, tuning=tuning)
        free = eng.generate(ps, params)
        constrained = eng.generate(ps[:6], SamplingParams(max_tokens=48, temperature=0.0),
                                   constraints=[compiled.matcher() for _ in range(6)])
        results[tokens] = [(o.token_ids, o.text) for o in free + constrained]
    assert results[8] == results[None]
    assert sum(made) > 0  # (the device kept the host waiting at least once)


@pytest.mark.parametrize("graphs", [True, False])
def test_cuda_unmasked_greedy_picks_give_the_masked_outputs(weights, tokenizer, graphs,
                                                            monkeypatch):
    """Greedy JSON rows of pipelined steps pick unmasked (in the graph) and are
    checked afterwards; refused picks are resampled under their masks from logits
    that must survive the next step's replay. Outputs equal masked decoding's,
    with the picks checked before the step is sampled and (``overlap``, a large
    batch's way) on the accept thread while every row is sampled, the refused
    ones sampled again over the graph's own picks, and the step after launched
    before the tokens are appended (dropped, its graph output reused, when rows
    end)."""
    from formcast.engine.constraint_ops import forces_text
    from formcast.engine.pipeline import take as take_module
    from formcast.engine.pipeline.premask import Premasker

    grammars = pytest.importorskip("formcast.grammars")
    schema = {"type": "object", "required": ["name", "age"], "properties": {
        "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "additionalProperties": False}
    # (masked rows unmasked by an agreement on a string's closing quote, as before
    # Premasker.pick_closes_span, and on one where the grammar leaves few tokens, as before
    # _narrow_choice (forced text alone counted out): the refusals those rules spare
    # are what this test takes)
    monkeypatch.setattr(Premasker, "pick_closes_span", lambda self, seqs, seq, token: False)
    monkeypatch.setattr(take_module, "narrow_choice", forces_text)
    results = {}
    for unmasked, overlap, native in ((False, False, None), (True, False, None),
                                      (True, True, None), (True, True, False)):
        tuning = EngineTuning(overlap_rows=1 if overlap else 10**9)
        eng = make_engine(weights, tokenizer, "cuda", torch.bfloat16, num_kv_blocks=512,
                          max_num_seqs=16, cuda_graphs=graphs, async_scheduling=True,
                          unmasked_greedy=unmasked, native_accept=native, tuning=tuning,
                          jump_forward=False)  # (the opening's refusals taken too)
        compiled = grammars.compile(grammars.JsonSchema(schema), tokenizer,
                                    vocab_size=eng.model.config.vocab_size)
        pinned, pinned_ints = [], eng.sampler.pinned_ints
        eng.sampler.pinned_ints = lambda *args: pinned.append(pinned_ints(*args)) or pinned[-1]
        ps = prompts(tokenizer, 10)
        outs = eng.generate(ps, SamplingParams(max_tokens=48, temperature=0.0),
                            constraints=[compiled.matcher() for _ in ps])
        results[unmasked, overlap, native] = [(o.token_ids, o.finish_reason) for o in outs]
        if unmasked:
            assert eng.stats.num_refused_picks > 0
            assert eng.stats.num_unmasked_picks > eng.stats.num_refused_picks
            # (the rows masked since a refusal, a few: their picks read their lists
            # and masks in pinned memory)
            assert any(got is not None for got in pinned)
        # (a large batch's tokens: checked on the native worker on CUDA, polling the
        # step's event, else on the accept thread)
        from formcast.grammars.backends.xgrammar import native as native_accept

        on_worker = overlap and native is None and native_accept.worker() is not None
        assert (eng.stats.num_native_accepts > 0) == on_worker
        assert (eng.pipeline.accept.pool is not None) == (overlap and not on_worker)
        # (overlap: steps launched before the last one's tokens were appended)
        assert (eng.stats.num_launched_ahead > 0) == overlap and eng.pipeline.lane.ahead is None
        if graphs:  # (the steps launched ahead were staged, and their copies queued,
            # while the picks were checked)
            assert (eng.runner.graphs.staged_replays > 0) == overlap
            assert (eng.runner.graphs.preloaded_replays > 0) == overlap
    assert results[True, False, None] == results[True, True, None] == \
        results[True, True, False] == results[False, False, None]


@pytest.mark.parametrize("graphs", [True, False])
def test_cuda_premasked_picks_give_the_masked_outputs(tokenizer, graphs, monkeypatch):
    """Premasking forced on, with the word a tiny random-weights model writes over
    and over inside its JSON strings counted risky too (so that rows are
    premasked often; its `:"` where the schema forces `":"` is a risky pick the
    grammar refuses): rows that take a risky token are masked for their next
    pick, as their picks land (the native worker's check, polling the step's
    event, or the accept thread's; the masks wait for it, then go through pinned
    memory) or after the host's check; a premasked row whose landed pick is
    refused is sampled again from the step before. Outputs equal masked
    decoding's, with and without CUDA graphs."""
    import collections
    import dataclasses


    grammars = pytest.importorskip("formcast.grammars")
    cfg = dataclasses.replace(SHAPES["smollm2-135m"], num_hidden_layers=2, hidden_size=64,
                              intermediate_size=128, num_attention_heads=2,
                              num_key_value_heads=1, head_dim=32)
    tiny = random_llama_weights(cfg, seed=0, head_std=0.5)
    schema = {"type": "object", "required": ["records"], "properties": {"records": {
        "type": "array", "minItems": 20, "items": {
            "type": "object", "required": ["name", "city"], "additionalProperties": False,
            "properties": {"name": {"type": "string"}, "city": {"type": "string"}}}}}}
    ps = [tokenizer.encode(f"Request number {i}: list the people.") for i in range(12)]
    params = SamplingParams(max_tokens=40, temperature=0.0)

    model = build_model(cfg, tiny, device=torch.device("cuda"), dtype=torch.bfloat16)

    def run(unmasked: bool, overlap: bool = False, native=None):
        tuning = EngineTuning(overlap_rows=1 if overlap else 10**9, premask_after=0.0)
        eng = Engine(model, tokenizer, config=EngineConfig(tuning=tuning,
            num_kv_blocks=256, max_num_seqs=16, cuda_graphs=graphs, async_scheduling=True,
            unmasked_greedy=unmasked, native_accept=native, spec="none", jump_forward=False),
            device=torch.device("cuda"))
        compiled = grammars.compile(grammars.JsonSchema(schema), tokenizer,
                                    vocab_size=cfg.vocab_size)
        outs = eng.generate(ps, params, constraints=[compiled.matcher() for _ in ps])
        return [(o.token_ids, o.finish_reason) for o in outs], eng

    masked, _ = run(False)
    word = collections.Counter(t for out, _ in masked for t in out).most_common(1)[0][0]
    count_word_risky(monkeypatch, word)
    for overlap, native in ((False, None), (True, None), (True, False)):
        premasked, eng = run(True, overlap, native)
        assert premasked == masked, (overlap, native)
        assert eng.stats.num_premasked_picks > 10


def test_cuda_a_preload_no_replay_takes_loses_no_table_entry(weights, tokenizer):
    """A step staged ahead whose input copies were queued (``preload``: the table
    entries of the blocks its rows open went as patches) and then not launched
    (a refused pick) leaves the device's tables right for the step that runs
    instead: its logits equal those of the same step staged from scratch."""
    from types import SimpleNamespace

    eng = make_engine(weights, tokenizer, "cuda", torch.bfloat16, num_kv_blocks=64,
                      max_num_seqs=8)
    graphs, bs = eng.runner.graphs, eng.config.block_size
    seqs = [SimpleNamespace(request_id=str(i), num_computed_tokens=bs - 1,
                            block_table=[2 * i + 1, 2 * i + 2]) for i in range(4)]
    dev = torch.device("cuda")
    first = torch.tensor([5, 6, 7, 8], device=dev)
    graphs.run_seqs(seqs, first)       # position bs - 1: the last slot of each first block
    picks = torch.tensor([11, 12, 13, 14], device=dev)
    assert graphs.stage_ahead(seqs)    # position bs: each row opens its second block
    assert graphs.preload(picks)
    for s in seqs:                     # (the picks were refused: the step runs unstaged)
        s.num_computed_tokens += 1
    got = graphs.run_seqs(seqs, picks).clone()
    assert graphs.preloaded_replays == 0
    slots = [s.block_table[1] * bs for s in seqs]
    want = graphs.run(picks.tolist(), [bs] * 4, slots, [s.block_table for s in seqs], [bs + 1] * 4)
    assert torch.equal(got, want)
    # the same step preloaded and taken: the replay alone, the same logits
    for s in seqs:
        s.num_computed_tokens -= 1
    graphs.invalidate()
    graphs.run_seqs(seqs, first)
    assert graphs.stage_ahead(seqs) and graphs.preload(picks)
    for s in seqs:
        s.num_computed_tokens += 1
    taken = graphs.run_seqs(seqs, torch.zeros_like(picks), staged=True)
    assert graphs.preloaded_replays == 1 and torch.equal(taken, want)


def test_cuda_graph_outputs_survive_the_next_replay(weights, tokenizer):
    """A decode graph's logits and greedy picks stay as they were through the next
    replay, whatever size it runs (the engine resamples refused picks from them
    after launching the next step): each copy's graphs share a memory pool of
    their own."""
    eng = make_engine(weights, tokenizer, "cuda", torch.bfloat16, num_kv_blocks=300,
                      max_num_seqs=256)
    graphs, bs = eng.runner.graphs, eng.config.block_size
    assert graphs.copies >= 2 and graphs.sizes[-1] == 256
    gen = torch.Generator().manual_seed(0)
    kept = []
    for n in (200, 100, 3, 256, 17, 129, 64, 1, 250):
        tokens = torch.randint(0, tokenizer.vocab_size, (n,), generator=gen).tolist()
        logits = graphs.run(tokens, [0] * n, [i * bs for i in range(n)],
                            [[i] for i in range(n)], [1] * n)
        greedy = graphs.greedy(n)
        kept.append((logits, greedy, logits.clone(), greedy.clone()))
        for view_l, view_g, was_l, was_g in kept[-graphs.copies:]:
            assert torch.equal(view_l, was_l) and torch.equal(view_g, was_g)
    assert not torch.equal(kept[0][2][:100], kept[1][2])  # (the steps differ)


def test_cuda_head_writes_float32_logits_directly():
    from formcast.engine.layers.linear import Linear

    head = Linear(64, 1000, bias=False).to("cuda", torch.bfloat16)
    x = torch.randn(5, 64, device="cuda", dtype=torch.bfloat16)
    got = head.forward_float32(x)
    exact = x.double() @ head.weight.double().t()
    assert got.dtype == torch.float32 and got.shape == (5, 1000)
    assert (got.double() - exact).abs().max() < 1e-4 * exact.abs().max()  # never rounded to bf16
    assert torch.allclose(got, head(x).float(), rtol=1e-2, atol=1e-2)


def test_cuda_greedy_matches_cpu(cuda32, cpu32, tokenizer):
    ps = prompts(tokenizer, 4)
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in cuda32.generate(ps, sp)] == \
        [o.token_ids for o in cpu32.generate(ps, sp)]


def test_cuda_seeded_sampling_repeats(cuda32, tokenizer):
    ids = prompts(tokenizer, 1)[0]
    sp = SamplingParams(max_tokens=16, temperature=1.0, top_k=50, top_p=0.9, seed=7)
    assert cuda32.generate([ids], sp)[0].token_ids == cuda32.generate([ids], sp)[0].token_ids


def test_cuda_preemption_keeps_greedy_outputs(weights, tokenizer, cuda32):
    ps = prompts(tokenizer, 8)
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    longest = max(len(p) for p in ps) + 24
    tiny = make_engine(weights, tokenizer, "cuda", torch.float32,
                       num_kv_blocks=-(-longest // 16) + 2)
    got = tiny.generate(ps, sp)
    assert tiny.scheduler.num_preemptions > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in cuda32.generate(ps, sp)]


def test_cuda_constraint_mask_applies_on_device(cuda32, tokenizer):
    allowed = {tokenizer.encode(str(d))[0] for d in range(10)}
    out = cuda32.generate(prompts(tokenizer, 1), SamplingParams(max_tokens=8, temperature=0.0),
                          constraints=[AllowOnly(allowed, length=8)])[0]
    assert set(out.token_ids) <= allowed and len(out.token_ids) == 8


def test_cuda_json_schema_matcher_output_validates(cuda32, tokenizer):
    import json

    grammars = pytest.importorskip("formcast.grammars")
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 8},
                             "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
    compiled = grammars.compile(grammars.JsonSchema(schema), tokenizer,
                                vocab_size=cuda32.model.config.vocab_size)
    outs = cuda32.generate(prompts(tokenizer, 4),
                           SamplingParams(max_tokens=200, temperature=1.0, seed=3),
                           constraints=[compiled.matcher() for _ in range(4)])
    for out in outs:
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), schema)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_speculation_gives_identical_greedy_outputs(weights, tokenizer, dtype):
    import re

    grammars = pytest.importorskip("formcast.grammars")
    engines = {spec: make_engine(weights, tokenizer, "cuda", dtype, num_kv_blocks=512,
                                 spec=spec) for spec in ("none", "prompt_lookup")}
    # the regex forces long runs (jump-forward drafts); the prompts repeat themselves
    # (prompt-lookup drafts)
    pattern = r"Answer: (weather|climate) report, (sunny|rainy|cloudy) all day\."
    regex = grammars.Regex(pattern)
    for batch in (1, 8):
        results = {}
        for spec, eng in engines.items():
            compiled = grammars.compile(regex, tokenizer, vocab_size=eng.model.config.vocab_size)
            ps = prompts(tokenizer, batch)
            params = SamplingParams(max_tokens=32, temperature=0.0)
            free = eng.generate(ps, params)
            constrained = eng.generate(ps, params,
                                       constraints=[compiled.matcher() for _ in ps])
            results[spec] = (free, constrained)
        constrained = results["prompt_lookup"][1]
        assert sum(o.metrics.num_forced_tokens for o in constrained) > 0
        for out in constrained:
            assert out.finish_reason == "stop" and re.fullmatch(pattern, out.text), out
        if dtype == torch.float32:
            # bfloat16 GEMMs round differently for 1 and 1 + draft rows, so argmax
            # near-ties may flip; float32 must agree exactly (speculation "auto" is
            # float32-only for that reason)
            for plain, spec in zip(results["none"], results["prompt_lookup"]):
                assert [o.token_ids for o in spec] == [o.token_ids for o in plain]

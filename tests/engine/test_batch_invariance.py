"""Batch-invariant mode (EngineConfig.batch_invariant, default on the CPU): a
request's tokens and logprobs are bitwise the same whatever it shares a step with.

A randomized harness runs many requests (mixed lengths, shared prefixes, greedy
and seeded) in several arrangements (alone; together; random batches; staggered
arrivals; a KV budget that forces preemption; every prefill chunked; prefix
caching on; speculative verification on) and compares every token id and every
logprob bit for bit with the requests run alone: on a tiny random Llama (float32
and int4) for most arrangements, and on the real SmolLM2 for a smaller set. The
issue's reproduction (three chat prompts together, then each alone, on the
default engine with prefix caching) is a test of its own.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from formcast.engine import Engine, EngineConfig, SamplingParams
from formcast.engine.kernels import native
from formcast.engine.kernels.invariant_matmul import onednn_linear, tiled_linear
from formcast.engine.kernels.paged_attention_invariant import (invariant_decode_attention,
                                                               invariant_prefill_attention_)
from formcast.engine.speculative import SpecConfig

CPU = torch.device("cpu")
LOOKUP = SpecConfig(method="prompt_lookup", scheduled=False, min_confidence=0.0)

Result = list[tuple[tuple[int, ...], tuple[float, ...]]]  # per request: tokens, logprobs


# -- the requests -------------------------------------------------------------------

def make_requests(n: int, *, seed: int, vocab: tuple[int, int], shared: int, longest: int,
                  max_tokens: tuple[int, int]) -> list[tuple[list[int], SamplingParams]]:
    """``n`` requests: prompts of 2 to ``longest`` tokens, about half starting with
    one of two shared prefixes of ``shared`` tokens (and some repeating their own
    n-grams, for prompt lookup to draft from), half greedy and half seeded."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(*vocab) for _ in range(shared)] for _ in range(2)]
    out = []
    for i in range(n):
        body = [rng.randrange(*vocab) for _ in range(rng.randrange(2, longest - shared))]
        if i % 4 == 1:
            body = body + body[:rng.randrange(1, len(body) + 1)]  # an n-gram to look up
        prompt = (prefixes[i % 2] + body if i % 3 else body)[:longest]
        greedy = i % 2 == 0
        params = SamplingParams(max_tokens=rng.randrange(*max_tokens), ignore_eos=True,
                                logprobs=0, temperature=0.0 if greedy else 0.8,
                                top_p=0.9 if i % 8 == 1 else 1.0,
                                seed=None if greedy else 1000 + i)
        out.append((prompt, params))
    return out


def _result(outs) -> Result:
    return [(tuple(o.token_ids), tuple(lp.logprob for lp in o.logprobs)) for o in outs]


# -- the arrangements -----------------------------------------------------------------

def _engine(model, tok, **config) -> Engine:
    config.setdefault("spec", "none")
    config.setdefault("num_kv_blocks", 512)
    return Engine(model, tok, config=EngineConfig(**config), device=CPU)


def alone(model, tok, requests) -> tuple[list, Engine]:
    eng = _engine(model, tok, enable_prefix_caching=False)
    return [eng.generate([p], sp)[0] for p, sp in requests], eng


def together(model, tok, requests) -> tuple[list, Engine]:
    order = list(range(len(requests)))
    random.Random(1).shuffle(order)
    eng = _engine(model, tok, max_num_seqs=len(requests))
    outs = eng.generate([requests[i][0] for i in order], [requests[i][1] for i in order])
    res: list = [None] * len(requests)
    for i, out in zip(order, outs):
        res[i] = out
    return res, eng


def random_batches(model, tok, requests, **config) -> tuple[list, Engine]:
    rng = random.Random(2)
    eng = _engine(model, tok, **config)
    res: list = []
    i = 0
    while i < len(requests):
        size = rng.randrange(1, 12)
        batch = requests[i:i + size]
        res += eng.generate([p for p, _ in batch], [sp for _, sp in batch])
        i += size
    return res, eng


def staggered(model, tok, requests, **config) -> tuple[list, Engine]:
    """Requests arrive a few at a time while others run (the batch changes every step)."""
    rng = random.Random(3)
    eng = _engine(model, tok, **config)
    pending = list(enumerate(requests))
    ids: dict[str, int] = {}
    done: dict[int, object] = {}
    while pending or eng.has_unfinished_requests():
        for _ in range(min(len(pending), rng.randrange(0, 4))):
            i, (p, sp) = pending.pop(0)
            ids[eng.add_request(p, sp)] = i
        for out in eng.step():
            if out.finished:
                done[ids[out.request_id]] = out
    return [done[i] for i in range(len(requests))], eng


ARRANGEMENTS = {
    "together, prefix caching on": lambda m, t, r: together(m, t, r),
    "random batches, prefix caching on": lambda m, t, r: random_batches(m, t, r),
    "staggered arrivals": lambda m, t, r: staggered(m, t, r, max_num_seqs=8),
    "every prefill chunked": lambda m, t, r: staggered(
        m, t, r, max_num_batched_tokens=7, enable_prefix_caching=False),
    "tiny KV budget (preemption)": lambda m, t, r: random_batches(
        m, t, r, num_kv_blocks=10, max_num_seqs=16, enable_prefix_caching=False),
    "prompt-lookup speculation": lambda m, t, r: random_batches(m, t, r, spec=LOOKUP),
}


def _check(name: str, outs: list, expected: Result, eng: Engine, *,
           exercised: bool = True) -> None:
    got = _result(outs)
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g[0] == e[0], f"{name}: request {i}'s tokens differ from alone"
        assert g[1] == e[1], f"{name}: request {i}'s logprobs differ from alone"
    # the arrangement exercised what it is named for
    if "preemption" in name and exercised:
        assert eng.scheduler.num_preemptions > 0
    if "speculation" in name:
        assert sum(o.metrics.num_draft_tokens for o in outs) > 0


# -- the tiny random model ---------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer():
    from formcast.engine import load_tokenizer

    return load_tokenizer("smollm2")


def _tiny(quantization: str | None):
    from formcast.engine.loading import build_model
    from formcast.engine.models.shapes import SHAPES, random_llama_weights

    cfg = dataclasses.replace(SHAPES["smollm2-135m"], num_hidden_layers=2, hidden_size=64,
                              intermediate_size=128, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=32)
    return build_model(cfg, random_llama_weights(cfg, seed=0, head_std=0.5), device=CPU,
                       dtype=torch.float32, quantization=quantization)


@pytest.fixture(scope="module", params=[None, "int4"], ids=["float32", "int4"])
def tiny_run(request, tokenizer):
    """The tiny model, its requests, and their results run alone (the reference)."""
    model = _tiny(request.param)
    requests = make_requests(40, seed=7, vocab=(200, 20000), shared=40, longest=90,
                             max_tokens=(2, 7))
    outs, _ = alone(model, tokenizer, requests)
    return model, requests, _result(outs)


@pytest.mark.parametrize("name", list(ARRANGEMENTS))
def test_tiny_model_outputs_are_the_same_in_every_arrangement(tiny_run, tokenizer, name):
    model, requests, expected = tiny_run
    outs, eng = ARRANGEMENTS[name](model, tokenizer, requests)
    _check(name, outs, expected, eng)


def test_tiny_model_speculation_verifies_drafts_and_changes_nothing(tiny_run, tokenizer):
    """Prompt lookup drafts (for greedy and seeded requests alike) and every token
    and logprob is that of plain decoding: draws are keyed by (seed, position), and
    a draft token is kept exactly where plain sampling would draw it."""
    model, requests, expected = tiny_run
    eng = _engine(model, tokenizer, spec=LOOKUP, max_num_seqs=len(requests))
    outs = eng.generate([p for p, _ in requests], [sp for _, sp in requests])
    assert _result(outs) == expected
    drafted = [o.metrics.num_draft_tokens for o in outs]
    sampled = [d for d, (_, sp) in zip(drafted, requests) if not sp.greedy]
    assert sum(drafted) > 0 and sum(sampled) > 0


def test_prefix_cache_hits_give_the_same_bits(tiny_run, tokenizer):
    """The second run of every request reads its prompt's full blocks from the
    cache the first run left (and the first run's rows were batched)."""
    model, requests, expected = tiny_run
    eng = _engine(model, tokenizer, max_num_seqs=len(requests))
    eng.generate([p for p, _ in requests], [sp for _, sp in requests])
    again = [eng.generate([p], sp)[0] for p, sp in requests]
    assert sum(o.metrics.num_cached_prompt_tokens for o in again) > 0
    assert _result(again) == expected


# -- the kernels ------------------------------------------------------------------------

@pytest.mark.parametrize(("out_f", "in_f"), [(576, 1536), (1536, 576), (192, 576)])
def test_linears_give_a_row_the_same_bits_at_any_row_count(out_f, in_f):
    torch.manual_seed(0)
    w, x = torch.randn(out_f, in_f), torch.randn(300, in_f)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None) \
        if torch.backends.mkldnn.is_available() else None
    alone_t = tiled_linear(x[:1], w)
    alone_o = onednn_linear(x[:1], packed, None) if packed is not None else None
    for m in (2, 3, 16, 17, 300):
        rows = torch.cat([x[1:m], x[:1]])  # the row last, after m - 1 others
        assert torch.equal(tiled_linear(rows, w)[-1:], alone_t), m
        if packed is not None:
            assert torch.equal(onednn_linear(rows, packed, None)[-1:], alone_o), m
    assert torch.allclose(tiled_linear(x, w), x @ w.t(), atol=1e-4)


@pytest.mark.parametrize("keys", [64, 192, 1024])
def test_the_blas_computes_a_row_the_same_way_from_the_attention_row_tile_on(keys):
    """What the attention's row tile rests on: a batched product's first rows are
    the same bits at every row count that is a multiple of the tile, and in any
    batch of matrices (scores: rows x head dim x keys; weighted values: rows x a
    split of 64 keys x head dim)."""
    from formcast.engine.kernels.paged_attention_invariant import KV_SPLIT, ROW_TILE

    gen = torch.Generator().manual_seed(keys)
    d = 64
    q, k = torch.randn(3, 200, d, generator=gen), torch.randn(3, keys, d, generator=gen)
    p, v = torch.rand(5, 200, KV_SPLIT, generator=gen), torch.randn(5, KV_SPLIT, d, generator=gen)
    scores = torch.bmm(q[:, :ROW_TILE], k.transpose(1, 2))
    values = torch.bmm(p[:, :ROW_TILE], v)
    for m in range(ROW_TILE, 201, ROW_TILE):
        assert torch.equal(torch.bmm(q[:, :m], k.transpose(1, 2))[:, :ROW_TILE], scores), m
        assert torch.equal(torch.bmm(p[:, :m], v)[:, :ROW_TILE], values), m
    for n in (1, 2, 4):
        assert torch.equal(torch.bmm(q[:n, :ROW_TILE], k[:n].transpose(1, 2)), scores[:n])
        assert torch.equal(torch.bmm(p[:n, :ROW_TILE], v[:n]), values[:n])


@pytest.mark.parametrize(("context", "chunk", "window", "softcap"),
                         [(150, 150, None, None), (150, 37, None, None), (64, 1, None, None),
                          (65, 2, None, None), (200, 64, None, None), (150, 37, 24, None),
                          (200, 64, 100, 5.0), (65, 2, None, 3.0)])
def test_attention_gives_a_token_the_same_bits_in_prefill_and_decode(context, chunk, window,
                                                                      softcap):
    """The last ``chunk`` tokens of a ``context``-token sequence, attended as one
    prompt chunk, equal each token attended as a decode row alone and beside a
    longer row; and they match plain causal attention (with its sliding window and
    soft-capping) to float32 rounding."""
    torch.manual_seed(0)
    h, hkv, d, bs, nb = 6, 2, 32, 16, 40
    kc, vc = torch.randn(nb, bs, hkv, d), torch.randn(nb, bs, hkv, d)
    table = torch.randperm(nb)[:-(-context // bs)]
    q = torch.randn(chunk, h, d)
    out = torch.empty(chunk, h, d)
    invariant_prefill_attention_(out, q, kc, vc, [0], [chunk], [context], [table], 0.2,
                                 window=window, softcap=softcap)
    other = torch.randperm(nb)[:nb // 2]
    padded = torch.cat([table, table.new_zeros(len(other) - len(table))])
    for j in range(chunk):
        lens = torch.tensor([context - chunk + j + 1])
        one = invariant_decode_attention(q[j:j + 1], kc, vc, table[None], lens, 0.2,
                                         window=window, softcap=softcap)
        two = invariant_decode_attention(torch.stack([torch.randn(h, d), q[j]]), kc, vc,
                                         torch.stack([other, padded]),
                                         torch.cat([torch.tensor([len(other) * bs]), lens]), 0.2,
                                         window=window, softcap=softcap)
        assert torch.equal(one[0], out[j]) and torch.equal(two[1], out[j]), j
    keys = kc[table].reshape(-1, hkv, d)[:context].repeat_interleave(h // hkv, dim=1)
    vals = vc[table].reshape(-1, hkv, d)[:context].repeat_interleave(h // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * 0.2
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    pos = torch.arange(context - chunk, context).unsqueeze(1)
    key = torch.arange(context).unsqueeze(0)
    hidden = (key > pos) | (key <= pos - window) if window is not None else key > pos
    scores = scores.masked_fill(hidden, float("-inf"))
    ref = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals)
    assert torch.allclose(out, ref, atol=1e-5)


@pytest.mark.parametrize(("value", "device_type", "expected"),
                         [(None, "cpu", True), (None, "cuda", False), (True, "cuda", True),
                          (False, "cpu", False)])
def test_batch_invariant_mode_defaults_on_for_the_cpu_only(value, device_type, expected):
    assert EngineConfig(batch_invariant=value).batch_invariant_on(device_type) is expected


def test_a_bad_batch_invariant_value_is_refused():
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineConfig(batch_invariant="yes")


# -- the real SmolLM2 -----------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_default(smollm2_source):
    """The default CPU engine: the native step on the GGUF's own blocks (int4 linears
    without the extension), prefix caching on."""
    return Engine.from_pretrained(str(smollm2_source.path), device="cpu")


ISSUE_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
                 "List three prime numbers."]


def _chat(eng: Engine, text: str) -> list[int]:
    return list(eng.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                  add_generation_prompt=True, tokenize=True))


def test_issue_reproduction_three_prompts_together_then_alone(smollm2_default):
    """The issue's reproduction: the three prompts together, then each alone, greedy,
    32 tokens, on the default engine (prefix caching on, so the prompts alone read
    the prefix blocks the batched run wrote)."""
    eng = smollm2_default
    assert eng.config.batch_invariant_on("cpu")
    assert eng.quantization == ("gguf" if native.available() else "int4")
    prompts = [_chat(eng, t) for t in ISSUE_PROMPTS]
    greedy = SamplingParams(max_tokens=32, temperature=0.0, logprobs=0)
    batched = _result(eng.generate(prompts, greedy))
    alone_runs = [eng.generate([p], greedy)[0] for p in prompts]
    assert sum(o.metrics.num_cached_prompt_tokens for o in alone_runs) > 0
    assert _result(alone_runs) == batched


SMOLLM2_ARRANGEMENTS = {
    "together": lambda m, t, r: together(m, t, r),
    "every prefill chunked": lambda m, t, r: staggered(
        m, t, r, max_num_batched_tokens=13, enable_prefix_caching=False),
    "tiny KV budget": lambda m, t, r: random_batches(
        m, t, r, num_kv_blocks=7, max_num_seqs=8, enable_prefix_caching=False),
    "prompt-lookup speculation": lambda m, t, r: random_batches(m, t, r, spec=LOOKUP),
}


@pytest.fixture(scope="module")
def smollm2_run(smollm2_default):
    """The default engine's requests run alone (float32 is the tiny model's part)."""
    eng = smollm2_default
    topics = ["the sea", "prime numbers", "a city", "the moon", "bread", "rivers"]
    requests = []
    for i, topic in enumerate(topics):
        prompt = _chat(eng, f"Write one sentence about {topic}, then repeat it.")
        requests.append((prompt, SamplingParams(
            max_tokens=8, ignore_eos=True, logprobs=0, temperature=0.0 if i % 2 else 0.7,
            seed=None if i % 2 else 50 + i)))
    outs, _ = alone(eng.model, eng.tokenizer, requests)
    return eng, requests, _result(outs)


@pytest.mark.parametrize("name", list(SMOLLM2_ARRANGEMENTS))
def test_smollm2_outputs_are_the_same_in_every_arrangement(smollm2_run, name):
    eng, requests, expected = smollm2_run
    outs, ran = SMOLLM2_ARRANGEMENTS[name](eng.model, eng.tokenizer, requests)
    _check(name, outs, expected, ran)


@pytest.mark.parametrize("fn", [torch.sigmoid, torch.nn.functional.silu,
                                torch.nn.functional.softplus])
@pytest.mark.parametrize("width", [1, 3, 16, 2049])
def test_pointwise_gives_a_row_the_same_bits_at_any_row_count(fn, width):
    """sigmoid, silu and softplus round differently in torch's scalar tail than in
    its vector loop; through ``pointwise`` a row's bits are the same alone or among others."""
    from formcast.engine.kernels.invariant_pointwise import pointwise

    x = torch.randn(40, width, generator=torch.Generator().manual_seed(width))
    every = pointwise(fn, x)
    for m in (1, 2, 5, 17, 39):
        assert torch.equal(pointwise(fn, x[:m]), every[:m]), m
    assert torch.allclose(every, fn(x))


@pytest.mark.parametrize("tokens", [2, 9, 40])
def test_moe_experts_give_a_token_the_same_bits_in_any_batch(tokens):
    """The routed experts' grouped GEMM (DeepSeek-V4's MoE, CPU path): a token's
    output alone equals its output among ``tokens`` others routed to the same experts."""
    from formcast.engine.kernels.moe import grouped_expert_mlp

    torch.manual_seed(0)
    e, inter, experts, k = 64, 96, 8, 2
    gate_up, down = torch.randn(experts, 2 * inter, e), torch.randn(experts, e, inter)
    x = torch.randn(tokens + 1, e)
    chosen = torch.stack([torch.randperm(experts)[:k] for _ in range(tokens + 1)])
    weights = torch.rand(tokens + 1, k)
    alone_out = grouped_expert_mlp(x[:1], gate_up, down, chosen[:1], weights[:1], 7.0)
    batched = grouped_expert_mlp(x, gate_up, down, chosen, weights, 7.0)
    assert torch.equal(batched[:1], alone_out)

"""Batch-invariant mode on CUDA (bfloat16, opted into): the harness's arrangements
on the device, and the fixed-plan GEMM (on the device, and under Triton's
interpreter on the CPU)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from formcast.engine import Engine, EngineConfig
from tests.engine.test_batch_invariance import LOOKUP, _check, _result, make_requests
from tests.engine.test_engine_cuda import tokenizer  # noqa: F401  (fixture: the carried one)


# (the CPU machine's stand-in for the device; a device runs the compiled kernels in the
# cuda tests, and the Triton of the device's torch 2.11 cannot interpret a loop whose
# bounds come from program_id)
_interpreter_only = pytest.mark.skipif(torch.cuda.is_available(),
                                       reason="a CUDA device runs the compiled kernels")


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["together, prefix caching on", "every prefill chunked",
                                  "prompt-lookup speculation"])
def test_cuda_bf16_outputs_are_the_same_in_every_arrangement(tokenizer, name):
    """The harness on CUDA in bfloat16 with ``batch_invariant=True`` (off by default
    there): the fixed-tile GEMM, the one attention kernel for every row, keyed draws."""
    from formcast.engine.loading import build_model
    from formcast.engine.models.shapes import SHAPES, random_llama_weights

    cuda = torch.device("cuda")
    cfg = dataclasses.replace(SHAPES["smollm2-135m"], num_hidden_layers=4)
    model = build_model(cfg, random_llama_weights(cfg, seed=0, head_std=0.5), device=cuda,
                        dtype=torch.bfloat16)
    requests = make_requests(24, seed=11, vocab=(200, 20000), shared=40, longest=120,
                             max_tokens=(3, 12))

    def on_cuda(**config) -> Engine:
        config.setdefault("spec", "none")
        config.setdefault("num_kv_blocks", 512)
        return Engine(model, tokenizer, config=EngineConfig(batch_invariant=True, **config),
                      device=cuda)

    ref = on_cuda(enable_prefix_caching=False)
    expected = _result([ref.generate([p], sp)[0] for p, sp in requests])
    if name.startswith("together"):
        eng = on_cuda(max_num_seqs=len(requests))
        outs = eng.generate([p for p, _ in requests], [sp for _, sp in requests])
    else:
        extra = {"max_num_batched_tokens": 16} if "chunked" in name else {"spec": LOOKUP}
        eng = on_cuda(**extra)
        outs = []
        for i in range(0, len(requests), 5):
            batch = requests[i:i + 5]
            outs += eng.generate([p for p, _ in batch], [sp for _, sp in batch])
    _check(name, outs, expected, eng)


_TRITON_GEMM_CASES = textwrap.dedent("""
    import torch
    from torch.nn import functional as F
    from formcast.engine.kernels.invariant_matmul_triton import GemmPlan, invariant_linear_triton
    torch.manual_seed(0)
    split = GemmPlan(block_m=16, block_n=32, block_k=64, splits=3)  # K = 640: 4, 4, 2 tiles
    # (N, K, options): plain with a bias; the norm's row scale; the gate on a [2I, K]
    # weight; the residual add; K split three ways. Ragged N and K: the tiles' edges
    for n, k, opts in [(130, 200, {}), (40, 96, {"scale_eps": 1e-5}),
                       (80, 70, {"gated": True, "scale_eps": 1e-6}), (40, 128, {"res": 1}),
                       (40, 640, {"plan": split}),
                       (80, 640, {"plan": split, "gated": True, "scale_eps": 1e-5}),
                       (40, 650, {"plan": split, "res": 1})]:
        w, b, x = torch.randn(n, k), torch.randn(n), torch.randn(150, k)
        width = n // 2 if opts.get("gated") else n
        res = torch.randn(150, width)

        def run(rows, r=res):
            kw = {key: v for key, v in opts.items() if key != "res"}
            return invariant_linear_triton(rows, w, b, residual=r if "res" in opts else None,
                                           **kw)

        want = x @ w.t()
        if "scale_eps" in opts:
            want = want / torch.sqrt((x * x).mean(1, keepdim=True) + opts["scale_eps"])
        want = want + b
        if opts.get("gated"):
            gate, up = want.chunk(2, dim=-1)
            want = F.silu(gate) * up
        if "res" in opts:
            want = want + res
        assert torch.allclose(run(x), want, atol=1e-3, rtol=1e-4), (n, k, opts)
        alone = run(x[:1], res[:1])
        for m in (2, 65, 150):
            rows = torch.cat([x[1:m], x[:1]])  # the row last, after m - 1 others
            got = run(rows, torch.cat([res[1:m], res[:1]]))
            assert torch.equal(got[-1:], alone), (n, k, opts, m)
    print("ok")
""")


@_interpreter_only
def test_triton_gemm_gives_a_row_the_same_bits_at_any_row_count():
    """The CUDA linears' fixed-plan GEMM (tiles chosen by the weight's shape, never
    by the row count), run by Triton's interpreter on the CPU: right, and a row
    alone equals that row among 1 to 149 others, plain and with each step the
    GEMM can carry (the norm's row scale, the gate, the residual add), with the
    whole K in one program and with K split (partials added in split order)."""
    pytest.importorskip("triton")
    run = subprocess.run([sys.executable, "-c", _TRITON_GEMM_CASES], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-3000:]


@pytest.mark.cuda
@pytest.mark.parametrize(("out_f", "in_f", "opts"), [
    (960, 576, {"scale_eps": 1e-5}), (576, 576, {"res": 1}),
    (3072, 576, {"gated": True, "scale_eps": 1e-5}), (576, 1536, {"res": 1}),
    (49152, 576, {"out_dtype": torch.float32})])
def test_cuda_gemm_gives_a_row_the_same_bits_at_any_row_count(out_f, in_f, opts):
    """On the device, bfloat16 at a small model's projection shapes, each with
    the step a decoder layer has it carry (the head written in float32): a row
    alone equals that row among up to 4095 others, and the product is right."""
    from formcast.engine.kernels.invariant_matmul_triton import invariant_linear_triton

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    w = (torch.randn(out_f, in_f, device=dev, generator=gen) * in_f ** -0.5).bfloat16()
    x = torch.randn(4096, in_f, device=dev, generator=gen).bfloat16()
    width = out_f // 2 if opts.get("gated") else out_f
    res = torch.randn(4096, width, device=dev, generator=gen).bfloat16()
    kw = {key: v for key, v in opts.items() if key != "res"}

    def run(rows, r):
        return invariant_linear_triton(rows, w, residual=r if "res" in opts else None, **kw)

    alone = run(x[:1], res[:1])
    for m in (2, 7, 64, 65, 256, 1000, 4096):
        assert torch.equal(run(torch.cat([x[1:m], x[:1]]), torch.cat([res[1:m], res[:1]]))[-1:],
                           alone), m
    want = x.float() @ w.float().t()
    if "scale_eps" in opts:
        want = want / torch.sqrt((x.float() ** 2).mean(1, keepdim=True) + opts["scale_eps"])
    if opts.get("gated"):
        gate, up = want.chunk(2, dim=-1)
        want = torch.nn.functional.silu(gate) * up
    if "res" in opts:
        want = want + res.float()
    got = run(x, res).float()
    assert ((got - want).norm() / want.norm()).item() < 1e-2




_FUSED_ATTENTION_CASES = textwrap.dedent("""
    import torch
    from formcast.engine.kernels.paged_attention_triton import rope_decode_attention_triton
    from formcast.engine.kernels.rope_triton import apply_rope_and_store_kv_triton_
    from formcast.engine.layers.rotary import RotaryEmbedding
    torch.manual_seed(0)
    H, HKV, D, BS, L, NB = 6, 2, 32, 16, 40, 4
    cos, sin = RotaryEmbedding(D, 512, 10000.0, None).tables(torch.device("cpu"))
    for window in (None, 24):
        qkv = torch.randn(L, (H + 2 * HKV) * D)
        kc, vc = torch.zeros(NB + 1, BS, HKV, D), torch.zeros(NB + 1, BS, HKV, D)
        pos, table = torch.arange(L), torch.arange(NB).view(1, NB)
        # a prompt of L rows: every key stored (rotating a copy), then every row attends
        qk = qkv[:, :(H + HKV) * D].clone().view(L, H + HKV, D)
        apply_rope_and_store_kv_triton_(qk, qkv[:, (H + HKV) * D:].view(L, HKV, D), pos, cos,
                                        sin, kc, vc, pos)
        stored = kc.clone()
        prompt = rope_decode_attention_triton(qkv, H, HKV, pos, cos, sin, kc, vc, pos,
                                              table.expand(L, NB), pos + 1, 0.125,
                                              window=window, invariant=True)
        assert torch.equal(kc, stored)  # (the kernel stores the bits the rotation stored)
        for p in (1, 17, L - 1):  # the same token as a lone decode row
            k2, v2 = stored.clone(), vc.clone()
            one = rope_decode_attention_triton(qkv[p:p + 1], H, HKV, pos[p:p + 1], cos, sin,
                                               k2, v2, pos[p:p + 1], table, pos[p:p + 1] + 1,
                                               0.125, window=window, invariant=True)
            assert torch.equal(one, prompt[p:p + 1]), (window, p)
    print("ok")
""")


@_interpreter_only
def test_fused_attention_gives_a_token_the_same_bits_in_a_prompt_and_a_decode_step():
    """The mode's attention on CUDA (fused rotation and attention, one configuration,
    no split), run by Triton's interpreter: a prompt's rows, their keys stored
    first, get the bits each token gets as a lone decode row."""
    pytest.importorskip("triton")
    run = subprocess.run([sys.executable, "-c", _FUSED_ATTENTION_CASES], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-3000:]


_LAYER_CASES = textwrap.dedent("""
    import copy, dataclasses, torch
    from formcast.engine.layers.attention import AttentionMetadata, PrefillSpan
    from formcast.engine.loading import build_model
    from formcast.engine.models.shapes import SHAPES, random_llama_weights
    cfg = dataclasses.replace(SHAPES["smollm2-135m"], num_hidden_layers=2, hidden_size=64,
                              intermediate_size=128, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=32, vocab_size=512)
    model = build_model(cfg, random_llama_weights(cfg, seed=0, head_std=0.5),
                        device=torch.device("cpu"), dtype=torch.float32)
    folded = copy.deepcopy(model)
    assert folded.fold_norms()
    BS, NB = 16, 8

    def meta(rows, invariant=True):  # rows: (positions, block table, a decode row?)
        slots, dec, spans, t = [], ([], [], []), [], 0
        for pos, table, decode in rows:
            slots += [table[p // BS] * BS + p % BS for p in pos]
            if decode:
                dec[0].append(t), dec[1].append(table), dec[2].append(pos[0] + 1)
            else:
                spans.append(PrefillSpan(start=t, length=len(pos), context_len=pos[-1] + 1,
                                         block_table=torch.tensor(table)))
            t += len(pos)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots), decode_rows=torch.tensor(dec[0], dtype=torch.long),
            decode_block_tables=torch.tensor(dec[1], dtype=torch.long).view(-1, NB),
            decode_lens=torch.tensor(dec[2], dtype=torch.long), prefills=tuple(spans),
            one_token_rows=not spans, batch_invariant=invariant)

    def run(m, tokens, positions, kv, rows, step=True):
        x, pos, pending = m.model.embed(torch.tensor(tokens)), torch.tensor(positions), None
        md = meta(rows, invariant=step)
        for layer, cache in zip(m.model.layers, kv):
            go = layer.invariant_step if step else layer.forward
            x, pending = go(x, pending, pos, m.model.rotary, cache, md)
        return x if pending is None else x + pending

    def caches():
        return [torch.zeros(2, NB + 1, BS, 2, 32) for _ in range(2)]

    torch.manual_seed(0)
    a, b = torch.randint(0, 512, (24,)).tolist(), torch.randint(0, 512, (9,)).tolist()
    ta, tb = list(range(NB)), [4, 5, 6, 7, 0, 1, 2, 3]
    r = lambda lo, hi: list(range(lo, hi))
    full = run(folded, a, r(0, 24), caches(), [(r(0, 24), ta, False)])
    ref = run(model, a, r(0, 24), caches(), [(r(0, 24), ta, False)], step=False)
    assert torch.allclose(full, ref, atol=2e-4, rtol=1e-3), (full - ref).abs().max()
    kv = caches()  # chunks of 10 and 9, then decode steps
    assert torch.equal(run(folded, a[:10], r(0, 10), kv, [(r(0, 10), ta, False)]), full[:10])
    assert torch.equal(run(folded, a[10:19], r(10, 19), kv, [(r(10, 19), ta, False)]),
                       full[10:19])
    for p in range(19, 22):
        assert torch.equal(run(folded, [a[p]], [p], kv, [([p], ta, True)]), full[p:p + 1]), p
    kv = caches()  # a decode row of a beside b's prompt in one step
    run(folded, a[:23], r(0, 23), kv, [(r(0, 23), ta, False)])
    mixed = run(folded, [a[23]] + b, [23] + r(0, 9), kv, [([23], ta, True), (r(0, 9), tb, False)])
    assert torch.equal(mixed[:1], full[23:]), "a decode row beside a prompt"
    assert torch.equal(mixed[1:], run(folded, b, r(0, 9), caches(), [(r(0, 9), tb, False)]))
    kv = caches()  # four rows of one sequence in a step (verification)
    run(folded, a[:20], r(0, 20), kv, [(r(0, 20), ta, False)])
    assert torch.equal(run(folded, a[20:], r(20, 24), kv, [(r(20, 24), ta, False)]), full[20:])
    print("ok")
""")


@_interpreter_only
def test_folded_layer_step_gives_a_token_the_same_bits_in_every_arrangement():
    """A folded Llama layer's step in the mode (``LlamaDecoderLayer.invariant_step``:
    the GEMMs carrying the norms, gate and residual adds, every row through the
    fused rope-and-attend kernel), run by Triton's interpreter on a tiny model:
    close to the ordinary layers, and a token's hidden state has the same bits in
    one prompt, in chunks, as a decode step, beside another sequence's prompt and
    among verification rows."""
    pytest.importorskip("triton")
    run = subprocess.run([sys.executable, "-c", _LAYER_CASES], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-3000:]

import pytest
import torch
from torch import nn

from formcast.engine import SamplingParams
from formcast.engine.layers.quant import (Bf16Linear, Int4Linear, Int8Linear, quantize_int4,
                                          quantize_linears)


def test_int4_codes_reproduce_q4_1_blocks_exactly():
    # a weight made of Q4_1 blocks (value = d * q + m, q in 0..15, each block spans 0..15)
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (32, 64), generator=gen)
    q[:, ::32] = 0
    q[:, 1::32] = 15
    d = torch.rand(32, 2, generator=gen) * 0.01 + 0.001
    m = -torch.rand(32, 2, generator=gen) * 0.05
    w = d.repeat_interleave(32, 1) * q + m.repeat_interleave(32, 1)
    codes, sz = quantize_int4(w)
    assert torch.equal(codes, q.to(torch.int32))
    deq = (codes.view(32, 2, 32) - 8) * sz.transpose(0, 1)[..., :1] + sz.transpose(0, 1)[..., 1:]
    assert (deq.view(32, 64) - w).abs().max() < 1e-6


@pytest.mark.parametrize("cls, tol", [(Int4Linear, 0.08), (Int8Linear, 0.02), (Bf16Linear, 0.01)])
def test_quantized_linear_tracks_float(cls, tol):
    lin = nn.Linear(128, 64)
    x = torch.randn(5, 128)
    ref = lin(x)
    out = cls(lin)(x)
    assert out.dtype == x.dtype and out.shape == ref.shape
    assert ((out - ref).norm() / ref.norm()).item() < tol


needs_fbgemm = pytest.mark.skipif(
    "fbgemm" not in torch.backends.quantized.supported_engines,
    reason="FBGEMM (the integer int8 path) is not in this torch build; Int8Linear then "
           "runs torch's bfloat16-activation kernel, tested above")


def _int8_pair(in_f=96, out_f=80, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(in_f, out_f, bias=True)
    fast = Int8Linear(lin)
    assert fast.integer is not None
    plain = Int8Linear(lin)
    plain.integer = None          # torch's bfloat16-activation int8 kernel
    return lin, fast, plain


@needs_fbgemm
def test_integer_int8_path_is_exact_to_the_int8_weights():
    # the reference: the same int8 codes dequantized and multiplied in float64
    lin, fast, plain = _int8_pair()
    x = torch.randn(9, 96) * torch.linspace(0.1, 30, 96)  # outlier features, as in LLMs
    x[3] = 0.0                                            # an all-zero row
    w = fast.codes.double() * fast.scales.double()[:, None]
    # scales are bfloat16 on the fallback path; the integer path keeps them in float32
    w_exact = fast.codes.double() * (lin.weight.detach().double().abs().amax(1) / 127)[:, None]
    ref = x.double() @ w_exact.T + lin.bias.detach().double()
    out = fast(x)
    err = (out.double() - ref).abs().max().item()
    assert err < 2e-3 * ref.abs().max().item(), err
    assert torch.equal(out[3], lin.bias.detach())
    # at least as close as the bfloat16-activation kernel it replaces
    ref_plain = x.double() @ w.T + lin.bias.detach().double()
    assert err <= (plain(x).double() - ref_plain).abs().max().item()


@needs_fbgemm
def test_integer_int8_rows_do_not_depend_on_their_batch():
    _, fast, _ = _int8_pair(seed=1)
    x = torch.randn(33, 96) * 4
    x[7] *= 100                     # a row with a far larger range than the others
    whole = fast(x)
    for rows in ([0], [7], [1, 2], list(range(3, 11)), list(range(33))[::-1]):
        assert torch.equal(fast(x[rows]), whole[rows])


@needs_fbgemm
def test_integer_int8_packs_for_fbgemm_whatever_the_process_engine():
    _, usual, _ = _int8_pair()
    x = torch.randn(5, 96) * 3
    before = torch.backends.quantized.engine
    try:
        torch.backends.quantized.engine = "qnnpack"
        _, other, _ = _int8_pair()
        assert torch.backends.quantized.engine == "qnnpack"   # restored after packing
        assert torch.equal(other(x), usual(x))
    finally:
        torch.backends.quantized.engine = before


@needs_fbgemm
def test_integer_int8_first_pass_sees_the_codes_whose_residual_is_sent():
    # the residual is only exact if our rounding of a row is FBGEMM's own
    lin, fast, _ = _int8_pair()
    rows = fast.integer
    scale = (lin.weight.detach().abs().amax(1) / 127).double()  # as packed (from float32)
    w = fast.codes.double() * scale[:, None]
    x = torch.randn(64, 96) * torch.linspace(0.1, 30, 96)
    u = x / x.abs().amax(1, keepdim=True)          # rows reach -1 and +1 exactly
    codes = torch.round(u / rows.step) + rows.zero
    assert codes.max() == 128 and codes.min() == 0
    y = torch.ops.quantized.linear_dynamic(torch.cat([u, rows.pin]), rows.packed, True)[:64]
    expect = ((codes - rows.zero) * rows.step).double() @ w.T
    assert (y.double() - expect).abs().max().item() < 1e-6


def test_quantize_linears_replaces_layers_and_keeps_the_head_at_8_bits():
    model = nn.Sequential()
    model.add_module("body", nn.Linear(64, 32))
    model.add_module("odd", nn.Linear(40, 16))      # not a multiple of 32: int8
    model.add_module("lm_head", nn.Linear(32, 48))
    assert quantize_linears(model, "int4") == 3
    assert isinstance(model.body, Int4Linear) and isinstance(model.odd, Int8Linear)
    assert isinstance(model.lm_head, Int8Linear)
    quantize_linears(model, "int4", head="bfloat16")  # already quantized: nothing to do
    fresh = nn.Sequential()
    fresh.add_module("lm_head", nn.Linear(32, 48))
    quantize_linears(fresh, "int4", head="bfloat16")
    assert isinstance(fresh.lm_head, Bf16Linear)
    with pytest.raises(ValueError, match="head format"):
        quantize_linears(fresh, "int4", head="int2")
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize_linears(model, "fp8")


@pytest.mark.slow
def test_int4_engine_on_smollm2_stays_close_to_float(smollm2_engine, smollm2_source):
    from formcast.engine import Engine

    q = Engine.from_pretrained(str(smollm2_source.path), device="cpu", quantization="int4")
    tok = q.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of Italy?"}],
                                  tokenize=True)
    a, b = q.forward_logits(ids, as_generated=True), smollm2_engine.forward_logits(ids)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.85
    assert (a - b).abs().mean() < 0.3
    out = q.generate([ids], SamplingParams(max_tokens=16, temperature=0.0))[0]
    assert out.finish_reason == "stop" and out.text.strip()


def test_quantization_is_cpu_only():
    from formcast.engine.loading import build_model
    from formcast.engine.models.shapes import SHAPES

    with pytest.raises(ValueError, match="CPU only"):
        build_model(SHAPES["smollm2-135m"], {}, device=torch.device("cuda"), dtype=torch.float32,
                    quantization="int4")


# ---------------------------------------------------- a GGUF's own 4-bit blocks

@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_int4_blocks_split_gguf_bytes_into_the_values_gguf_defines(qtype):
    import gguf.quants
    import numpy as np
    from gguf import GGMLQuantizationType

    from formcast.engine.loader.gguf import _int4_blocks

    kind = GGMLQuantizationType[qtype]
    w = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
    raw = gguf.quants.quantize(w, kind)
    blocks = _int4_blocks(raw, qtype, (16, 64))
    assert blocks.codes.dtype == torch.uint8 and int(blocks.codes.max()) <= 15
    expected = torch.from_numpy(gguf.quants.dequantize(raw, kind))
    assert torch.equal(blocks.dequantize(), expected)
    # the layer on those blocks computes with exactly those codes
    layer = Int4Linear.from_blocks(blocks.codes, blocks.scale, blocks.zero)
    x = torch.randn(3, 64)
    ref = x.bfloat16().float() @ expected.T
    assert ((layer(x) - ref).norm() / ref.norm()).item() < 0.01
    with pytest.raises(ValueError, match="needs"):
        _int4_blocks(raw[:, :-1], qtype, (16, 64))


def test_the_smollm2_gguf_q4_1_blocks_are_its_float_weights(smollm2_engine, smollm2_gguf):
    from formcast.engine.loading import fuse_int4_blocks
    from formcast.engine.loader.gguf import read_int4_blocks

    blocks = read_int4_blocks(smollm2_gguf)
    assert len(blocks) == 7 * 30  # q, k, v, o, gate, up, down of 30 layers
    fused = fuse_int4_blocks(blocks)
    layer = smollm2_engine.model.model.layers[3]
    for name, module in (("self_attn.qkv_proj", layer.self_attn.qkv_proj),
                         ("mlp.gate_up_proj", layer.mlp.gate_up_proj),
                         ("mlp.down_proj", layer.mlp.down_proj)):
        assert torch.equal(fused[f"model.layers.3.{name}"].dequantize(), module.weight)


@pytest.fixture(scope="module")
def int4_engine(smollm2_source):
    from formcast.engine import Engine

    return Engine.from_pretrained(str(smollm2_source.path), device="cpu", quantization="int4")


def _chat(engine, text):
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                add_generation_prompt=True, tokenize=True)


def test_int4_quantization_takes_a_q4_ggufs_own_4bit_blocks(int4_engine):
    from formcast.engine import Engine

    assert int4_engine.quantization == "int4"
    assert isinstance(int4_engine.model.model.layers[0].mlp.down_proj, Int4Linear)
    assert isinstance(int4_engine.model.lm_head, Int8Linear)
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        Engine.from_pretrained("smollm2", device="cpu", quantization="int3")


def test_prompt_rows_run_float32_and_generated_rows_int4(int4_engine, smollm2_engine):
    ids = _chat(int4_engine, "Name three rivers.")
    as_prompt = int4_engine.forward_logits(ids)
    # a prompt runs on the float32 weights the file's blocks decode to: the float
    # engine's logits, bit for bit
    assert torch.equal(as_prompt, smollm2_engine.forward_logits(ids))
    generated = int4_engine.forward_logits(ids, as_generated=True)
    assert not torch.equal(generated, as_prompt)
    assert (generated - as_prompt).abs().mean() < 0.3


def test_int4_outputs_do_not_depend_on_batching_chunking_or_speculation(int4_engine):
    from formcast.engine import Engine, EngineConfig
    from formcast.engine.speculative import SpecConfig

    prompts = [_chat(int4_engine, t) for t in
               ("Write a haiku about rain.", "Count from one to ten in words.",
                "Summarise: the cat sat on the mat because it was warm there.")]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def run(batch, **config):
        engine = Engine(int4_engine.model, int4_engine.tokenizer,
                        config=EngineConfig(**config), device=int4_engine.device)
        outs = []
        for i in range(0, len(prompts), batch):
            outs += [o.token_ids for o in engine.generate(prompts[i:i + batch], greedy)]
        return outs

    alone = run(1, spec=SpecConfig(method="none"))
    # a step mixes one request's prompt rows (float32) with another's decode rows
    # (int4); small chunks split prompts across steps; drafts add verification rows
    assert run(3, spec=SpecConfig(method="none")) == alone
    assert run(3, spec=SpecConfig(method="none"), max_num_batched_tokens=16) == alone
    assert run(1, spec=SpecConfig(method="prompt_lookup", scheduled=False)) == alone

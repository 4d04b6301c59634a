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


def test_quantize_linears_replaces_layers_and_keeps_the_head_in_bf16():
    model = nn.Sequential()
    model.add_module("body", nn.Linear(64, 32))
    model.add_module("odd", nn.Linear(40, 16))      # not a multiple of 32: int8
    model.add_module("lm_head", nn.Linear(32, 48))
    assert quantize_linears(model, "int4") == 3
    assert isinstance(model.body, Int4Linear) and isinstance(model.odd, Int8Linear)
    assert isinstance(model.lm_head, Bf16Linear)
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize_linears(model, "fp8")


@pytest.mark.slow
def test_int4_engine_on_smollm2_stays_close_to_float(smollm2_engine, smollm2_source):
    from formcast.engine import Engine

    q = Engine.from_pretrained(str(smollm2_source.path), device="cpu", quantization="int4")
    tok = q.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of Italy?"}],
                                  tokenize=True)
    a, b = q.forward_logits(ids), smollm2_engine.forward_logits(ids)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.85
    assert (a - b).abs().mean() < 0.3
    out = q.generate([ids], SamplingParams(max_tokens=16, temperature=0.0))[0]
    assert out.finish_reason == "stop" and out.text.strip()


def test_quantization_is_cpu_only():
    from formcast.engine.engine import build_model
    from formcast.engine.models.shapes import SHAPES

    with pytest.raises(ValueError, match="CPU only"):
        build_model(SHAPES["smollm2-135m"], {}, device=torch.device("cuda"), dtype=torch.float32,
                    quantization="int4")

"""Folding a Llama model's norm weights into its projections
(``LlamaForCausalLM.fold_norms``, done on CUDA in bfloat16): the same
model up to rounding, on the ordinary path and on the folded decode step (six
kernels a layer on CUDA), which runs here on the CPU through the kernels' torch
references."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from formcast.engine import Engine, EngineConfig, SamplingParams
from formcast.engine.loading import build_model
from formcast.engine.models import llama
from formcast.engine.models.shapes import SHAPES, random_llama_weights

from .helpers import count_calls, logprobs_agree_until_a_tie

CFG = dataclasses.replace(SHAPES["smollm2-135m"], num_hidden_layers=3, hidden_size=64,
                          intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, vocab_size=300)
PROMPTS = [[5, 17, 42, 9], [100, 3], [7] * 11, [250, 1, 2, 3, 4, 5]]


def _weights(cfg=CFG):
    weights = random_llama_weights(cfg, seed=3, head_std=0.5)
    # norms of their own (a model's are seldom all ones), as folding must respect them
    gen = torch.Generator().manual_seed(4)
    for name in list(weights):
        if name.endswith("layernorm.weight"):
            weights[name] = torch.rand(weights[name].shape, generator=gen) + 0.5
    return weights


def _engine(model, tokenizer) -> Engine:
    return Engine(model, tokenizer, config=EngineConfig(num_kv_blocks=64, block_size=16, spec="none"),
                  device=torch.device("cpu"))


def test_folded_norms_give_the_same_model(smollm2_engine):
    tok = smollm2_engine.tokenizer
    weights = _weights()
    kept = {k: v.clone() for k, v in weights.items()}
    plain = build_model(CFG, weights, device=torch.device("cpu"), dtype=torch.float32)
    folded = build_model(CFG, weights, device=torch.device("cpu"), dtype=torch.float32)
    assert folded.fold_norms() and folded.fold_norms()  # (again: nothing more to do)
    layer = folded.model.layers[0]
    assert layer.folded and torch.equal(layer.input_layernorm.weight, torch.ones(CFG.hidden_size))
    assert not torch.equal(layer.self_attn.qkv_proj.weight,
                           plain.model.layers[0].self_attn.qkv_proj.weight)
    assert all(torch.equal(weights[k], v) for k, v in kept.items())  # (the caller's tensors)
    with pytest.raises(ValueError, match="folded"):  # (its projections are not the file's)
        folded.load_weights(weights)
    a, b = _engine(plain, tok), _engine(folded, tok)
    for ids in PROMPTS:
        assert (a.forward_logits(ids) - b.forward_logits(ids)).abs().max().item() <= 1e-4


def test_the_folded_decode_step_gives_the_plain_steps_outputs(smollm2_engine, monkeypatch):
    """The folded layers' decode step (the projections on the residual stream,
    each row scaled by its inverse RMS in the attention and the gate, the
    residual adds in the output projections), forced on the CPU's decode steps:
    the plain model's greedy tokens and log-probabilities."""
    weights = _weights()
    plain = build_model(CFG, weights, device=torch.device("cpu"), dtype=torch.float32)
    folded = build_model(CFG, weights, device=torch.device("cpu"), dtype=torch.float32)
    folded.fold_norms()
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    tok = smollm2_engine.tokenizer
    want = _engine(plain, tok).generate(PROMPTS, sp)
    steps = count_calls(monkeypatch, llama.LlamaDecoderLayer, "_folded_decode")
    monkeypatch.setattr(llama.LlamaAttention, "decodes_fused", lambda self, x, meta: (
        meta.one_token_rows and not meta.prefills and meta.num_decodes == x.shape[0]))
    got = _engine(folded, tok).generate(PROMPTS, sp)
    assert steps  # (the folded step ran)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    compared, total = logprobs_agree_until_a_tie(got, want, 1e-4)
    assert compared == total == 12 * len(PROMPTS)


def test_projections_with_a_bias_are_not_folded():
    cfg = dataclasses.replace(CFG, attention_bias=True)
    weights = _weights(cfg)
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    for i in range(cfg.num_hidden_layers):
        for proj, size in (("q", q), ("k", kv), ("v", kv), ("o", cfg.hidden_size)):
            weights[f"model.layers.{i}.self_attn.{proj}_proj.bias"] = torch.randn(size) * 0.1
    model = build_model(cfg, weights, device=torch.device("cpu"), dtype=torch.float32)
    before = model.model.layers[0].self_attn.qkv_proj.weight.clone()
    assert not model.fold_norms()
    assert not model.model.layers[0].folded
    assert torch.equal(model.model.layers[0].self_attn.qkv_proj.weight, before)

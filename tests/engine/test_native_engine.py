"""The default model on the CPU runs on its GGUF's own blocks: what is loaded, how
close it stays to float32, and that a request's tokens do not depend on its batch."""

from __future__ import annotations

import pytest
import torch

from formcast.engine.layers.quant import GGUFEmbedding, GGUFLinear

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gguf_engine(smollm2_source):
    from formcast.engine import Engine

    return Engine.from_pretrained(str(smollm2_source.path), device="cpu", quantization="gguf")


def _chat(engine, text: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                add_generation_prompt=True, tokenize=True)


def test_gguf_on_the_cpu_keeps_the_files_blocks(gguf_engine):
    model = gguf_engine.model
    assert gguf_engine.quantization == "gguf"
    layer = model.model.layers[0]
    for module, types in ((layer.self_attn.qkv_proj, ("Q4_1",)),
                          (layer.self_attn.o_proj, ("Q4_1",)),
                          (layer.mlp.gate_up_proj, ("Q4_1",)),
                          (layer.mlp.down_proj, ("Q4_1",)),
                          (model.lm_head, ("Q8_0",))):
        assert isinstance(module, GGUFLinear) and module.qtypes == types
    assert isinstance(model.model.embed_tokens, GGUFEmbedding)
    # the tied head reads the embedding's blocks: one copy
    assert model.lm_head.parts[0][0].data_ptr() == model.model.embed_tokens.blocks.data_ptr()
    assert not any(p.numel() > 1_000_000 for p in model.parameters())  # no float matrices


@pytest.mark.parametrize("text", ["The capital of France is", "def fibonacci(n):"])
def test_logits_stay_close_to_float32(gguf_engine, smollm2_engine, text):
    ids = _chat(gguf_engine, text)
    mine = gguf_engine.forward_logits(ids)[-1]
    ref = smollm2_engine.forward_logits(ids)[-1]
    assert ref.argmax() in mine.topk(3).indices  # (the top two may trade places)
    assert (mine - ref).abs().mean() < 0.5


def test_a_requests_tokens_do_not_depend_on_its_batch(gguf_engine):
    from formcast.engine import SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    # prompts shorter than a KV block: nothing comes from the prefix cache, whose
    # attention over cached keys rounds differently (issue 69's business)
    prompts = [gguf_engine.tokenizer.encode(t) for t in
               ("The color of the sky is", "One, two, three,", "Bonjour means")]
    assert max(map(len, prompts)) < gguf_engine.config.block_size
    alone = [gguf_engine.generate([p], params)[0].token_ids for p in prompts]
    together = [o.token_ids for o in gguf_engine.generate(prompts, params)]
    assert together == alone

"""The native decoder-layer step (a GGUF model's layers on the CPU) against the torch
layer it replaces, on tiny random models in both block families; a row's bits alone
and in a batch, as a prompt row and as a decode row; and the torch path with the
extension off."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from formcast.engine.config import LlamaConfig
from formcast.engine.kernels import native
from formcast.engine.layers.attention import AttentionMetadata, PrefillSpan
from formcast.engine.loader.gguf_blocks import Blocks
from formcast.engine.loading import build_gguf_model
from formcast.engine.models.llama import LlamaDecoderLayer

from tests.engine.test_native_kernels import random_blocks

needs_native = pytest.mark.skipif(not native.available(),
                                  reason=f"native kernels unavailable: {native.unavailable_reason()}")

BLOCK = 4  # KV block size: rows span several blocks
# family: (config sizes, block type of q|k, v, o, gate, up, down)
FAMILIES = {
    "legacy": (dict(hidden_size=288, intermediate_size=160, num_attention_heads=3,
                    num_key_value_heads=1, head_dim=32),
               ("Q4_0", "Q8_0", "Q4_1", "Q4_0", "Q4_0", "Q8_0")),
    "k-quants": (dict(hidden_size=768, intermediate_size=256, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64),
                 ("Q4_K", "Q6_K", "Q5_K", "Q4_K", "Q4_K", "Q6_K")),
}


def tiny_model(family: str, layers: int = 2):
    sizes, (qk, v, o, gate, up, down) = FAMILIES[family]
    config = LlamaConfig(vocab_size=64, num_hidden_layers=layers, rms_norm_eps=1e-5,
                         max_position_embeddings=128, **sizes)
    e, i = config.hidden_size, config.intermediate_size
    nq, nkv = config.num_attention_heads * config.head_dim, \
        config.num_key_value_heads * config.head_dim
    gen = torch.Generator().manual_seed(7)
    weights: dict = {}
    seed = 0

    def blocks(qtype: str, rows: int, inputs: int) -> Blocks:
        nonlocal seed
        seed += 1
        return Blocks(random_blocks(qtype, rows, inputs, seed=seed), qtype, inputs)

    for n in range(layers):
        pre = f"model.layers.{n}"
        weights[f"{pre}.self_attn.q_proj.weight"] = blocks(qk, nq, e)
        weights[f"{pre}.self_attn.k_proj.weight"] = blocks(qk, nkv, e)
        weights[f"{pre}.self_attn.v_proj.weight"] = blocks(v, nkv, e)
        weights[f"{pre}.self_attn.o_proj.weight"] = blocks(o, e, nq)
        weights[f"{pre}.mlp.gate_proj.weight"] = blocks(gate, i, e)
        weights[f"{pre}.mlp.up_proj.weight"] = blocks(up, i, e)
        weights[f"{pre}.mlp.down_proj.weight"] = blocks(down, e, i)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            weights[f"{pre}.{norm}.weight"] = 1 + 0.1 * torch.randn(e, generator=gen)
    weights["model.norm.weight"] = torch.ones(e)
    weights["model.embed_tokens.weight"] = blocks("Q8_0", 64, e)
    return build_gguf_model(config, weights)


def empty_cache(model, blocks: int = 64) -> list[torch.Tensor]:
    c = model.config
    return [torch.zeros(2, blocks, BLOCK, c.num_key_value_heads, c.head_dim)
            for _ in range(c.num_hidden_layers)]


def decode_meta(tables: list[list[int]], lens: list[int]) -> AttentionMetadata:
    """Decode rows (one a sequence): row b at position lens[b] - 1 over tables[b]."""
    width = max(map(len, tables))
    slots = [t[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for t, n in zip(tables, lens)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), decode_rows=torch.arange(len(lens)),
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        decode_lens=torch.tensor(lens), prefills=(), batch_invariant=True)


def prefill_meta(table: list[int], length: int) -> AttentionMetadata:
    """One prompt chunk of ``length`` tokens from position 0 over ``table``."""
    return AttentionMetadata(
        slot_mapping=torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(length)]),
        decode_rows=torch.zeros(0, dtype=torch.long),
        decode_block_tables=torch.zeros(0, 0, dtype=torch.long),
        decode_lens=torch.zeros(0, dtype=torch.long),
        prefills=(PrefillSpan(start=0, length=length, context_len=length,
                              block_table=torch.tensor(table)),), batch_invariant=True)


def run(model, tokens: torch.Tensor, positions: torch.Tensor, caches, meta,
        *, torch_layers: bool = False) -> torch.Tensor:
    """The model's hidden states [T, E] (``torch_layers``: each layer's torch step)."""
    x = model.model.embed(tokens)
    pending = None
    for layer, cache in zip(model.model.layers, caches):
        step = LlamaDecoderLayer.forward if torch_layers else type(layer).forward
        x, pending = step(layer, x, pending, positions, model.model.rotary, cache, meta)
    return x if pending is None else x + pending


def history(model, family_caches, rows: int, gen: torch.Generator):
    """Each of ``rows`` sequences' own blocks and a prompt of 3 to 9 tokens already
    in the cache (run by the torch layers); returns (tables, lens) of their next token."""
    tables, lens = [], []
    for b in range(rows):
        n = int(torch.randint(3, 10, (1,), generator=gen))
        table = [3 * b + j for j in (2, 0, 1)]  # (out of order: the table is read)
        ids = torch.randint(0, 64, (n,), generator=gen)
        run(model, ids, torch.arange(n), family_caches, prefill_meta(table, n), torch_layers=True)
        tables.append(table)
        lens.append(n + 1)
    return tables, lens


@needs_native
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("rows", [1, 3, 4, 16, 17])
def test_native_layer_matches_the_torch_layer(family, rows):
    torch.manual_seed(0)
    model = tiny_model(family)
    for layer in model.model.layers:  # one set of activation codes, as the torch layer
        layer.two_level_activations = 0
    gen = torch.Generator().manual_seed(rows)
    caches = empty_cache(model)
    tables, lens = history(model, caches, rows, gen)
    tokens = torch.randint(0, 64, (rows,), generator=gen)
    positions = torch.tensor(lens) - 1
    twin = [c.clone() for c in caches]
    mine = run(model, tokens, positions, caches, decode_meta(tables, lens))
    ref = run(model, tokens, positions, twin, decode_meta(tables, lens), torch_layers=True)
    scale = ref.abs().max()
    # (activation codes may round the other way where the norms' sums differ in order)
    assert (mine - ref).abs().max() < 2e-2 * scale, (mine - ref).abs().max() / scale
    for a, b in zip(caches, twin):  # the new keys (rotated) and values where the torch step put them
        assert torch.allclose(a, b, atol=2e-2 * b.abs().max())


@needs_native
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_rows_bits_do_not_depend_on_its_batch(family):
    model = tiny_model(family)
    gen = torch.Generator().manual_seed(3)
    caches = empty_cache(model)
    tables, lens = history(model, caches, 17, gen)
    tokens = torch.randint(0, 64, (17,), generator=gen)
    positions = torch.tensor(lens) - 1
    together = run(model, tokens, positions, [c.clone() for c in caches],
                   decode_meta(tables, lens))
    for b in (0, 5, 16):
        alone = run(model, tokens[b:b + 1], positions[b:b + 1], [c.clone() for c in caches],
                    decode_meta([tables[b]], [lens[b]]))
        assert torch.equal(alone[0], together[b])


@needs_native
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_token_has_the_same_bits_as_a_prompt_row_and_as_a_decode_row(family):
    model = tiny_model(family)
    ids = torch.randint(0, 64, (10,), generator=torch.Generator().manual_seed(5))
    table = [4, 1, 7]
    prompt = run(model, ids, torch.arange(10), empty_cache(model), prefill_meta(table, 10))
    caches = empty_cache(model)
    run(model, ids[:6], torch.arange(6), caches, prefill_meta(table, 6))
    for p in range(6, 10):  # the rest decoded one token at a time
        row = run(model, ids[p:p + 1], torch.tensor([p]), caches, decode_meta([table], [p + 1]))
        assert torch.equal(row[0], prompt[p]), p


def test_layer_runs_the_torch_step_with_the_extension_off():
    code = textwrap.dedent("""
        import torch
        from formcast.engine.kernels import native
        from tests.engine.test_native_layer import (tiny_model, empty_cache, prefill_meta,
                                                    run)
        assert not native.available()
        model = tiny_model("legacy")
        ids = torch.arange(7)
        a = run(model, ids, torch.arange(7), empty_cache(model), prefill_meta([0, 1], 7))
        b = run(model, ids, torch.arange(7), empty_cache(model), prefill_meta([0, 1], 7),
                torch_layers=True)
        assert torch.isfinite(a).all() and torch.equal(a, b)
        print("torch step ok")
    """)
    env = {**os.environ, "FORMCAST_NATIVE": "0"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                              os.path.abspath(__file__)))))
    assert done.returncode == 0, done.stderr
    assert "torch step ok" in done.stdout


@needs_native
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_whole_model_in_one_call_equals_its_layers_one_by_one(family):
    model = tiny_model(family, layers=3)
    ids = torch.randint(0, 64, (9,), generator=torch.Generator().manual_seed(11))
    whole = model.forward(ids, torch.arange(9), empty_cache(model), prefill_meta([2, 0, 5], 9))
    layered = run(model, ids, torch.arange(9), empty_cache(model), prefill_meta([2, 0, 5], 9))
    assert torch.equal(whole, layered)

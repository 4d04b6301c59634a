"""DeepSeek-V4 loading: block dequantizers on hand-built tensors, the original-name
table, and round trips (transformers' save_pretrained; an original-layout FP8/FP4
checkpoint) checked against transformers' logits."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import save_file

from formcast.engine.loader import load_deepseek_v4, original_to_hf_name
from formcast.engine.loader.blockquant import E2M1_VALUES, decode_scales, dequantize_fp4, dequantize_fp8
from formcast.engine.models.deepseek_v4 import DeepseekV4ForCausalLM
from formcast.errors import CorruptModelError
from tests.engine.deepseek_v4_helpers import _one_thread, reference_model, run_chunks  # noqa: F401

E8M0 = torch.float8_e8m0fnu


def test_ue8m0_scales_are_powers_of_two():
    raw = torch.tensor([127, 128, 126, 130], dtype=torch.uint8)
    assert decode_scales(raw).tolist() == [1.0, 2.0, 0.5, 8.0]
    assert decode_scales(raw.view(E8M0)).tolist() == [1.0, 2.0, 0.5, 8.0]
    assert decode_scales(torch.tensor([0.25], dtype=torch.bfloat16)).tolist() == [0.25]


def test_fp8_blocks_with_partial_edges():
    # 3x5 weight, 2x4 blocks -> a 2x2 grid whose last row and column are partial.
    values = torch.tensor([[1.0, -2.0, 0.5, 448.0, 3.0],
                           [0.0, 1.5, -0.25, 2.0, -1.0],
                           [4.0, 0.125, -6.0, 1.0, 0.75]])
    scales = torch.tensor([[2.0, 0.5], [10.0, -1.0]])
    expected = values * torch.tensor([[2.0] * 4 + [0.5]] * 2 + [[10.0] * 4 + [-1.0]])
    got = dequantize_fp8(values.to(torch.float8_e4m3fn), scales, (2, 4))
    assert torch.equal(got, expected)
    ue8m0 = torch.tensor([[128, 126], [127, 129]], dtype=torch.uint8).view(E8M0)
    got = dequantize_fp8(values.to(torch.float8_e4m3fn), ue8m0, (2, 4))
    assert torch.equal(got, values * torch.tensor([[2.0] * 4 + [0.5]] * 2 + [[1.0] * 4 + [4.0]]))
    with pytest.raises(ValueError, match="needs scales"):
        dequantize_fp8(values.to(torch.float8_e4m3fn), scales[:1], (2, 4))


def test_fp4_low_nibble_first_and_group_scales():
    # Row of 64 values (32 bytes): byte 0 = 0x21 -> [0.5, 1.0]; byte 1 = 0xF9 -> [-0.5, -6.0];
    # byte 16 (group 2 starts at value 32) = 0x07 -> [6.0, 0.0].
    packed = torch.zeros(1, 32, dtype=torch.uint8)
    packed[0, 0], packed[0, 1], packed[0, 16] = 0x21, 0xF9, 0x07
    scales = torch.tensor([[2.0, 0.5]])
    got = dequantize_fp4(packed.view(torch.int8), scales)
    assert got.shape == (1, 64)
    assert got[0, :4].tolist() == [1.0, 2.0, -1.0, -12.0]
    assert got[0, 32:34].tolist() == [3.0, 0.0]
    assert int((got != 0).sum()) == 5
    with pytest.raises(ValueError, match="needs scales"):
        dequantize_fp4(packed.view(torch.int8), scales[:, :1])


@pytest.mark.parametrize("original, hf", [
    ("embed.weight", "model.embed_tokens.weight"),
    ("head.weight", "lm_head.weight"),
    ("norm.weight", "model.norm.weight"),
    ("hc_head_fn", "model.hc_head.hc_fn"),
    ("layers.3.attn_norm.weight", "model.layers.3.input_layernorm.weight"),
    ("layers.3.ffn_norm.weight", "model.layers.3.post_attention_layernorm.weight"),
    ("layers.0.hc_attn_base", "model.layers.0.attn_hc.base"),
    ("layers.0.hc_ffn_scale", "model.layers.0.ffn_hc.scale"),
    ("layers.1.attn.wq_a.weight", "model.layers.1.self_attn.q_a_proj.weight"),
    ("layers.1.attn.q_norm.weight", "model.layers.1.self_attn.q_a_norm.weight"),
    ("layers.1.attn.wkv.weight", "model.layers.1.self_attn.kv_proj.weight"),
    ("layers.1.attn.kv_norm.weight", "model.layers.1.self_attn.kv_norm.weight"),
    ("layers.1.attn.norm.weight", "model.layers.1.self_attn.kv_norm.weight"),
    ("layers.1.attn.wo_a.weight", "model.layers.1.self_attn.o_a_proj.weight"),
    ("layers.1.attn.attn_sink", "model.layers.1.self_attn.sinks"),
    ("layers.1.attn.compressor.ape", "model.layers.1.self_attn.compressor.position_bias"),
    ("layers.1.attn.compressor.norm.weight", "model.layers.1.self_attn.compressor.kv_norm.weight"),
    ("layers.1.attn.indexer.compressor.wgate.weight",
     "model.layers.1.self_attn.compressor.indexer.gate_proj.weight"),
    ("layers.1.attn.indexer.wq_b.weight", "model.layers.1.self_attn.compressor.indexer.q_b_proj.weight"),
    ("layers.1.attn.indexer.weights_proj.weight",
     "model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight"),
    ("layers.2.ffn.gate.bias", "model.layers.2.mlp.gate.e_score_correction_bias"),
    ("layers.2.ffn.gate.tid2eid", "model.layers.2.mlp.gate.tid2eid"),
    ("layers.2.ffn.shared_experts.w3.weight", "model.layers.2.mlp.shared_experts.up_proj.weight"),
    ("mtp.0.e_proj.weight", "mtp.0.e_proj.weight"),
    ("mtp.0.norm.weight", "mtp.0.norm.weight"),
    ("mtp.0.hc_head_scale", "mtp.0.hc_head.hc_scale"),
    ("mtp.0.attn.wq_b.weight", "mtp.0.self_attn.q_b_proj.weight"),
])
def test_original_names(original, hf):
    assert original_to_hf_name(original) == hf


@pytest.mark.parametrize("name", ["layers.0.attn.wq_c.weight", "model.layers.0.foo", "extra"])
def test_unknown_original_names_raise(name):
    with pytest.raises(KeyError):
        original_to_hf_name(name)


def _build(checkpoint) -> DeepseekV4ForCausalLM:
    model = DeepseekV4ForCausalLM(checkpoint.config, with_mtp=checkpoint.with_mtp).eval()
    model.load_weights(checkpoint.weights)
    return model


def test_save_pretrained_round_trip(tmp_path):
    ref = reference_model(2)
    ref.save_pretrained(tmp_path)
    checkpoint = load_deepseek_v4(tmp_path)
    assert not checkpoint.with_mtp
    tokens = torch.randint(0, 97, (24,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = ref(tokens[None]).logits[0]
        got = run_chunks(_build(checkpoint), tokens, [10, 14])
    assert (got - want).abs().max().item() < 1e-4


# -- an original-layout checkpoint, FP8 linears and FP4 experts ---------------------------

_LEAVES = [("q_a_proj", "wq_a"), ("q_a_norm", "q_norm"), ("q_b_proj", "wq_b"), ("kv_proj", "wkv"),
           ("kv_norm", "kv_norm"), ("o_a_proj", "wo_a"), ("o_b_proj", "wo_b")]
_COMP = [("kv_proj.weight", "wkv.weight"), ("gate_proj.weight", "wgate.weight"),
         ("position_bias", "ape"), ("kv_norm.weight", "norm.weight")]


def _to_original(hf: str) -> str:
    """transformers' name -> the original release's (the test's own inverse table)."""
    top = {"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
           "model.norm.weight": "norm.weight"}
    if hf in top:
        return top[hf]
    if hf.startswith("model.hc_head.hc_"):
        return "hc_head_" + hf.rsplit("_", 1)[1]
    i, rest = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf).groups()
    table = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.sinks": "attn.attn_sink", "mlp.gate.weight": "ffn.gate.weight",
             "mlp.gate.e_score_correction_bias": "ffn.gate.bias", "mlp.gate.tid2eid": "ffn.gate.tid2eid",
             "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
             "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight"}
    table.update({f"{s}_hc.{k}": f"hc_{s}_{k}" for s in ("attn", "ffn") for k in ("fn", "base", "scale")})
    table.update({f"self_attn.{a}.weight": f"attn.{b}.weight" for a, b in _LEAVES})
    table.update({f"self_attn.compressor.{a}": f"attn.compressor.{b}" for a, b in _COMP})
    table.update({f"self_attn.compressor.indexer.{a}": f"attn.indexer.compressor.{b}" for a, b in _COMP})
    table.update({f"mlp.shared_experts.{a}.weight": f"ffn.shared_experts.{b}.weight"
                  for a, b in (("gate_proj", "w1"), ("down_proj", "w2"), ("up_proj", "w3"))})
    return f"layers.{i}.{table[rest]}"


def _fp8(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> e4m3 values, UE8M0 scales (edge blocks may be partial), and what they decode to."""
    rows, cols = w.shape
    padded = torch.nn.functional.pad(w, (0, -cols % block, 0, -rows % block))
    grid = padded.unflatten(0, (-1, block)).unflatten(2, (-1, block))
    amax = grid.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    exponent = torch.ceil(torch.log2(amax / 448.0))
    scale = torch.exp2(exponent).repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    q = (w / scale).to(torch.float8_e4m3fn)
    return q, (exponent + 127).to(torch.uint8).view(E8M0), q.float() * scale


def _fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> packed e2m1 (int8), UE8M0 per-32 scales, and what they decode to."""
    groups = w.unflatten(-1, (-1, 32))
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-12) / 6.0))
    scaled = groups / torch.exp2(exponent)[..., None]
    table = torch.tensor(E2M1_VALUES)
    codes = (scaled[..., None] - table).abs().argmin(-1).flatten(-2)  # nearest code (+0 before -0)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8).view(torch.int8)
    decoded = (table[codes].unflatten(-1, (-1, 32)) * torch.exp2(exponent)[..., None]).flatten(-2)
    return packed, (exponent + 127).to(torch.uint8).view(E8M0), decoded


def test_original_layout_fp8_fp4_round_trip(tmp_path):
    block = 8
    ref = reference_model(5, moe_intermediate_size=32)
    tensors, expected = {}, {}
    for name, w in ref.state_dict().items():
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            prefix = name.rsplit("mlp.", 1)[0].replace("model.", "", 1) + "ffn.experts"
            halves = w.chunk(2, dim=1) if name.endswith("gate_up_proj") else (w,)
            kinds = ("w1", "w3") if name.endswith("gate_up_proj") else ("w2",)
            decoded_parts = []
            for part, kind in zip(halves, kinds):
                packed, scales, decoded = _fp4(part)
                decoded_parts.append(decoded)
                for j in range(w.shape[0]):
                    tensors[f"{prefix}.{j}.{kind}.weight"] = packed[j]
                    tensors[f"{prefix}.{j}.{kind}.scale"] = scales[j]
            expected[name] = torch.cat(decoded_parts, dim=1)
            continue
        original = _to_original(name)
        assert original_to_hf_name(original) == name
        if w.dim() == 2 and "hc" not in name and not name.endswith(("position_bias", "tid2eid")):
            q, scales, decoded = _fp8(w, block)
            tensors[original], tensors[original[:-len(".weight")] + ".scale"] = q, scales
            expected[name] = decoded
        else:
            tensors[original] = w.to(torch.bfloat16) if name.endswith("norm.weight") else w.clone()
            expected[name] = tensors[original].float() if w.is_floating_point() else w
    save_file(tensors, tmp_path / "model.safetensors")
    config = {k: v for k, v in ref.config.to_dict().items() if k not in ("layer_types", "compress_rates")}
    config.update(compress_ratios=[0, 4, 128, 4], compress_rate_hca=8,
                  quantization_config={"quant_method": "fp8", "weight_block_size": [block, block]})
    (tmp_path / "config.json").write_text(json.dumps(config))

    checkpoint = load_deepseek_v4(tmp_path)
    assert checkpoint.config.layer_types == tuple(ref.config.layer_types)
    assert set(checkpoint.weights) == set(expected)
    for name, want in expected.items():
        assert torch.equal(checkpoint.weights[name], want), name
    ref.load_state_dict(expected)
    tokens = torch.randint(0, 97, (20,), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = ref(tokens[None]).logits[0]
        got = run_chunks(_build(checkpoint), tokens, [20])
    assert (got - want).abs().max().item() < 1e-4

    del tensors["layers.1.attn.wq_a.scale"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CorruptModelError, match="no scales"):
        load_deepseek_v4(tmp_path)


# -- dequantizers against decoders written from the formats' definitions ---------------------


def _e4m3(code: int) -> float:
    """OCP FP8 E4M3 (``float8_e4m3fn``): sign, 4 exponent bits (bias 7), 3 mantissa
    bits; exponent 0 is subnormal; S.1111.111 is NaN; no infinities."""
    sign = -1.0 if code & 0x80 else 1.0
    exp, man = (code >> 3) & 0xF, code & 0x7
    if exp == 0xF and man == 0x7:
        return float("nan")
    if exp == 0:
        return sign * man / 8 * 2.0 ** -6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def _e2m1(code: int) -> float:
    """OCP FP4 E2M1: sign, 2 exponent bits (bias 1), 1 mantissa bit; exponent 0 is
    subnormal (0 or 0.5)."""
    sign = -1.0 if code & 0x8 else 1.0
    exp, man = (code >> 1) & 0x3, code & 0x1
    return sign * (man * 0.5 if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1))


def test_fp8_every_code_matches_the_e4m3_definition():
    codes = torch.arange(256, dtype=torch.uint8).view(1, 256)
    got = dequantize_fp8(codes.view(torch.float8_e4m3fn), torch.ones(1, 1), (1, 256))[0]
    want = torch.tensor([_e4m3(c) for c in range(256)])
    assert torch.equal(got.isnan(), want.isnan()) and int(want.isnan().sum()) == 2
    assert torch.equal(got[~want.isnan()], want[~want.isnan()])


def test_fp4_every_code_matches_the_e2m1_definition():
    assert [_e2m1(c) for c in range(16)] == list(E2M1_VALUES)
    packed = torch.tensor([[lo | hi << 4 for lo in range(16) for hi in (lo, 15 - lo)]],
                          dtype=torch.uint8)  # 32 bytes: 64 values, two groups of 32
    got = dequantize_fp4(packed.view(torch.int8), torch.ones(1, 2))[0]
    want = [_e2m1(b & 0xF) if i % 2 == 0 else _e2m1(b >> 4)
            for b in packed[0].tolist() for i in range(2)]
    assert got.tolist() == want


@pytest.mark.parametrize("shape, block", [((200, 300), (128, 128)), ((2, 70, 33), (16, 8))])
def test_fp8_round_trip_against_a_blockwise_reference(shape, block):
    """Quantize seeded weights per block (UE8M0 power-of-two scales, amax -> 448),
    dequantize, and compare with a loop over blocks decoding every byte by hand."""
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(shape, generator=gen) * torch.logspace(-3, 1, shape[-1])
    rows, cols = shape[-2:]
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    exps = torch.zeros(shape[:-2] + grid, dtype=torch.uint8)
    quant = torch.empty(shape, dtype=torch.float8_e4m3fn)
    flat_w, flat_q, flat_e = weight.view(-1, rows, cols), quant.view(-1, rows, cols), exps.view(-1, *grid)
    for m in range(flat_w.shape[0]):
        for i in range(grid[0]):
            for j in range(grid[1]):
                tile = (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
                amax = float(flat_w[m][tile].abs().max())
                e = int(torch.ceil(torch.log2(torch.tensor(amax / 448.0))))
                flat_e[m, i, j] = e + 127
                flat_q[m][tile] = (flat_w[m][tile] / 2.0 ** e).to(torch.float8_e4m3fn)
    got = dequantize_fp8(quant, exps.view(E8M0), block)
    codes = quant.view(torch.uint8).view(-1, rows, cols)
    want, scales = torch.empty(flat_w.shape), torch.empty(flat_w.shape)
    for m in range(flat_w.shape[0]):
        for r in range(rows):
            for c in range(cols):
                scales[m, r, c] = 2.0 ** (int(flat_e[m, r // block[0], c // block[1]]) - 127)
                want[m, r, c] = _e4m3(int(codes[m, r, c])) * scales[m, r, c]
    assert torch.equal(got.view(-1, rows, cols), want)
    # and the round trip is as close as 3 mantissa bits allow (subnormals aside)
    normal = flat_w.abs() >= 2.0 ** -6 * scales
    assert normal.float().mean() > 0.9
    ratio = want[normal] / flat_w[normal]
    assert ((ratio - 1).abs() <= 2.0 ** -4).all()


def test_fp4_round_trip_against_a_reference():
    """Random E2M1 codes and UE8M0 group scales: every value is its code's value
    (low nibble = even column) times its group's scale."""
    gen = torch.Generator().manual_seed(8)
    packed = torch.randint(0, 256, (3, 5, 48), generator=gen, dtype=torch.uint8)  # 96 columns
    exps = torch.randint(120, 135, (3, 5, 3), generator=gen, dtype=torch.uint8)
    got = dequantize_fp4(packed.view(torch.int8), exps.view(E8M0))
    assert got.shape == (3, 5, 96)
    want = torch.empty(3, 5, 96)
    for a in range(3):
        for r in range(5):
            for c in range(96):
                byte = int(packed[a, r, c // 2])
                code = byte & 0xF if c % 2 == 0 else byte >> 4
                want[a, r, c] = _e2m1(code) * 2.0 ** (int(exps[a, r, c // 32]) - 127)
    assert torch.equal(got, want)

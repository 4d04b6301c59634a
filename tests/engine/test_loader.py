"""Checkpoint loading: GGUF (real SmolLM2 and synthetic files), the f32 cache, HF folders."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from formcast.engine.config import LlamaConfig
from formcast.engine.hub import ModelSource
from formcast.engine.loader import (Checkpoint, expected_shapes, load_checkpoint,
                                    read_gguf_config)
from formcast.engine.loader.dequant import SUPPORTED_TYPES, dequantize
from formcast.engine.loader.weight_cache import cache_path, read_cache
from formcast.errors import CorruptModelError, ModelNotFoundError, UnsupportedModelError

transformers = pytest.importorskip("transformers")


def _gguf(path: Path) -> ModelSource:
    return ModelSource(kind="gguf", path=path, name=path.stem)


def _hf(path: Path) -> ModelSource:
    return ModelSource(kind="hf", path=path, name=path.name)


# --------------------------------------------------------------------------------------
# Real model: SmolLM2-135M-Instruct Q4_1, against transformers' own GGUF loader
# --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference(smollm2_gguf: Path):
    """transformers' LlamaForCausalLM loaded from the same GGUF (takes ~15-40 s)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32)
    return model.config, {k: v.detach() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def gguf_copy(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private copy, so the cache written next to it never touches the user cache."""
    target = tmp_path_factory.mktemp("smollm2") / smollm2_gguf.name
    shutil.copyfile(smollm2_gguf, target)
    return target


@pytest.fixture(scope="module")
def cold(gguf_copy: Path) -> Checkpoint:
    assert not cache_path(gguf_copy).exists()
    return load_checkpoint(_gguf(gguf_copy))


@pytest.mark.slow
def test_gguf_weights_match_transformers(cold: Checkpoint, reference) -> None:
    _, ref = reference
    assert not cold.from_cache
    assert set(cold.weights) == set(expected_shapes(cold.config))
    assert "lm_head.weight" not in cold.weights  # SmolLM2 ties its head
    assert set(ref) - {"lm_head.weight"} == set(cold.weights)
    for name, w in cold.weights.items():
        assert w.dtype == torch.float32 and w.device.type == "cpu", name
        assert w.shape == ref[name].shape, name
        diff = (w - ref[name]).abs().max().item()
        assert diff <= 1e-6, f"{name}: max abs diff {diff}"


@pytest.mark.slow
def test_gguf_config_matches_transformers(cold: Checkpoint, reference, gguf_copy: Path) -> None:
    ref_config, _ = reference
    c = cold.config
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim",
                  "max_position_embeddings", "tie_word_embeddings", "attention_bias",
                  "mlp_bias"):
        assert getattr(c, field) == getattr(ref_config, field), field
    assert c.rms_norm_eps == pytest.approx(ref_config.rms_norm_eps, rel=1e-12)
    ref_theta = (getattr(ref_config, "rope_parameters", None) or {}).get("rope_theta") \
        or getattr(ref_config, "rope_theta")
    assert c.rope_theta == ref_theta
    assert c.rope_scaling is None
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
            c.intermediate_size, c.vocab_size, c.tie_word_embeddings) == \
        (30, 576, 9, 3, 1536, 49152, True)
    assert read_gguf_config(gguf_copy) == c


@pytest.mark.slow
def test_gguf_second_load_is_served_from_cache(cold: Checkpoint, gguf_copy: Path) -> None:
    cached = cache_path(gguf_copy)
    assert cached.is_file()
    before = cached.stat().st_mtime_ns
    warm = load_checkpoint(_gguf(gguf_copy))
    assert warm.from_cache
    assert cached.stat().st_mtime_ns == before  # read, not rewritten
    assert warm.config == cold.config
    assert set(warm.weights) == set(cold.weights)
    for name, w in cold.weights.items():
        assert torch.equal(warm.weights[name], w), name
    half = load_checkpoint(_gguf(gguf_copy), dtype=torch.bfloat16)
    assert half.from_cache
    assert all(w.dtype == torch.bfloat16 for w in half.weights.values())
    name = "model.layers.3.self_attn.k_proj.weight"
    assert torch.equal(half.weights[name], cold.weights[name].to(torch.bfloat16))


@pytest.mark.slow
def test_gguf_cache_is_stale_after_the_gguf_changes(cold: Checkpoint, gguf_copy: Path) -> None:
    assert read_cache(gguf_copy) is not None
    st = gguf_copy.stat()
    os.utime(gguf_copy, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    try:
        assert read_cache(gguf_copy) is None
    finally:
        os.utime(gguf_copy, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert read_cache(gguf_copy) is not None


@pytest.mark.slow
def test_truncated_real_gguf_is_corrupt(smollm2_gguf: Path, tmp_path: Path) -> None:
    data = smollm2_gguf.read_bytes()
    header_only = tmp_path / "first-mb.gguf"
    header_only.write_bytes(data[: 1 << 20])  # cut inside the tokenizer metadata
    with pytest.raises(CorruptModelError, match="first-mb.gguf.*truncated"):
        load_checkpoint(_gguf(header_only), cache=False)
    in_data = tmp_path / "half.gguf"
    in_data.write_bytes(data[: len(data) // 2])  # header (~2 MB) intact, tensor data cut
    with pytest.raises(CorruptModelError, match="half.gguf.*truncated"):
        load_checkpoint(_gguf(in_data))
    assert not cache_path(in_data).exists()


# --------------------------------------------------------------------------------------
# Synthetic GGUF files written with gguf.GGUFWriter from a tiny transformers model
# --------------------------------------------------------------------------------------

_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}
_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _gguf_name(hf: str) -> str:
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    _, _, layer, *rest = hf.split(".")
    module, kind = ".".join(rest[:-1]), rest[-1]
    return f"blk.{layer}.{_BLOCK[module]}.{kind}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to q/k rows (written from its description)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tiny_model(*, tie: bool, bias: bool = False, hidden: int = 64) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, rope_theta=50000.0, tie_word_embeddings=tie, attention_bias=bias)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms start at exactly 1; make them distinguishable
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _write_gguf(path: Path, model: transformers.PreTrainedModel, *, qtype: Q = Q.F32,
                arch: str = "llama", drop: tuple[str, ...] = (),
                override: dict[str, Q] | None = None) -> dict[str, np.ndarray]:
    """Write ``model`` as llama.cpp would; return the float32 weights a reader should see."""
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.head_dim)
    w.add_vocab_size(c.vocab_size)
    expected: dict[str, np.ndarray] = {}
    state = model.state_dict()
    if c.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for hf, tensor in state.items():
        name = _gguf_name(hf)
        if name in drop:
            continue
        arr = tensor.float().numpy()
        stored = arr
        if ".attn_q." in name:
            stored = _llama_cpp_permute(arr, c.num_attention_heads)
        elif ".attn_k." in name:
            stored = _llama_cpp_permute(arr, c.num_key_value_heads)
        kind = (override or {}).get(name, qtype if arr.ndim == 2 else Q.F32)
        if kind == Q.F32:
            w.add_tensor(name, np.ascontiguousarray(stored))
            expected[hf] = arr
        else:
            data = gguf.quants.quantize(np.ascontiguousarray(stored), kind)
            w.add_tensor(name, data, raw_dtype=None if kind == Q.F16 else kind)
            # Blocks run along rows, so quantizing before or after the row permutation
            # gives the same values: the reference is the round trip of the HF weight.
            expected[hf] = gguf.quants.dequantize(gguf.quants.quantize(arr, kind), kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
@pytest.mark.parametrize("tie", [True, False])
def test_synthetic_gguf_round_trip(tmp_path: Path, qtype: Q, tie: bool) -> None:
    model = _tiny_model(tie=tie)
    path = tmp_path / "tiny.gguf"
    expected = _write_gguf(path, model, qtype=qtype)
    ckpt = load_checkpoint(_gguf(path), cache=False)
    assert ckpt.config.tie_word_embeddings is tie
    assert ("lm_head.weight" in ckpt.weights) is not tie
    assert set(ckpt.weights) == set(expected)
    for name, ref in expected.items():
        assert torch.equal(ckpt.weights[name], torch.from_numpy(np.asarray(ref))), name
    assert not cache_path(path).exists()


def test_synthetic_gguf_with_attention_bias_unpermutes_biases(tmp_path: Path) -> None:
    model = _tiny_model(tie=False, bias=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_()
    path = tmp_path / "bias.gguf"
    _write_gguf(path, model)
    ckpt = load_checkpoint(_gguf(path), cache=False)
    assert ckpt.config.attention_bias
    state = model.state_dict()
    assert set(ckpt.weights) == set(state)
    for name, w in ckpt.weights.items():
        assert torch.equal(w, state[name]), name


def test_synthetic_gguf_matches_transformers_forward(tmp_path: Path) -> None:
    """Our weights in a transformers model give the original model's logits (RoPE layout)."""
    model = _tiny_model(tie=False)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, model)
    ckpt = load_checkpoint(_gguf(path), cache=False)
    clone = _tiny_model(tie=False)
    with torch.no_grad():
        for p in clone.parameters():
            p.zero_()
    clone.load_state_dict(ckpt.weights, strict=True)
    ids = torch.tensor([[1, 5, 9, 22, 41, 7, 3]])
    with torch.no_grad():
        assert torch.allclose(clone(ids).logits, model(ids).logits, atol=1e-5)


def test_synthetic_gguf_cache_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, _tiny_model(tie=True), qtype=Q.Q8_0)
    first = load_checkpoint(_gguf(path))
    assert not first.from_cache and cache_path(path).is_file()
    second = load_checkpoint(_gguf(path))
    assert second.from_cache and second.config == first.config
    assert all(torch.equal(second.weights[k], v) for k, v in first.weights.items())
    # A damaged cache is ignored and rewritten, never an error.
    cache_path(path).write_bytes(b"not safetensors")
    third = load_checkpoint(_gguf(path))
    assert not third.from_cache
    assert load_checkpoint(_gguf(path)).from_cache


def test_cache_write_failure_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, _tiny_model(tie=True))
    cache_path(path).mkdir()  # os.replace onto a folder fails like a read-only folder would
    ckpt = load_checkpoint(_gguf(path))
    assert not ckpt.from_cache and cache_path(path).is_dir()
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0,
                    reason="needs a non-root POSIX user for a read-only folder")
def test_cache_in_read_only_folder_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, _tiny_model(tie=True))
    tmp_path.chmod(0o555)
    try:
        ckpt = load_checkpoint(_gguf(path))
    finally:
        tmp_path.chmod(0o755)
    assert not ckpt.from_cache and not cache_path(path).exists()


def test_read_gguf_config_of_synthetic_file(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, _tiny_model(tie=False))
    assert read_gguf_config(path) == LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=float(np.float32(1e-5)), rope_theta=50000.0,
        max_position_embeddings=256, tie_word_embeddings=False)


# --------------------------------------------------------------------------------------
# Damaged and unsupported GGUF files
# --------------------------------------------------------------------------------------

def test_random_bytes_are_corrupt(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    noise = tmp_path / "noise.gguf"
    noise.write_bytes(rng.bytes(4096))
    with pytest.raises(CorruptModelError, match="noise.gguf.*not a GGUF file"):
        load_checkpoint(_gguf(noise))
    magic_then_noise = tmp_path / "magic.gguf"
    magic_then_noise.write_bytes(b"GGUF" + rng.bytes(4096))
    with pytest.raises(CorruptModelError, match="magic.gguf"):
        load_checkpoint(_gguf(magic_then_noise))
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(CorruptModelError, match="empty.gguf.*empty"):
        read_gguf_config(empty)


def test_missing_file_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="nothere.gguf"):
        load_checkpoint(_gguf(tmp_path / "nothere.gguf"))


@pytest.mark.parametrize("cut", [0.3, 0.7, 0.99])
def test_truncated_synthetic_gguf_is_corrupt(tmp_path: Path, cut: float) -> None:
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, _tiny_model(tie=True))
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * cut)])
    with pytest.raises(CorruptModelError, match="tiny.gguf.*truncated"):
        load_checkpoint(_gguf(path))


def test_other_architecture_is_unsupported(tmp_path: Path) -> None:
    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="'mamba'.*'llama'"):
        load_checkpoint(_gguf(path))
    with pytest.raises(UnsupportedModelError, match="mamba"):
        read_gguf_config(path)


def test_missing_tensor_is_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "holes.gguf"
    _write_gguf(path, _tiny_model(tie=True), drop=("blk.1.ffn_down.weight",))
    with pytest.raises(CorruptModelError,
                       match=r"holes.gguf.*missing.*model\.layers\.1\.mlp\.down_proj\.weight"):
        load_checkpoint(_gguf(path))


def test_unsupported_tensor_type_names_tensor_and_type(tmp_path: Path) -> None:
    path = tmp_path / "tq1.gguf"
    _write_gguf(path, _tiny_model(tie=True, hidden=256), override={"blk.0.ffn_up.weight": Q.TQ1_0})
    with pytest.raises(UnsupportedModelError, match=r"blk\.0\.ffn_up\.weight.*TQ1_0"):
        load_checkpoint(_gguf(path))


# --------------------------------------------------------------------------------------
# Dequantization, one type at a time
# --------------------------------------------------------------------------------------

def _f16(x: float) -> bytes:
    return np.float16(x).tobytes()


def test_dequant_f32_f16_bf16() -> None:
    values = np.array([[1.5, -2.25, 0.0, 3.0e4], [-1e-3, 7.0, 0.5, -8.0]], dtype=np.float32)
    out = dequantize(values, Q.F32, (2, 4))
    assert torch.equal(out, torch.from_numpy(values))
    assert out.data_ptr() != values.ctypes.data  # owns its memory
    half = values.astype(np.float16)
    assert torch.equal(dequantize(half, Q.F16, (2, 4)),
                       torch.from_numpy(half.astype(np.float32)))
    bf = np.array([[1.5, -2.25, 0.0, 24576.0], [-0.125, 7.0, 0.5, -8.0]], dtype=np.float32)
    raw = (bf.view(np.uint32) >> 16).astype(np.uint16)  # all exactly representable in bf16
    assert torch.equal(dequantize(raw.view(np.uint8), Q.BF16, (2, 4)), torch.from_numpy(bf))


def test_dequant_q8_0_hand_built() -> None:
    q1 = np.arange(-16, 16, dtype=np.int8)
    q2 = np.array([127, -128] + [3] * 30, dtype=np.int8)
    raw = np.frombuffer(_f16(0.25) + q1.tobytes() + _f16(-2.0) + q2.tobytes(), dtype=np.uint8)
    expected = np.concatenate([0.25 * q1.astype(np.float32), -2.0 * q2.astype(np.float32)])
    assert torch.equal(dequantize(raw, Q.Q8_0, (2, 32)),
                       torch.from_numpy(expected.reshape(2, 32)))


def _nibbles(values: np.ndarray) -> bytes:
    """32 4-bit values -> 16 bytes: element i in the low nibble of byte i, i+16 in the high."""
    return (values[:16] | (values[16:] << 4)).astype(np.uint8).tobytes()


def test_dequant_q4_0_hand_built() -> None:
    n = np.arange(32) % 16
    raw = np.frombuffer(_f16(0.5) + _nibbles(n) + _f16(-3.0) + _nibbles(15 - n), dtype=np.uint8)
    expected = np.concatenate([0.5 * (n - 8), -3.0 * (15 - n - 8)]).astype(np.float32)
    assert torch.equal(dequantize(raw, Q.Q4_0, (64,)), torch.from_numpy(expected))


def test_dequant_q4_1_hand_built() -> None:
    n = (np.arange(32) * 7) % 16
    raw = np.frombuffer(_f16(0.125) + _f16(-1.5) + _nibbles(n)
                        + _f16(2.0) + _f16(10.0) + _nibbles(n[::-1].copy()), dtype=np.uint8)
    expected = np.concatenate([0.125 * n - 1.5, 2.0 * n[::-1] + 10.0]).astype(np.float32)
    assert torch.equal(dequantize(raw, Q.Q4_1, (1, 64)), torch.from_numpy(expected[None]))


def _random_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    return (rng.uniform(-2, 2, n) * 10.0 ** rng.integers(-3, 1, n)).astype(np.float16)


def _ref_q4_k(block: bytes) -> list[np.float32]:
    """Scalar port of ggml's dequantize_row_q4_K for one 256-value block (144 bytes)."""
    d, dmin = np.frombuffer(block[:4], dtype=np.float16).astype(np.float32)
    scales, q = block[4:16], block[16:144]

    def scale_min(j: int) -> tuple[np.float32, np.float32]:
        if j < 4:
            sc, m = scales[j] & 63, scales[j + 4] & 63
        else:
            sc = (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4)
            m = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4)
        return np.float32(sc), np.float32(m)

    out: list[np.float32] = []
    for group in range(4):  # 64 values each: 32 low nibbles, then 32 high nibbles
        sc1, m1 = scale_min(2 * group)
        sc2, m2 = scale_min(2 * group + 1)
        d1, dm1, d2, dm2 = d * sc1, dmin * m1, d * sc2, dmin * m2
        qs = q[32 * group: 32 * group + 32]
        out += [d1 * np.float32(b & 0xF) - dm1 for b in qs]
        out += [d2 * np.float32(b >> 4) - dm2 for b in qs]
    return out


def _ref_q6_k(block: bytes) -> list[np.float32]:
    """Scalar port of ggml's dequantize_row_q6_K for one 256-value block (210 bytes)."""
    ql, qh = block[:128], block[128:192]
    sc = np.frombuffer(block[192:208], dtype=np.int8).astype(np.float32)
    d = np.frombuffer(block[208:210], dtype=np.float16).astype(np.float32)[0]
    out = [np.float32(0)] * 256
    for half in range(2):
        lo, hi, s, base = ql[64 * half:], qh[32 * half:], sc[8 * half:], 128 * half
        for lane in range(32):
            i = lane // 16
            q1 = ((lo[lane] & 0xF) | (((hi[lane] >> 0) & 3) << 4)) - 32
            q2 = ((lo[lane + 32] & 0xF) | (((hi[lane] >> 2) & 3) << 4)) - 32
            q3 = ((lo[lane] >> 4) | (((hi[lane] >> 4) & 3) << 4)) - 32
            q4 = ((lo[lane + 32] >> 4) | (((hi[lane] >> 6) & 3) << 4)) - 32
            out[base + lane] = d * s[i] * np.float32(q1)
            out[base + lane + 32] = d * s[i + 2] * np.float32(q2)
            out[base + lane + 64] = d * s[i + 4] * np.float32(q3)
            out[base + lane + 96] = d * s[i + 6] * np.float32(q4)
    return out


@pytest.mark.parametrize("qtype, ref", [(Q.Q4_K, _ref_q4_k), (Q.Q6_K, _ref_q6_k)])
def test_dequant_k_quants_against_ggml_reference(qtype: Q, ref) -> None:
    rng = np.random.default_rng(42)
    n_blocks = 6
    blocks = []
    for _ in range(n_blocks):
        if qtype == Q.Q4_K:  # d, dmin (f16), 12 packed 6-bit scale/min bytes, 128 nibble bytes
            blocks.append(_random_f16(rng, 2).tobytes() + rng.bytes(12 + 128))
        else:  # 128 low-bit bytes, 64 high-bit bytes, 16 int8 scales, d (f16)
            blocks.append(rng.bytes(128 + 64 + 16) + _random_f16(rng, 1).tobytes())
    raw = np.frombuffer(b"".join(blocks), dtype=np.uint8)
    out = dequantize(raw, qtype, (2, 3 * 256))
    expected = np.array([v for b in blocks for v in ref(b)], dtype=np.float32).reshape(2, 768)
    assert np.isfinite(expected).all()
    assert torch.equal(out, torch.from_numpy(expected))


def test_dequant_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="bytes"):
        dequantize(np.zeros(33, dtype=np.uint8), Q.Q8_0, (1, 32))
    with pytest.raises(ValueError, match="block size"):
        dequantize(np.zeros(34, dtype=np.uint8), Q.Q8_0, (1, 16))
    with pytest.raises(ValueError, match="TQ2_0"):
        dequantize(np.zeros(66, dtype=np.uint8), Q.TQ2_0, (1, 256))
    assert {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K,
            Q.Q6_K, Q.Q8_K} == SUPPORTED_TYPES


# --------------------------------------------------------------------------------------
# HF-layout folders
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("shard", [False, True])
def test_hf_folder_round_trip(tmp_path: Path, tie: bool, shard: bool) -> None:
    model = _tiny_model(tie=tie)
    model.save_pretrained(tmp_path, max_shard_size="20KB" if shard else "10GB")
    assert (tmp_path / "model.safetensors.index.json").is_file() is shard
    ckpt = load_checkpoint(_hf(tmp_path))
    state = model.state_dict()
    assert ckpt.config.tie_word_embeddings is tie
    assert set(ckpt.weights) == set(state) - ({"lm_head.weight"} if tie else set())
    for name, w in ckpt.weights.items():
        assert w.dtype == torch.float32
        assert torch.equal(w, state[name]), name
    assert ckpt.config == LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
        rope_theta=50000.0, max_position_embeddings=256, tie_word_embeddings=tie)


def test_hf_folder_dtype_conversion(tmp_path: Path) -> None:
    model = _tiny_model(tie=True).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    as_f32 = load_checkpoint(_hf(tmp_path))
    as_bf16 = load_checkpoint(_hf(tmp_path), dtype=torch.bfloat16)
    for name, w in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        assert torch.equal(as_bf16.weights[name], w)
        assert torch.equal(as_f32.weights[name], w.float())
    with pytest.raises(ValueError, match="floating-point"):
        load_checkpoint(_hf(tmp_path), dtype=torch.int8)


def test_hf_folder_with_rope_parameters_scaling(tmp_path: Path) -> None:
    model = _tiny_model(tie=True)
    model.config.rope_parameters = {"rope_type": "linear", "factor": 4.0, "rope_theta": 50000.0}
    model.save_pretrained(tmp_path)
    config = load_checkpoint(_hf(tmp_path)).config
    assert config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert config.rope_theta == 50000.0


def test_hf_folder_missing_shard_is_corrupt(tmp_path: Path) -> None:
    _tiny_model(tie=False).save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / victim).unlink()
    with pytest.raises(CorruptModelError, match=victim):
        load_checkpoint(_hf(tmp_path))


def test_hf_folder_without_weights_is_corrupt(tmp_path: Path) -> None:
    _tiny_model(tie=False).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CorruptModelError, match="no weights found"):
        load_checkpoint(_hf(tmp_path))


def test_hf_folder_with_truncated_weights_is_corrupt(tmp_path: Path) -> None:
    _tiny_model(tie=False).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    with pytest.raises(CorruptModelError, match="model.safetensors"):
        load_checkpoint(_hf(tmp_path))


def test_hf_folder_with_missing_tensor_is_corrupt(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    model = _tiny_model(tie=True)
    model.save_pretrained(tmp_path)
    state = {k: v for k, v in model.state_dict().items()
             if k not in ("lm_head.weight", "model.layers.1.mlp.up_proj.weight")}
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(CorruptModelError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_checkpoint(_hf(tmp_path))


def test_hf_folder_of_other_architecture_is_unsupported(tmp_path: Path) -> None:
    _tiny_model(tie=False).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_checkpoint(_hf(tmp_path))


def test_hf_folder_with_pickle_weights_is_unsupported(tmp_path: Path) -> None:
    _tiny_model(tie=False).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(UnsupportedModelError, match="safetensors"):
        load_checkpoint(_hf(tmp_path))


def test_hf_folder_with_bad_config_is_corrupt(tmp_path: Path) -> None:
    _tiny_model(tie=False).save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CorruptModelError, match="config.json"):
        load_checkpoint(_hf(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CorruptModelError, match="num_attention_heads|vocab_size"):
        load_checkpoint(_hf(tmp_path))
    with pytest.raises(ModelNotFoundError):
        load_checkpoint(_hf(tmp_path / "absent"))

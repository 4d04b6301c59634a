"""The native quantized GEMV/GEMM kernels against a float64 reference of the same
quantized codes, for every block type, row count and ISA level of this machine;
bitwise batch invariance of a row; and the pure-torch path with the extension off."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from formcast.engine.kernels import native
from formcast.engine.layers.quant import GGUFEmbedding, GGUFLinear
from formcast.engine.loader.dequant import dequantize_rows

ROWS = (1, 3, 4, 16, 17)
# (block type, inputs): an odd number of blocks (or super-blocks) a row
SHAPES = {"Q4_0": 96, "Q4_1": 160, "Q8_0": 224, "Q4_K": 768, "Q5_K": 768, "Q6_K": 768}
OUT = 37  # an odd number of output rows, more than one task of the thread pool


def _f16_bytes(shape: tuple[int, ...], gen: torch.Generator, lo: float, hi: float
               ) -> torch.Tensor:
    values = torch.empty(shape).uniform_(lo, hi, generator=gen).half()
    return values.view(torch.int16).view(torch.uint8).reshape(*shape, 2)


def random_blocks(qtype: str, rows: int, inputs: int, seed: int = 0) -> torch.Tensor:
    """Random codes with valid float16 scales where each block type keeps them."""
    gen = torch.Generator().manual_seed(seed)
    _, elems, size = native.BLOCK_TYPES[qtype]
    b = torch.randint(0, 256, (rows, inputs // elems, size), dtype=torch.uint8, generator=gen)
    grid = (rows, inputs // elems)
    offsets = {"Q4_0": (0,), "Q8_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2),
               "Q6_K": (208,)}[qtype]
    for at in offsets:
        b[..., at:at + 2] = _f16_bytes(grid, gen, 0.001, 0.05)
    return b.reshape(rows, -1).contiguous()


def reference(x: torch.Tensor, blocks: torch.Tensor, qtype: str) -> tuple[torch.Tensor,
                                                                          torch.Tensor]:
    """(float64 product of the same activation and weight codes, the sum of |terms|)."""
    q, d = native.quantize_activations(x)
    xq = (q.double().view(x.shape[0], -1, 32) * d.double()[..., None]).view(x.shape)
    w = dequantize_rows(blocks, qtype).double()
    return xq @ w.t(), xq.abs() @ w.abs().t()


def isas() -> list[str]:
    if not native.available():
        return []
    return list(native.ISAS[:native.ISAS.index(native.isa()) + 1])


@pytest.fixture
def each_isa(monkeypatch):
    def use(isa: str) -> None:
        monkeypatch.setenv("FORMCAST_NATIVE_ISA", isa)
    return use


needs_native = pytest.mark.skipif(not native.available(),
                                  reason=f"native kernels unavailable: {native.unavailable_reason()}")


@needs_native
@pytest.mark.parametrize("qtype", list(SHAPES))
@pytest.mark.parametrize("rows", ROWS)
def test_kernel_matches_float64_reference_of_the_same_codes(qtype, rows, each_isa):
    inputs = SHAPES[qtype]
    blocks = random_blocks(qtype, OUT, inputs, seed=rows)
    x = torch.randn(rows, inputs, generator=torch.Generator().manual_seed(rows))
    ref, magnitude = reference(x, blocks, qtype)
    for isa in isas():
        each_isa(isa)
        y = native.quant_matmul(x, blocks, qtype)
        assert y.shape == (rows, OUT) and y.dtype == torch.float32
        err = (y.double() - ref).abs()
        assert (err <= 2e-6 * magnitude + 1e-6).all(), (isa, err.max().item())


@needs_native
@pytest.mark.parametrize("qtype", list(SHAPES))
def test_a_rows_result_is_bitwise_the_same_at_any_batch_size(qtype, each_isa):
    inputs = SHAPES[qtype]
    blocks = random_blocks(qtype, OUT, inputs)
    x = torch.randn(17, inputs, generator=torch.Generator().manual_seed(5))
    threads = torch.get_num_threads()
    for isa in isas():
        each_isa(isa)
        alone = torch.cat([native.quant_matmul(x[i:i + 1], blocks, qtype) for i in range(17)])
        for rows in ROWS:
            assert torch.equal(native.quant_matmul(x[:rows], blocks, qtype), alone[:rows])
        try:
            torch.set_num_threads(1)
            assert torch.equal(native.quant_matmul(x, blocks, qtype), alone)
        finally:
            torch.set_num_threads(threads)


@needs_native
@pytest.mark.parametrize("scale", [0.0, 1e-3, 1.0, 300.0])
def test_native_activation_codes_are_the_documented_ones(scale):
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(1)) * scale
    x[0, :32] = 0.0  # an all-zero block: scale 0, codes 0
    q, d = native.quantize_activations(x)
    nq, nd = torch.empty_like(q), torch.empty_like(d)
    ns = torch.empty_like(d)
    torch.ops.formcast_native.quantize_act(x, nq, nd, ns)
    assert torch.equal(nq, q) and torch.equal(nd, d)
    assert torch.allclose(ns, d * q.view(5, 3, 32).sum(-1).float())
    assert q.abs().max() <= 127


@needs_native
def test_output_goes_into_a_column_slice(each_isa):
    blocks = random_blocks("Q4_1", OUT, 160)
    x = torch.randn(3, 160, generator=torch.Generator().manual_seed(2))
    out = torch.full((3, OUT + 10), 7.0)
    native.quant_matmul(x, blocks, "Q4_1", out=out[:, 4:4 + OUT])
    assert torch.equal(out[:, 4:4 + OUT], native.quant_matmul(x, blocks, "Q4_1"))
    assert (out[:, :4] == 7).all() and (out[:, 4 + OUT:] == 7).all()


@pytest.mark.parametrize("bad, message", [
    (("Q4_1", 100), "whole blocks of 32"),
    (("Q4_K", 288), "whole blocks of 256"),
])
def test_row_bytes_refuse_partial_blocks(bad, message):
    with pytest.raises(ValueError, match=message):
        native.block_bytes(*bad)


def test_fused_layer_equals_its_parts_and_the_dense_product():
    parts = [(random_blocks("Q4_1", 16, 256, seed=1), "Q4_1"),
             (random_blocks("Q6_K", 8, 256, seed=2), "Q6_K"),
             (random_blocks("Q8_0", 5, 256, seed=3), "Q8_0")]
    layer = GGUFLinear(parts, 256)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(4))
    y = layer(x)
    assert y.shape == (4, 29)
    singles = torch.cat([GGUFLinear([p], 256)(x) for p in parts], dim=1)
    assert torch.equal(y, singles)
    q, d = native.quantize_activations(x)
    xq = (q.float().view(4, -1, 32) * d[..., None]).view(4, 256)
    dense = torch.cat([dequantize_rows(b, t) for b, t in parts])
    assert torch.allclose(y, xq @ dense.t(), rtol=1e-4, atol=1e-4)


def test_neighbouring_parts_of_one_type_become_one():
    a, b = random_blocks("Q4_0", 4, 96, seed=1), random_blocks("Q4_0", 3, 96, seed=2)
    c = random_blocks("Q8_0", 2, 96, seed=3)
    layer = GGUFLinear([(a, "Q4_0"), (b, "Q4_0"), (c, "Q8_0")], 96)
    assert layer.qtypes == ("Q4_0", "Q8_0") and layer.out_features == 9


def test_layer_refuses_blocks_of_the_wrong_width():
    with pytest.raises(ValueError, match="do not hold rows of 64 inputs"):
        GGUFLinear([(random_blocks("Q4_0", 4, 96), "Q4_0")], 64)


def test_embedding_rows_are_the_dequantized_rows():
    table = random_blocks("Q8_0", 50, 96)
    emb = GGUFEmbedding(table, "Q8_0", 96)
    ids = torch.tensor([3, 0, 49, 3])
    assert torch.equal(emb(ids), dequantize_rows(table, "Q8_0")[ids])
    k = GGUFEmbedding(random_blocks("Q6_K", 7, 256), "Q6_K", 256)
    assert k(torch.tensor([[1, 2]])).shape == (1, 2, 256)


_FALLBACK = textwrap.dedent("""
    import warnings, torch
    warnings.simplefilter("error")  # turned off on purpose: no warning
    from formcast.engine.kernels import native
    from formcast.engine.layers.quant import GGUFLinear
    from formcast.engine.loader.dequant import dequantize_rows
    assert not native.available() and native.isa() == "torch"
    print(native.unavailable_reason())
    blocks = torch.randint(0, 256, (9, 6 * 20), dtype=torch.uint8)
    blocks.view(9, 6, 20)[..., :4] = torch.tensor([0, 36, 0, 36], dtype=torch.uint8)
    x = torch.randn(3, 192)
    q, d = native.quantize_activations(x)
    xq = (q.double().view(3, -1, 32) * d.double()[..., None]).view(3, 192)
    ref = xq @ dequantize_rows(blocks, "Q4_1").double().t()
    y = GGUFLinear([(blocks, "Q4_1")], 192)(x)
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5), (y.double() - ref).abs().max()
    print("fallback ok")
""")


@pytest.mark.parametrize("env, reason", [
    ({"FORMCAST_NATIVE": "0"}, "turned off by FORMCAST_NATIVE=0"),
])
def test_torch_path_serves_with_the_extension_turned_off(env, reason):
    done = subprocess.run([sys.executable, "-c", _FALLBACK], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert reason in done.stdout and "fallback ok" in done.stdout


def test_a_missing_compiler_is_named_in_a_warning(tmp_path):
    code = ("import warnings\nfrom formcast.engine.kernels import native\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    assert not native.available()\n"
            "print(w[0].message)\n")
    env = {**os.environ, "CXX": "no-such-compiler-here", "FORMCAST_CACHE_DIR": str(tmp_path)}
    env.pop("FORMCAST_NATIVE", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "no C++ compiler found" in done.stdout and "no-such-compiler-here" in done.stdout
    assert "pure-torch" in done.stdout

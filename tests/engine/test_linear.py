"""The CPU float32 Linear: F.linear's results at every row count, each row the same
bits whatever else is in the batch, and the packed copy follows the weight."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from formcast.engine.layers.linear import Linear, onednn_available


@pytest.mark.parametrize("bias", [False, True])
def test_every_row_count_matches_f_linear(bias):
    torch.manual_seed(0)
    lin = Linear(96, 40, bias=bias)
    for m in range(1, 20):
        x = torch.randn(m, 96)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")
def test_rows_do_not_depend_on_the_batch():
    """Row j of an m-row call equals row j computed alone, bit for bit, from decode
    sizes to prefill chunks (a SmolLM2-shaped layer, so the kernel's real blocking
    is exercised)."""
    torch.manual_seed(0)
    lin = Linear(576, 1536, bias=False)
    x = torch.randn(300, 576)
    alone = torch.cat([lin(x[j:j + 1]) for j in range(300)])
    for m in (2, 3, 4, 5, 7, 8, 9, 16, 17, 64, 129, 300):
        got = lin(x[:m])
        bad = [j for j in range(m) if not torch.equal(got[j], alone[j])]
        assert not bad, f"{m} rows: rows {bad[:5]} differ from their one-row result"


def test_packed_copy_is_remade_when_the_weight_changes():
    lin = Linear(8, 4, bias=False)
    x = torch.randn(1, 8)
    lin(x)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(4, 8))            # written in place
    torch.testing.assert_close(lin(x), x @ lin.weight.T)
    lin.weight = torch.nn.Parameter(torch.randn(4, 8))  # replaced
    torch.testing.assert_close(lin(x), x @ lin.weight.T)
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), x @ lin.weight.T)


def test_other_dtypes_pass_straight_through():
    lin = Linear(8, 4).to(torch.bfloat16)
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
    assert not lin.is_packed

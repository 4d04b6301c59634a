"""The CPU float32 Linear: same results as F.linear at every row count, and the
transposed copy follows changes of the weight."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from formcast.engine.layers.linear import Linear, pad_rows


@pytest.mark.parametrize("bias", [False, True])
def test_every_row_count_matches_f_linear(bias):
    torch.manual_seed(0)
    lin = Linear(96, 40, bias=bias)
    for m in range(1, 20):
        x = torch.randn(m, 96)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias),
                                   rtol=1e-5, atol=1e-5)


def test_padding_rule():
    assert [pad_rows(m) for m in range(1, 17)] == \
        [1, 2, 3, 4, 5, 8, 8, 8, 9, 12, 12, 12, 13, 16, 16, 16]


def test_transposed_copy_is_remade_when_the_weight_changes():
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
    assert lin._transposed is None

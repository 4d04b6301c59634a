"""The Triton bitmask kernel against the torch reference (CUDA only)."""

import pytest
import torch

from formcast.engine.constraint import bitmask_words
from formcast.engine.kernels.bitmask import apply_token_bitmask_

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("vocab, mask_vocab", [(49152, 49152), (32000, 32000), (1000, 999),
                                               (50304, 49152), (7, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("subset", [False, True])
def test_triton_bitmask_matches_torch(vocab, mask_vocab, dtype, subset):
    gen = torch.Generator().manual_seed(vocab)
    batch = 9
    logits = torch.randn(batch, vocab, generator=gen).to(dtype)
    words = bitmask_words(mask_vocab)
    rows = torch.tensor([0, 3, 4, 8]) if subset else None
    n = 4 if subset else batch
    bitmask = torch.randint(-2**31, 2**31 - 1, (n, words), generator=gen,
                            dtype=torch.int64).to(torch.int32)
    expected = logits.clone()
    apply_token_bitmask_(expected, bitmask, rows, backend="torch")
    got = logits.cuda()
    apply_token_bitmask_(got, bitmask.cuda(), None if rows is None else rows.cuda(),
                         backend="triton")
    assert torch.equal(got.cpu(), expected)


def test_auto_backend_uses_triton_on_cuda_and_masks_padded_vocab():
    logits = torch.zeros(2, 70, device="cuda")
    bitmask = torch.full((2, 2), -1, dtype=torch.int32, device="cuda")  # 64 allowed ids
    apply_token_bitmask_(logits, bitmask)
    assert torch.isfinite(logits[:, :64]).all() and torch.isneginf(logits[:, 64:]).all()

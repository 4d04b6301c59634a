"""allocate_bitmask and apply_bitmask (CPU path; the CUDA kernel has its own engine test)."""

from __future__ import annotations

import pytest
import torch

from formcast.grammars import allocate_bitmask, apply_bitmask


def _mask_allowing(rows: list[set[int]], vocab_size: int) -> torch.Tensor:
    mask = allocate_bitmask(len(rows), vocab_size)
    mask.zero_()
    for r, ids in enumerate(rows):
        for t in ids:
            word = int(mask[r, t // 32]) & 0xFFFFFFFF | (1 << (t % 32))
            mask[r, t // 32] = word - (1 << 32) if word >= 1 << 31 else word
    return mask


def test_allocate_bitmask_allows_everything():
    mask = allocate_bitmask(3, 70)
    assert mask.shape == (3, 3) and mask.dtype == torch.int32
    assert bool((mask == -1).all())
    with pytest.raises(ValueError):
        allocate_bitmask(1, 0)


def test_apply_bitmask_rows_and_padding():
    torch.manual_seed(0)
    logits = torch.randn(4, 70)
    original = logits.clone()
    mask = _mask_allowing([{0, 31, 32, 63}, {5}], 64)       # 64 bits for 70 logits: padding
    apply_bitmask(logits, mask, rows=[2, 0])
    assert torch.equal(logits[1], original[1]) and torch.equal(logits[3], original[3])
    finite = [set(torch.isfinite(logits[r]).nonzero().flatten().tolist()) for r in (2, 0)]
    assert finite == [{0, 31, 32, 63}, {5}]
    assert torch.equal(logits[2, [0, 31]], original[2, [0, 31]])


def test_apply_bitmask_without_rows_and_bad_backend():
    logits = torch.zeros(2, 40)
    apply_bitmask(logits, _mask_allowing([{1}, {39}], 40))
    assert torch.isfinite(logits).nonzero().tolist() == [[0, 1], [1, 39]]
    with pytest.raises(ValueError):
        apply_bitmask(logits, allocate_bitmask(2, 40), backend="cuda-graphs")


@pytest.mark.cuda
def test_apply_bitmask_on_cuda_matches_the_cpu_path():
    torch.manual_seed(0)
    vocab = 49152 + 64                                     # a padded model vocabulary
    logits = torch.randn(5, vocab)
    mask = torch.randint(-(2 ** 31), 2 ** 31 - 1, (3, 49152 // 32), dtype=torch.int32)
    rows = [4, 0, 2]
    expected = logits.clone()
    apply_bitmask(expected, mask, rows, backend="torch")
    on_gpu = logits.cuda()
    apply_bitmask(on_gpu, mask, rows)                      # auto: Triton for CUDA logits
    assert torch.equal(on_gpu.cpu(), expected)

"""allocate_bitmask (the engine applies masks: its kernels have their own tests)."""

from __future__ import annotations

import pytest
import torch

from formcast.grammars import allocate_bitmask


def test_allocate_bitmask_allows_everything():
    mask = allocate_bitmask(3, 70)
    assert mask.shape == (3, 3) and mask.dtype == torch.int32
    assert bool((mask == -1).all())
    with pytest.raises(ValueError):
        allocate_bitmask(1, 0)

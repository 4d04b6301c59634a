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


def _masked_argmax_case(vocab: int, mask_vocab: int, device: str, backend: str,
                        shared: bool = False, sliced: bool = False, copied: int = 0):
    """``copied``: the picks go into a fresh output that many columns wide (junk
    in it), the other columns from a ``source`` (``sliced``: a wider tensor's)."""
    from formcast.engine.kernels.bitmask import masked_argmax_

    if copied:
        gen = torch.Generator().manual_seed(vocab + copied)
        logits = torch.randn(7, vocab, generator=gen).round(decimals=1)
        bitmask = torch.randint(-2**31, 2**31 - 1, (5, bitmask_words(mask_vocab)),
                                generator=gen, dtype=torch.int64).to(torch.int32)
        bitmask[1] = 0
        # (each pick its own column: the engine's are distinct, and two picks into one
        # column land in either order on the device)
        rows, cols = torch.tensor([6, 0, 2, 4, 4]), torch.tensor([3, 0, copied - 1, 1, 5])
        wide = torch.stack((torch.arange(copied + 3) * 3, torch.full((copied + 3,), 9)))
        source = (wide[:, :copied] if sliced else wide[:, :copied].clone()).to(device)
        out = torch.full((2, copied), -5, dtype=torch.long, device=device)
        agree = torch.zeros(5, dtype=torch.bool, device=device)
        masked_argmax_(out, logits.to(device), bitmask.to(device), rows.to(device),
                       cols.to(device), agree, vocab_size=vocab - 1, backend=backend,
                       source=source, mask_rows=torch.tensor([3, 3, 0, 1, 3]).to(device)
                       if shared else None)
        assert torch.equal(source.cpu(), wide[:, :copied])  # (left as it was)
        return out.cpu(), agree.cpu()

    gen = torch.Generator().manual_seed(vocab + mask_vocab)
    logits = torch.randn(7, vocab, generator=gen).round(decimals=1)  # ties
    logits[2, 5:] = float("-inf")
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, bitmask_words(mask_vocab)), generator=gen,
                            dtype=torch.int64).to(torch.int32)
    bitmask[1] = 0                      # a dead end
    bitmask[3] = 0
    bitmask[3, 0] = 1 << 7              # one token allowed
    rows, cols = torch.tensor([6, 0, 2, 4, 4]), torch.tensor([3, 0, 5, 1, 6])
    # ``sliced``: the output is the first columns of a wider tensor (as a graph's is)
    wide = torch.stack((torch.arange(10) * 3, torch.full((10,), 9)))
    agree = torch.zeros(5, dtype=torch.bool)
    mask_rows = torch.tensor([3, 3, 0, 1, 3]) if shared else None  # (rows sharing masks)
    args = [t.to(device) for t in (wide, logits, bitmask, rows, cols, agree)]
    wide = args[0]
    args[0] = wide[:, :7] if sliced else wide[:, :7].clone()
    masked_argmax_(*args, vocab_size=vocab - 1, backend=backend,
                   mask_rows=None if mask_rows is None else mask_rows.to(device))
    return (wide if sliced else args[0]).cpu(), args[5].cpu()


@pytest.mark.parametrize("vocab, mask_vocab", [(49152, 49152), (1000, 999), (50304, 49152),
                                               (7, 7)])
@pytest.mark.parametrize("shared, sliced", [(False, False), (True, False), (True, True)])
def test_triton_masked_argmax_matches_torch(vocab, mask_vocab, shared, sliced):
    assert all(torch.equal(a, b) for a, b in zip(
        _masked_argmax_case(vocab, mask_vocab, "cpu", "torch", shared, sliced),
        _masked_argmax_case(vocab, mask_vocab, "cuda", "triton", shared, sliced)))


@pytest.mark.parametrize("copied", [7, 600, 1100])
@pytest.mark.parametrize("shared, sliced", [(False, False), (True, True)])
def test_triton_masked_argmax_into_a_fresh_output_matches_torch(copied, shared, sliced):
    """With ``source``: every column written, the unpicked ones from it, in one
    launch (more columns than one copying program takes among them)."""
    ref = _masked_argmax_case(49152, 49152, "cpu", "torch", shared, sliced, copied)
    got = _masked_argmax_case(49152, 49152, "cuda", "triton", shared, sliced, copied)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert not (ref[0] == -5).any()


def test_masked_argmax_launched_straight_through_its_launcher_matches_torch():
    """After the first launch of each specialization, the masked-argmax kernel is
    launched through its compiled kernel's launcher (FastLaunch): the picks of
    many launches with fresh data, aligned and not, shared masks and not, are
    the torch reference's."""
    from formcast.engine.kernels.bitmask_triton import _MASKED_ARGMAX

    before = _MASKED_ARGMAX.direct
    for vocab, mask_vocab in ((49152, 49152), (50304, 49152), (1000, 999), (49152, 49152)):
        for shared, sliced in ((False, False), (True, False), (True, True), (False, False)):
            ref = _masked_argmax_case(vocab, mask_vocab, "cpu", "torch", shared, sliced)
            got = _masked_argmax_case(vocab, mask_vocab, "cuda", "triton", shared, sliced)
            assert all(torch.equal(a, b) for a, b in zip(ref, got)), (vocab, shared, sliced)
    assert _MASKED_ARGMAX.direct - before >= 8

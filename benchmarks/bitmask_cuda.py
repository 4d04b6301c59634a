"""Time bitmask application on CUDA: the Triton kernel vs the torch reference.

    python benchmarks/bitmask_cuda.py

Prints microseconds per call (CUDA events, median of 200) and the speedup, for
batches of constrained rows over SmolLM2's and a 128k vocabulary.
"""

from __future__ import annotations

import statistics

import torch

from formcast.engine.constraint import bitmask_words
from formcast.engine.kernels.bitmask import apply_token_bitmask_


def time_us(fn, reps: int = 200) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def main() -> None:
    print(f"{'vocab':>7} {'rows':>5} {'torch us':>9} {'triton us':>10} {'speedup':>8}")
    for vocab in (49152, 128256):
        for rows in (1, 64, 256):
            logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16)
            bitmask = torch.randint(-2**31, 2**31 - 1, (rows, bitmask_words(vocab)),
                                    device="cuda", dtype=torch.int64).to(torch.int32)
            t_torch = time_us(lambda: apply_token_bitmask_(logits, bitmask, backend="torch"))
            t_triton = time_us(lambda: apply_token_bitmask_(logits, bitmask, backend="triton"))
            print(f"{vocab:>7} {rows:>5} {t_torch:>9.1f} {t_triton:>10.1f} "
                  f"{t_torch / t_triton:>7.1f}x")


if __name__ == "__main__":
    main()

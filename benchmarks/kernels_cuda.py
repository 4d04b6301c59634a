"""Triton kernels against their torch reference on CUDA, same run: time per call.

RMSNorm with the fused residual add and in-place RoPE, at decode and prefill row
counts, bfloat16, hidden sizes of SmolLM2-135M (576) and a 1B Llama (2048). Prints
microseconds per call (CUDA events, median of 50) and the speed-up.

    python benchmarks/kernels_cuda.py
"""

from __future__ import annotations

import torch

from formcast.engine.kernels.rmsnorm import add_rms_norm
from formcast.engine.kernels.rope import apply_rope_
from formcast.engine.layers.rotary import RotaryEmbedding

from bitmask_cuda import time_us  # same folder: CUDA-event timing, median


def main() -> None:
    dev, dt = "cuda", torch.bfloat16
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bfloat16\n")
    print(f"{'op':28s} {'rows':>5} {'hidden':>6} {'torch us':>9} {'triton us':>9} {'speed-up':>8}")
    for hidden, heads, kv in ((576, 9, 3), (2048, 32, 8)):
        w = torch.rand(hidden, device=dev, dtype=dt) + 0.5
        cos, sin = RotaryEmbedding(64, 4096, 10000.0).tables(torch.device(dev))
        for rows in (1, 64, 256, 4096):
            x = torch.randn(rows, hidden, device=dev, dtype=dt)
            a = torch.randn(rows, hidden, device=dev, dtype=dt)
            t = time_us(lambda: add_rms_norm(x, a, w, 1e-5, backend="torch"))
            g = time_us(lambda: add_rms_norm(x, a, w, 1e-5, backend="triton"))
            print(f"{'add + rms_norm':28s} {rows:>5} {hidden:>6} {t:9.1f} {g:9.1f} {t / g:7.2f}x")
            qkv = torch.randn(rows, (heads + 2 * kv) * 64, device=dev, dtype=dt)
            qk = qkv[:, :(heads + kv) * 64].view(rows, heads + kv, 64)
            pos = torch.randint(0, 4096, (rows,), device=dev)
            t = time_us(lambda: apply_rope_(qk, pos, cos, sin, backend="torch"))
            g = time_us(lambda: apply_rope_(qk, pos, cos, sin, backend="triton"))
            print(f"{'rope (q|k in place)':28s} {rows:>5} {hidden:>6} {t:9.1f} {g:9.1f} {t / g:7.2f}x")


if __name__ == "__main__":
    main()

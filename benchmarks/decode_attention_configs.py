"""The paged decode attention kernel's launch configurations, swept on CUDA.

For a batch where the kernel runs one program per (row, kv head) and no split
(at least 128 programs), times the engine's own call
(``paged_decode_attention_triton``, the configuration it picks) and then the
kernel itself at every (keys per tile, warps, stages) of a small grid, each
checked against the torch path of the same attention. Each is timed as a
decode step calls it: a CUDA graph calls it once per layer, each layer with
its own caches (``--layers``), so the keys come from memory rather than from
L2, as they do in a step (best of five replays). Rows' contexts spread from
half to 1.5x the length given. Prints microseconds per call, the engine's
first, then the fastest configurations and their speed-up over it.

    python benchmarks/decode_attention_configs.py [--rows 256,128,64] [--context 80,150]

On the H200 (SmolLM2-135M's 9 heads over 3, head dim 64, bfloat16, 30 layers),
a tile of 128 keys over four warps and three stages at 128 rows took 7.0 us
against 9.7 for tiles of 32 keys, two warps and two stages at ~80 tokens, and
10.3 against 14.3 at ~150; at 256 rows tiles of 64 keys, two warps and three
stages took 15.3 us against 17.7 at ~150 tokens (see :func:`decode_config`,
which picks by the number of programs).
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch

from formcast.engine.kernels.paged_attention import paged_decode_attention
from formcast.engine.kernels.paged_attention_triton import (
    decode_splits, launch_decode, paged_decode_attention_triton)

GRID = list(itertools.product((16, 32, 64, 128), (1, 2, 4), (1, 2, 3)))  # keys a tile, warps, stages


def graph_us(fns: list) -> float:
    """Microseconds per call of ``fns``, each called once in a CUDA graph (best of
    five replays)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for f in fns[:2]:
            f()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for f in fns:
            f()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / len(fns) * 1e3)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="256,128,64")
    ap.add_argument("--context", default="80,150",
                    help="tokens of context a row (spread from half to 1.5x)")
    ap.add_argument("--layers", type=int, default=30, help="caches the graph reads in turn")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--table-blocks", type=int, default=64, help="block table width")
    ap.add_argument("--top", type=int, default=6)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("decode_attention_configs.py needs a CUDA device")
    dev, dt = torch.device("cuda"), torch.bfloat16
    h, hkv, d, bs, width = args.heads, args.kv_heads, args.head_dim, args.block_size, \
        args.table_blocks
    scale = d ** -0.5
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bfloat16, "
          f"{h} heads over {hkv}, head dim {d}, {args.layers} layers' caches\n")
    torch.manual_seed(0)
    for rows, context in itertools.product(map(int, args.rows.split(",")),
                                           map(int, args.context.split(","))):
        width = max(width, (context * 3 // 2 + bs - 1) // bs)
        blocks = rows * width + 1
        caches = [(torch.randn(blocks, bs, hkv, d, device=dev, dtype=dt),
                   torch.randn(blocks, bs, hkv, d, device=dev, dtype=dt))
                  for _ in range(args.layers)]
        k_cache, v_cache = caches[-1]  # (the one a graph's replay ends on)
        tables = torch.randperm(blocks - 1, device=dev)[:rows * width].view(rows, width)
        if decode_splits(rows, k_cache, tables) != 1:
            print(f"{rows} rows: the kernel splits contexts there (under 128 programs): skipped")
            continue
        lens = torch.randint(context // 2, context * 3 // 2 + 1, (rows,), device=dev)
        q = torch.randn(rows, h, d, device=dev, dtype=dt)
        ref = paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, backend="torch")
        engine = graph_us([
            lambda k=k, v=v: paged_decode_attention_triton(q, k, v, tables, lens, scale)
            for k, v in caches])
        timed = []
        for block_n, warps, stages in GRID:
            out = torch.empty(rows, h, d, device=dev, dtype=dt)

            def call(k, v, config=(block_n, warps, stages)):
                launch_decode(q, k, v, tables, lens, out, out, scale, 1, config)

            us = graph_us([lambda k=k, v=v: call(k, v) for k, v in caches])
            err = (out.float() - ref.float()).abs().max().item()
            if err > 0.05:
                print(f"  tiles {block_n}, {warps} warps, {stages} stages: off by {err:.3f}")
                continue
            timed.append((us, block_n, warps, stages))
        timed.sort()
        print(f"{rows} rows of ~{context} tokens: the engine's call {engine:.2f} us; fastest:")
        for us, block_n, warps, stages in timed[:args.top]:
            print(f"    {us:6.2f} us  ({engine / us:4.2f}x)  tiles of {block_n} keys, "
                  f"{warps} warps, {stages} stages")


if __name__ == "__main__":
    main()

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

    python benchmarks/decode_attention_configs.py [--rows 256,128,64] [--context 80,150] [--fused]

``--fused`` sweeps the kernel a Llama decode step runs instead (the new token's
rotation and cache store in the same kernel; :func:`sweep_fused`).

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

from formcast.engine.kernels.paged_attention import paged_decode_attention, rope_decode_attention
from formcast.engine.kernels.paged_attention_triton import (
    decode_splits, launch_decode, paged_decode_attention_triton, rope_decode_attention_triton)
from formcast.engine.layers.rotary import RotaryEmbedding

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
    ap.add_argument("--fused", action="store_true",
                    help="the kernel that rotates and stores the new token too (the one a "
                    "Llama decode step runs), over a smaller grid")
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
        if args.fused:
            sweep_fused(args, rows, context, caches, tables, lens, scale)
            continue
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


FUSED_GRID = list(itertools.product((32, 64, 128), (2, 4), (2, 3)))  # keys a tile, warps, stages


def sweep_fused(args, rows: int, context: int, caches, tables, lens, scale: float) -> None:
    """:func:`rope_decode_attention_triton` (rotation, cache store and attention in
    one kernel, the one a Llama decode step runs) at each configuration of
    ``FUSED_GRID``, checked against the torch path on the last layer's caches.

    On the H100 at 256 rows the engine's choice (64 keys, two warps, three
    stages) was the fastest at ~80 tokens (13.6 us) and within 0.2% of it at ~150
    (20.2 us). Variants of the kernel measured there, at their best
    configurations, and dropped: each tile's values asked for with its keys
    (0.98-1.00x the engine's speed), the first tile asked for before the
    rotation's reads (0.86-0.89x), and each next tile asked for before the
    current one is folded in (0.86x): the registers they hold cost more than
    the waits they overlap."""
    dev, dt = lens.device, caches[0][0].dtype
    h, hkv, d = args.heads, args.kv_heads, args.head_dim
    bs = caches[0][0].shape[1]
    qkv = torch.randn(rows, (h + 2 * hkv) * d, device=dev, dtype=dt)
    positions = lens - 1
    slots = tables.gather(1, (positions // bs).unsqueeze(1)).squeeze(1) * bs + positions % bs
    cos, sin = RotaryEmbedding(d, 4096, 10000.0).tables(dev)
    k_last, v_last = caches[-1]
    ref = rope_decode_attention(qkv, h, hkv, positions, cos, sin, k_last.clone(),
                                v_last.clone(), slots, tables, lens, scale, backend="torch")

    def call(k, v, config=None):
        return rope_decode_attention_triton(qkv, h, hkv, positions, cos, sin, k, v, slots,
                                            tables, lens, scale, config=config)

    engine = graph_us([lambda k=k, v=v: call(k, v) for k, v in caches])
    timed = []
    for config in FUSED_GRID:
        try:
            us = graph_us([lambda k=k, v=v: call(k, v, config) for k, v in caches])
        except Exception as exc:  # (out of shared memory or registers at this size)
            print(f"  tiles {config[0]}, {config[1]} warps, {config[2]} stages: "
                  f"{type(exc).__name__}")
            continue
        err = (call(k_last, v_last, config).float() - ref.float()).abs().max().item()
        if err > 0.05:
            print(f"  tiles {config[0]}, {config[1]} warps, {config[2]} stages: "
                  f"off by {err:.3f}")
            continue
        timed.append((us, *config))
    timed.sort()
    print(f"{rows} rows of ~{context} tokens, fused: the engine's call {engine:.2f} us; fastest:")
    for us, block_n, warps, stages in timed[:args.top]:
        print(f"    {us:6.2f} us  ({engine / us:4.2f}x)  tiles of {block_n} keys, "
              f"{warps} warps, {stages} stages")


if __name__ == "__main__":
    main()

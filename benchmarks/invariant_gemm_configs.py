"""Which fixed plan the batch-invariant GEMM should take (a CUDA machine).

1. For each product of a decode layer of ``--shape`` (q|k|v with the norm's row
   scale, o with the residual add, gate|up with the scale and the gate, down with
   the residual add, and the head in float32) at each of ``--rows``: microseconds
   a product for cuBLAS (``torch.mm``, plain) and for
   :func:`invariant_linear_triton` at each candidate plan and its default plan.
   Each figure is one launch's share of a CUDA graph of one launch per layer,
   each layer's weight its own (weights stream from memory, as in a step), the
   median of the replays. Also checks each plan's bits: a row alone equals the
   row among the others.
2. With ``--engine``: one decode graph replay's GPU time, mode off, on, and on
   with its attention unfused, at each of ``--rows``, and the kernel table of a
   replay at the first.

    python benchmarks/invariant_gemm_configs.py [--rows 64,256] [--engine --tokenizer-dir DIR]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from formcast.engine.kernels.invariant_matmul_triton import (GemmPlan, gemm_plan,
                                                             invariant_linear_triton)
from formcast.engine.models.shapes import SHAPES

PLANS = [GemmPlan(bm, bn, bk) for bm, bn, bk in
         [(64, 32, 64), (64, 64, 64), (64, 32, 128), (64, 128, 64), (16, 32, 64), (16, 64, 64),
          (16, 32, 128), (16, 16, 128), (32, 32, 64), (32, 32, 128), (16, 64, 128)]] \
    + [GemmPlan(64, 32, bk, 1, 4, 4) for bk in (64, 128)] \
    + [GemmPlan(16, 32, 128, 1, w, st) for w, st in ((2, 3), (4, 2), (8, 3))] \
    + [GemmPlan(16, 32, 256, 1, 4, 2), GemmPlan(32, 64, 128, 1, 4, 3)] \
    + [GemmPlan(bm, bn, 64, s) for bm, bn, s in [(64, 32, 2), (64, 64, 4), (16, 32, 4)]]
HEAD_PLANS = [GemmPlan(64, 128, 64), GemmPlan(64, 64, 64), GemmPlan(64, 128, 64, 1, 8)]


def label(plan: GemmPlan) -> str:
    return f"{plan.block_m}x{plan.block_n}x{plan.block_k} s{plan.splits} w{plan.num_warps} " \
        f"st{plan.num_stages}"


def graph_us(launch, layers: int, reps: int = 20) -> float:
    """Microseconds a launch: ``launch(i)`` for each layer i, captured once, replayed."""
    for i in range(layers):  # (compiles, warms)
        launch(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(layers):
            launch(i)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / layers)
    return statistics.median(times)


def products(shape: str) -> list[tuple[str, int, int, dict]]:
    cfg = SHAPES[shape]
    e, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d
    return [("qkv+scale", qkv, e, {"scale_eps": 1e-5}),
            ("o+residual", e, cfg.num_attention_heads * d, {"residual": True}),
            ("gate|up+scale+gate", 2 * i, e, {"scale_eps": 1e-5, "gated": True}),
            ("down+residual", e, i, {"residual": True}),
            ("head (float32)", cfg.vocab_size, e, {"out_dtype": torch.float32})]


def reference(x: torch.Tensor, w: torch.Tensor, kw: dict) -> torch.Tensor:
    """What :func:`invariant_linear_triton` computes, in float32."""
    xf = x.float()
    y = xf @ w.float().t()
    if "scale_eps" in kw:
        y = y / torch.sqrt((xf * xf).mean(1, keepdim=True) + kw["scale_eps"])
    if kw.get("gated"):
        gate, up = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(gate) * up
    if "residual" in kw:
        y = y + kw["residual"].float()
    return y


def part_gemm(shape: str, rows: list[int], layers: int) -> None:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    print(f"[1] {shape}: us a product (graph of {layers} launches, one weight each)")
    for name, n, k, extra in products(shape):
        nl = 1 if name.startswith("head") else layers
        ws = [(torch.randn(n, k, device=dev, generator=gen) * k ** -0.5).bfloat16()
              for _ in range(nl)]
        default = gemm_plan(n, k, dev)
        for m in rows:
            x = torch.randn(m, k, device=dev, generator=gen).bfloat16()
            n_out = n // 2 if extra.get("gated") else n
            res = torch.randn(m, n_out, device=dev, generator=gen).bfloat16()
            kw = {key: (res if key == "residual" else v) for key, v in extra.items()}
            line = {"cuBLAS": graph_us(lambda i: torch.mm(x, ws[i].t()), nl)}
            for plan in HEAD_PLANS if name.startswith("head") else PLANS:
                try:
                    y = invariant_linear_triton(x, ws[0], plan=plan, **kw)
                    alone = invariant_linear_triton(x[-1:], ws[0], plan=plan, **kw
                                                    ) if "residual" not in kw else None
                    if alone is not None and not torch.equal(alone, y[-1:]):
                        line[label(plan)] = "NOT INVARIANT"
                        continue
                    want = reference(x, ws[0], kw)
                    err = ((y.float() - want).norm() / want.norm()).item()
                    if not err < 2e-2:
                        line[label(plan)] = f"WRONG ({err:.3g})"
                        continue
                    line[label(plan)] = graph_us(
                        lambda i: invariant_linear_triton(x, ws[i], plan=plan, **kw), nl)
                except Exception as exc:  # (a plan that does not compile is a finding)
                    line[label(plan)] = f"failed: {type(exc).__name__}"
            best = min((v, key) for key, v in line.items() if isinstance(v, float)
                       and key != "cuBLAS")
            dflt = label(default)
            print(f"  {name:20s} M={m:4d} N={n:6d} K={k:5d}: cuBLAS {line['cuBLAS']:6.2f}  "
                  f"best {best[0]:6.2f} ({best[1]})  default {line.get(dflt)} ({dflt})",
                  flush=True)
            print("     " + "  ".join(f"{key}={v:.2f}" if isinstance(v, float) else
                                      f"{key}={v}" for key, v in line.items()), flush=True)


def part_engine(shape: str, rows: list[int], tokenizer_dir: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    from formcast.engine import Tokenizer
    from gpu_throughput import make_engine, replayable_graph

    tok = Tokenizer.from_hf_dir(tokenizer_dir)
    context = 150
    print(f"\n[2] decode graph replay, GPU ms a step (contexts of {context})")
    from formcast.engine.models.llama import LlamaAttention

    for on, fused in ((False, True), (True, True), (True, False)):
        LlamaAttention.fused_decode = fused  # (the mode's fused rope-and-attend kernel or not)
        eng = make_engine(shape, tok, max(rows), batch_invariant=on)
        for b in rows:
            graph = replayable_graph(eng, b, context)
            a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(50):
                graph.replay()
            e.record()
            e.synchronize()
            print(f"mode {'on ' if on else 'off'}{'' if fused else ' (attention unfused)'} "
                  f"b={b}: {a.elapsed_time(e) / 50:.3f} ms", flush=True)
            if b == rows[0]:
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        graph.replay()
                    torch.cuda.synchronize()
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14,
                                                max_name_column_width=60))
        del eng, graph
        torch.cuda.empty_cache()
    LlamaAttention.fused_decode = True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--rows", default="64,256")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--engine", action="store_true")
    ap.add_argument("--skip-gemm", action="store_true")
    ap.add_argument("--tokenizer-dir")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    print(f"device={torch.cuda.get_device_name()} torch={torch.__version__}")
    if not args.skip_gemm:
        part_gemm(args.shape, rows, args.layers)
    if args.engine:
        part_engine(args.shape, rows, args.tokenizer_dir)


if __name__ == "__main__":
    main()

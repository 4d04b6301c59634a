"""How fast could any engine decode SmolLM2-135M on this machine? The linear layers' floor.

A decode step must at least run every linear layer of the model once for the batch
(30 x [qkv, o, gate_up, down] + the 49152-row head). This script times exactly that,
with distinct weight tensors per layer (as in the model, so nothing stays in cache)
and the engine's own layer classes, for each weight format formcast's CPU path offers (float32, bfloat16, int8, int4 with
the head in int8, as ``quantization="int4"`` builds it), and runs transformers'
``generate`` on the real model in the same run. ``floor tok/s`` is batch / step time:
the speed of an engine whose attention, norms, sampling and Python cost nothing.
``best ratio`` = floor / HF is therefore the highest speed-up over HF that format
can reach here; a target above it cannot be met with that format on this machine.

Usage::

    python benchmarks/decode_floor.py [--batch-sizes 1,16] [--tokens 64] [--threads N]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from torch import nn

from formcast.engine.layers.linear import Linear
from formcast.engine.layers.quant import Bf16Linear, Int4Linear, Int8Linear
from formcast.engine.models.shapes import SHAPES

import engine_vs_hf as peer  # same folder: HF loading and generate, the same prompts

FORMATS = ("float32", "bfloat16", "int8", "int4")


def layer_shapes(cfg) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's linears, fused as formcast runs them."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d
    return [(h, qkv), (cfg.num_attention_heads * d, h), (h, 2 * i), (i, h)]


def build(fmt: str, cfg, seed: int = 0) -> tuple[list[list[nn.Module]], nn.Module]:
    torch.manual_seed(seed)

    def convert(lin: nn.Linear, head: bool = False) -> nn.Module:
        if fmt == "float32":
            return lin
        if fmt == "bfloat16":
            return Bf16Linear(lin)
        if head:  # quantize_linears gives the head 8 bits
            return Int8Linear(lin)
        return Int8Linear(lin) if fmt == "int8" else Int4Linear(lin)

    def linear(i: int, o: int) -> nn.Linear:
        lin = Linear(i, o, bias=False)  # the engine's own, with its CPU float32 paths
        nn.init.normal_(lin.weight, std=0.02)
        return lin

    layers = [[convert(linear(i, o)) for i, o in layer_shapes(cfg)]
              for _ in range(cfg.num_hidden_layers)]
    head = linear(cfg.hidden_size, cfg.vocab_size)
    return layers, convert(head, head=fmt != "float32")


@torch.inference_mode()
def step_seconds(layers, head, batch: int, repeats: int = 7) -> float:
    xs = {}

    def run() -> None:
        for layer in layers:
            for mod in layer:
                x = xs.setdefault(mod.in_features, torch.randn(batch, mod.in_features))
                mod(x)
        head(xs[head.in_features])

    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per request for HF")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    cfg = SHAPES["smollm2-135m"]

    from formcast.engine import load_tokenizer

    tok = load_tokenizer("smollm2")
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}],
                                       add_generation_prompt=True, tokenize=True)
               for p in peer.PROMPTS]
    hf = peer.load_hf(torch.device("cpu"), torch.float32)
    print(f"SmolLM2-135M shapes, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}")

    hf_rate = {}
    for b in batches:
        trial, _ = peer.run_hf(hf, peer.batch_prompts(prompts, b), args.tokens,
                               torch.device("cpu"))
        hf_rate[b] = trial.tok_s
    del hf

    rows = []
    for fmt in FORMATS:
        layers, head = build(fmt, cfg)
        for b in batches:
            rows.append((fmt, b, step_seconds(layers, head, b)))
        del layers, head

    print(f"\n{'format':>9}  {'batch':>5}  {'linears ms/step':>15}  {'floor tok/s':>11}  "
          f"{'HF tok/s':>8}  {'best ratio':>10}  {'target':>6}")
    for fmt, b, sec in rows:
        floor = b / sec
        target = peer.TARGETS.get(b)
        verdict = "" if target is None else (f"{target:.0f}x " + ("reachable" if floor / hf_rate[b]
                                                                   >= target else "OUT OF REACH"))
        print(f"{fmt:>9}  {b:>5}  {1e3 * sec:>15.1f}  {floor:>11.1f}  {hf_rate[b]:>8.1f}  "
              f"{floor / hf_rate[b]:>9.2f}x  {verdict}")
    print("\nfloor = batch / time of the linear layers alone; HF = transformers generate "
          "(float32, end to end) in this run.")


if __name__ == "__main__":
    main()

"""Where a CUDA decode step's time goes (a CUDA machine; random SmolLM2-shape weights).

1. GPU time of one decode-graph replay at each batch size (back-to-back replays,
   contexts of 150 tokens), and the kernel table of the replay at the smallest and
   largest size (torch.profiler).
2. Host side: tokens/s of free and JSON-constrained ``generate`` (64 tokens a row)
   at each batch size, each followed by a cProfile of the host thread.

    python benchmarks/gpu_profile.py --tokenizer-dir DIR [--batch-sizes 1,64,256]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

from formcast.engine import SamplingParams, Tokenizer
from gpu_throughput import SCHEMA, make_engine, prompts, replayable_graph, timed_generate

CONTEXT = 150


def replay_times(eng, sizes: list[int]) -> None:
    g = eng.runner.graphs
    print(f"graph sizes {g.sizes}")
    for b in sizes:
        graph = replayable_graph(eng, b, CONTEXT)
        t = time.perf_counter()
        for _ in range(50):
            graph.replay()
        torch.cuda.synchronize()
        print(f"replay b={b}: {(time.perf_counter() - t) / 50 * 1e3:.3f} ms GPU per step",
              flush=True)
        if b in (sizes[0], sizes[-1]):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    graph.replay()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25,
                                            max_name_column_width=70))


def host_profiles(eng, tok: Tokenizer, sizes: list[int]) -> None:
    from formcast.grammars import JsonSchema, compile

    compiled = compile(JsonSchema(SCHEMA), tok, vocab_size=eng.model.config.vocab_size)
    sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for bs in sizes:
        ps = prompts(tok, bs)
        for name, make in (("free", None),
                           ("json", lambda: [compiled.matcher() for _ in ps])):
            secs, count = timed_generate(eng, ps, sp, make)
            print(f"{name} bs{bs}: {count / secs:.0f} tok/s, {secs / 64 * 1e3:.3f} ms/step",
                  flush=True)
            prof = cProfile.Profile()
            constraints = make() if make else None
            prof.enable()
            eng.generate(ps, sp, constraints=constraints)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(22)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer-dir", required=True)
    ap.add_argument("--batch-sizes", default="1,64,256")
    args = ap.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    tok = Tokenizer.from_hf_dir(args.tokenizer_dir)
    eng = make_engine("smollm2-135m", tok, max(sizes))
    replay_times(eng, sizes)
    host_profiles(eng, tok, [b for b in sizes if b > 1])


if __name__ == "__main__":
    main()

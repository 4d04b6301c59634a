"""Where a constrained run's extra time goes: its opening steps, or every step.

``gpu_throughput.py`` part 2 gives one ratio per batch size (constrained tokens/s
over free tokens/s). This script splits that ratio: it runs the same workload
(every row under the JSON Schema of part 2, against free text, same engine,
sides alternating) and times each ``step`` call on the host, the device
synchronized at the ends of each run only. For the fastest run of each side it
prints

- the total, and the time of the first ``--opening`` steps (the prefill, then the
  steps whose rows are masked while the schema forces the text of an answer's
  opening, '{"records":[{"name":"');
- the median step after those;
- the first steps one by one, each with its number of masked rows
  (``step us/masked``): refusals in bulk show up there as masked rows again.

On the H200 at batch 256 (SmolLM2-135M's shape) the opening was about half of
the constrained run's extra time, and the steps after it were host-bound.

    python benchmarks/step_series.py --tokenizer-dir DIR [--batch-sizes 64,256] [--runs 4]
    python benchmarks/step_series.py --tokenizer-dir DIR --device cpu --batch-sizes 4 --tokens 16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import gpu_throughput
from formcast.engine import SamplingParams, Tokenizer
from formcast.grammars import JsonSchema, compile
from gpu_throughput import SCHEMA, limit_host_cores, make_engine, prompts


def series(eng, ps, sp, compiled=None) -> tuple[list[float], list[int]]:
    """Seconds of each ``step`` of one run to completion, and the rows masked
    after each (those a constrained row's next pick is sampled under)."""
    for p in ps:
        eng.add_request(p, sp, constraint=None if compiled is None else compiled.matcher())
    gpu_throughput.sync()
    times, masked = [], []
    while eng.has_unfinished_requests():
        start = time.perf_counter()
        eng.step(finished_only=True)
        times.append(time.perf_counter() - start)
        masked.append(sum(1 for s in eng.scheduler.running if s.masked))
    gpu_throughput.sync()
    return times, masked


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer-dir", required=True)
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--batch-sizes", default="64,256")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=4, help="runs a side, alternating")
    ap.add_argument("--opening", type=int, default=25, help="steps counted as the opening")
    ap.add_argument("--show", type=int, default=28, help="first steps printed one by one")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--host-cores", type=int, default=None,
                    help="run on this many host cores (a slower host)")
    args = ap.parse_args()
    limit_host_cores(args.host_cores)
    gpu_throughput.DEVICE = torch.device(args.device)
    tok = Tokenizer.from_hf_dir(args.tokenizer_dir)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    eng = make_engine(args.shape, tok, max(sizes))
    compiled = compile(JsonSchema(SCHEMA), tok, vocab_size=eng.model.config.vocab_size)
    sp = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    print(f"host time of each engine step, {args.shape}, {args.tokens} tokens a row; "
          f"the fastest of {args.runs} runs a side")
    for bs in sizes:
        ps = prompts(tok, bs)
        series(eng, ps, sp)  # warm-up, both sides
        series(eng, ps, sp, compiled)
        runs = {"free": [], "json": []}
        for _ in range(args.runs):
            runs["free"].append(series(eng, ps, sp))
            runs["json"].append(series(eng, ps, sp, compiled))
        best = {side: min(got, key=lambda r: sum(r[0])) for side, got in runs.items()}
        for side, (times, masked) in best.items():
            k = args.opening
            later = statistics.median(times[k:]) * 1e6 if len(times) > k else float("nan")
            print(f"batch {bs:>4} {side}: total {sum(times) * 1e3:7.1f} ms, first {k} steps "
                  f"{sum(times[:k]) * 1e3:6.1f} ms, median step after them {later:6.0f} us "
                  f"({len(times)} steps)")
            print("    step us/masked: " + " ".join(
                f"{t * 1e6:.0f}/{m}" for t, m in zip(times[:args.show], masked[:args.show])))
        (free, _), (json_, _) = best["free"], best["json"]
        k = args.opening
        print(f"batch {bs:>4} json/free tokens/s {sum(free) / sum(json_):.3f}; extra time "
              f"{(sum(json_) - sum(free)) * 1e3:.1f} ms, of which the first {k} steps "
              f"{(sum(json_[:k]) - sum(free[:k])) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()

"""What batch-invariant mode costs on the CPU: tokens/s with and without, same run.

Two engines over one model (the embedded SmolLM2, int4 by default, or float32
with ``--quantization none``), one with ``EngineConfig(batch_invariant=True)``
and one with it off, take turns on the same workload (chat prompts, greedy,
``--tokens`` a request, ``--batch`` requests at once), the order flipped each
round. Prints each side's best and median tokens/s and the ratio on/off
(target: at least 0.95), the same per second of this process's CPU time (on a
machine others load, wall time swings with their work; CPU time much less,
best with ``--threads 1``, where no thread spins waiting for another), and
whether the two sides' tokens agree (they may not: the modes round
differently; each is deterministic on its own).

    python benchmarks/batch_invariance_cpu.py --batch 8 --tokens 32 --runs 3 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from formcast.engine import Engine, EngineConfig, SamplingParams

TOPICS = ["the sea", "a city at night", "prime numbers", "the moon", "bread", "rivers",
          "an old clock", "winter", "a library", "mountains", "coffee", "trains"]


def prompts(engine: Engine, n: int) -> list[list[int]]:
    tok = engine.tokenizer
    return [list(tok.apply_chat_template(
        [{"role": "user", "content": f"Write a short paragraph about {TOPICS[i % len(TOPICS)]}."}],
        add_generation_prompt=True, tokenize=True)) for i in range(n)]


def timed(engine: Engine, ps: list[list[int]], sp: SamplingParams
          ) -> tuple[float, float, list]:
    """Tokens per wall second, tokens per CPU second of this process, the tokens."""
    start, cpu = time.perf_counter(), time.process_time()
    outs = engine.generate(ps, sp)
    secs, cpu_secs = time.perf_counter() - start, time.process_time() - cpu
    n = sum(len(o.token_ids) for o in outs)
    return n / secs, n / cpu_secs, [list(o.token_ids) for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quantization", default="int4", choices=["int4", "int8", "none"])
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    quant = None if args.quantization == "none" else args.quantization
    base = Engine.from_pretrained("smollm2", device="cpu", quantization=quant,
                                  num_threads=args.threads)
    sides = {}
    for on in (False, True):
        sides[on] = Engine(base.model, base.tokenizer, device=torch.device("cpu"),
                           config=EngineConfig(batch_invariant=on, spec="none",
                                               enable_prefix_caching=False,
                                               max_num_seqs=max(args.batch, 1),
                                               num_threads=args.threads))
    ps = prompts(base, args.batch)
    sp = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    for eng in sides.values():  # warm-up (first calls allocate and pack)
        eng.generate(ps[:1], SamplingParams(max_tokens=2, temperature=0.0))
    rates: dict[bool, list[float]] = {False: [], True: []}
    cpu_rates: dict[bool, list[float]] = {False: [], True: []}
    tokens: dict[bool, list] = {}
    for r in range(args.runs):
        for on in ((False, True) if r % 2 == 0 else (True, False)):
            rate, cpu_rate, toks = timed(sides[on], ps, sp)
            rates[on].append(rate)
            cpu_rates[on].append(cpu_rate)
            tokens[on] = toks
    print(f"SmolLM2 {args.quantization}, batch {args.batch}, {args.tokens} tokens a request, "
          f"{torch.get_num_threads()} threads, {args.runs} runs a side")
    for on in (False, True):
        print(f"  batch_invariant={on!s:5}: best {max(rates[on]):8.1f} tok/s, "
              f"median {statistics.median(rates[on]):8.1f} tok/s")
    print(f"  ratio on/off: best {max(rates[True]) / max(rates[False]):.3f}, "
          f"median {statistics.median(rates[True]) / statistics.median(rates[False]):.3f}")
    for on in (False, True):
        print(f"  batch_invariant={on!s:5}: best {max(cpu_rates[on]):8.1f} tok per CPU s, "
              f"median {statistics.median(cpu_rates[on]):8.1f}")
    print(f"  ratio on/off per CPU second: best "
          f"{max(cpu_rates[True]) / max(cpu_rates[False]):.3f}, median "
          f"{statistics.median(cpu_rates[True]) / statistics.median(cpu_rates[False]):.3f}")
    print(f"  same tokens on both sides: {tokens[True] == tokens[False]}")


if __name__ == "__main__":
    main()

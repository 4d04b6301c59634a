"""What a change to the engine buys, two variants in one process, sides alternating.

The GPU benchmark's figures move with the host machine more than with most
changes (its part 2 at batch 256 has read 0.80 to 0.94 on different H200 hosts
for the same code), so a change is measured against its baseline in the same
process: ``gpu_throughput.py``'s workloads (free text, and every row under its
JSON Schema, greedy, ``--tokens`` a row) on one engine of random weights, the
baseline (A) and the variant (B) taking turns run by run, the order flipped
each round. B is A with tuning fields replaced (``--tuning``, fields of
:class:`formcast.engine.tuning.EngineTuning`) and engine config fields replaced
(``--config``), on an engine of its own built with them (same weights); the
change under test is written behind such a switch.

Prints, per batch size and workload, the tokens/s of each side (best and
median of ``--runs``) and B's over A's, then each side's JSON/free ratio (part
2's figure). The two sides' outputs (every row of a timed run) are checked to be
the same tokens.

    python benchmarks/engine_ab.py --tokenizer-dir DIR --tuning uniform_rows=False
    python benchmarks/engine_ab.py --tokenizer-dir DIR --config unmasked_greedy=False
    python benchmarks/engine_ab.py --tokenizer-dir DIR --device cpu --batch-sizes 4 --tokens 8 \\
        --tuning overlap_rows=1

``--tuning NAME=LITERAL`` (repeatable): an EngineTuning field. ``--config
NAME=LITERAL``: an EngineConfig field (``unmasked_greedy``, ``native_accept``,
...; not those the benchmark sets itself: ``max_num_seqs``, the KV cache's size).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import gpu_throughput as bench
from formcast.engine import SamplingParams, Tokenizer
from formcast.engine.models.shapes import DEEPSEEK_V4_SHAPES, SHAPES
from formcast.engine.tuning import EngineTuning


def run_side(eng, ps, sp, constraints):
    """Tokens/s of one timed ``generate`` on ``eng``, and its outputs' tokens."""
    secs, outs = bench.timed_outputs(eng, ps, sp, constraints)
    tokens = [o.token_ids for o in outs]
    return sum(map(len, tokens)) / secs, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer-dir", required=True)
    ap.add_argument("--shape", default="smollm2-135m",
                    choices=sorted(SHAPES) + sorted(DEEPSEEK_V4_SHAPES))
    ap.add_argument("--batch-sizes", default="256")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=6, help="timed runs a side and workload")
    ap.add_argument("--workloads", default="free,json")
    ap.add_argument("--tuning", dest="tunings", action="append", default=[],
                    help="EngineTuning field=literal for side B (repeatable)")
    ap.add_argument("--config", dest="configs", action="append", default=[],
                    help="EngineConfig field=literal for side B (repeatable)")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run")
    args = ap.parse_args()
    if not args.tunings and not args.configs:
        ap.error("nothing to compare: give --tuning or --config for side B")
    bench.DEVICE = torch.device(args.device)
    try:
        tuning = EngineTuning.parse(args.tunings)
    except ValueError as exc:
        ap.error(str(exc))
    try:
        changes = bench.config_changes(args.configs)
    except ValueError as exc:
        ap.error(str(exc))
    tok = Tokenizer.from_hf_dir(args.tokenizer_dir)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    workloads = args.workloads.split(",")
    if not set(workloads) <= {"free", "json"}:
        ap.error(f"--workloads: free and/or json, not {args.workloads!r}")
    name = torch.cuda.get_device_name() if bench.DEVICE.type == "cuda" else "cpu"
    print(f"device={name} torch={torch.__version__}")
    print("B: " + "; ".join(args.tunings + args.configs))
    t = time.perf_counter()
    eng = bench.make_engine(args.shape, tok, max(sizes))
    print(f"engine built in {time.perf_counter() - t:.1f} s")
    # (an engine's parts take their config as it is built: B gets an engine of its own)
    eng_b = bench.make_engine(args.shape, tok, max(sizes), tuning=tuning, **changes)
    from formcast.grammars import JsonSchema, compile

    compiled = compile(JsonSchema(bench.SCHEMA), tok, vocab_size=eng.model.config.vocab_size)
    sp = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    print(f"{args.tokens} tokens a row, {args.runs} runs a side; tok/s best (median)")
    print(f"{'batch':>5} {'load':>5} {'A tok/s':>17} {'B tok/s':>17} {'B/A':>15}")
    for bs in sizes:
        ps = bench.prompts(tok, bs)
        best = {}
        for load in workloads:
            constraints = None if load == "free" else \
                (lambda: [compiled.matcher() for _ in ps])
            got = {"A": [], "B": []}
            tokens = {}
            for r in range(args.runs):
                for side in ("A", "B") if r % 2 == 0 else ("B", "A"):
                    rate, toks = run_side(eng if side == "A" else eng_b, ps, sp, constraints)
                    got[side].append(rate)
                    tokens.setdefault(side, toks)
            same = "" if tokens["A"] == tokens["B"] else "  (outputs differ)"
            a, b = got["A"], got["B"]
            mid = statistics.median
            best[load] = (max(a), max(b), mid(a), mid(b))
            print(f"{bs:>5} {load:>5} {max(a):>9.0f} ({mid(a):>6.0f}) "
                  f"{max(b):>9.0f} ({mid(b):>6.0f}) {max(b) / max(a):>6.3f} "
                  f"({mid(b) / mid(a):.3f}){same}", flush=True)
        if {"free", "json"} <= set(best):
            fa, fb, fma, fmb = best["free"]
            ja, jb, jma, jmb = best["json"]
            print(f"{bs:>5} json/free  A {ja / fa:.3f} ({jma / fma:.3f})  "
                  f"B {jb / fb:.3f} ({jmb / fmb:.3f})", flush=True)


if __name__ == "__main__":
    main()

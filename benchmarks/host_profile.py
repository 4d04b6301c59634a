"""Where the engine's main thread spends a large batch's decode steps, free text
against JSON, as py-spy samples it (a CUDA machine with py-spy, which
``benchmarks/device_prep.sh`` carries; ``--device cpu`` for a smoke run).

    python benchmarks/host_profile.py --tokenizer-dir DIR [--batch 256] [--runs 20]

Runs itself twice under ``py-spy record --nonblocking --idle`` (free text, then
every row under ``gpu_throughput.py``'s JSON Schema: the same engine of random
weights, greedy, ``--tokens`` a row), each time ``--runs`` timed ``generate``
calls after two warm-ups. For each workload it prints the main thread's time a
step, the part of it spent waiting (for the device's event, or for the native
worker's verdicts), and the engine's functions as a tree, their microseconds a
step (waiting in brackets); then the source lines with the most time of their
own, JSON against free text. Sampling costs the runs some speed (their tokens/s
are printed too); what it tells is where the time goes, not how much there is.

On an H100 with a fast host (before the norms were folded), at 256 rows: free
text's main thread waited for the device 78% of a step (busy ~280 us of 1307),
JSON's 50% (busy ~630 us), spread over many parts: the masked rows' sampling
~107 us a step, the fast lane's staging and copies ~90 more than free text's.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = "profiled_runs"  # the function whose stacks are counted
WAITS = ("wait_event", "Worker.wait")  # frames where the main thread waits


def profiled_runs(eng, ps, sp, constraints, runs: int, timed) -> list[float]:
    rates = []
    for _ in range(runs):
        secs, count = timed(eng, ps, sp, constraints)
        rates.append(count / secs)
    return rates


def worker(args) -> None:
    """The workload itself (run under py-spy): prints its step count and rates."""
    import torch

    import gpu_throughput as bench
    from formcast.engine import SamplingParams, Tokenizer
    from formcast.grammars import JsonSchema, compile

    bench.DEVICE = torch.device(args.device)
    tok = Tokenizer.from_hf_dir(args.tokenizer_dir)
    eng = bench.make_engine(args.shape, tok, args.batch)
    ps = bench.prompts(tok, args.batch)
    sp = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    constraints = None
    if args.worker == "json":
        compiled = compile(JsonSchema(bench.SCHEMA), tok, vocab_size=eng.model.config.vocab_size)
        constraints = lambda: [compiled.matcher() for _ in ps]  # noqa: E731
    for _ in range(2):
        bench.timed_generate(eng, ps, sp, constraints)
    steps, step = [0], eng._step

    def counted_step():  # (the engine's steps, warm-ups included: their share subtracted)
        steps[0] += 1
        return step()

    eng._step = counted_step
    rates = profiled_runs(eng, ps, sp, constraints, args.runs, bench.timed_generate)
    # (each timed generate runs a 4-token warm-up first, in the same stacks)
    print(json.dumps({"steps": steps[0], "rates": rates}))


def read(path: str) -> tuple[collections.Counter, collections.Counter, int]:
    """py-spy's raw stacks under :data:`ROOT`: samples by call path (function
    names), by source line of the innermost frame, and in all."""
    paths, lines, total = collections.Counter(), collections.Counter(), 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            frames = stack.split(";")
            at = next((i for i, fr in enumerate(frames) if fr.startswith(ROOT)), None)
            if at is None or not count.isdigit():
                continue
            n = int(count)
            total += n
            frames = frames[at + 1:]
            names = tuple(fr.split(" (")[0] for fr in frames)
            waiting = any(name in WAITS for name in names)
            for depth in range(1, len(names) + 1):
                paths[names[:depth]] += n
                if waiting:
                    paths[names[:depth] + ("<wait>",)] += n
            if frames and not waiting:
                lines[frames[-1].split(" (", 1)[-1].rstrip(")").rsplit("/", 1)[-1] +
                      " " + names[-1]] += n
    return paths, lines, total


def report(name: str, paths, total: int, steps: int, rate: float, depth: int,
           least_us: float) -> None:
    per = 1e6 / rate / max(1, steps)  # microseconds a step of one sample
    waited = sum(v for k, v in paths.items() if len(k) == 2 and k[-1] == "<wait>")
    print(f"\n{name}: {steps} steps, main thread {total * per:.0f} us a step, "
          f"{waited * per:.0f} of it waiting")

    def show(prefix: tuple, level: int) -> None:
        kids = [(k, v) for k, v in paths.items()
                if len(k) == len(prefix) + 1 and k[:-1] == prefix and k[-1] != "<wait>"]
        for k, v in sorted(kids, key=lambda kv: -kv[1]):
            if v * per < least_us:
                continue
            wait = paths.get(k + ("<wait>",), 0) * per
            print(f"{'  ' * level}{v * per:7.1f} us ({wait:6.1f})  {k[-1]}")
            if level + 1 < depth:
                show(k, level + 1)

    show((), 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer-dir", required=True)
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--rate", type=int, default=2000, help="py-spy's samples a second")
    ap.add_argument("--depth", type=int, default=8, help="levels of the tree printed")
    ap.add_argument("--least-us", type=float, default=4.0,
                    help="parts under this many microseconds a step are left out")
    ap.add_argument("--lines", type=int, default=30, help="source lines printed")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--worker", choices=("free", "json"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    spy = shutil.which("py-spy")
    if spy is None:
        sys.exit("py-spy is not on PATH (pip install py-spy; benchmarks/device_prep.sh "
                 "carries its wheel)")
    got = {}
    with tempfile.TemporaryDirectory() as tmp:
        for load in ("free", "json"):
            out = os.path.join(tmp, f"{load}.txt")
            cmd = [spy, "record", "-r", str(args.rate), "--nonblocking", "--idle", "-f", "raw",
                   "-o", out, "--", sys.executable, __file__, "--worker", load,
                   "--tokenizer-dir", args.tokenizer_dir, "--shape", args.shape,
                   "--batch", str(args.batch), "--tokens", str(args.tokens),
                   "--runs", str(args.runs), "--device", args.device]
            done = subprocess.run(cmd, capture_output=True, text=True)
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
            if done.returncode != 0 or not lines:
                sys.exit(f"the {load} run failed:\n{done.stderr[-3000:]}")
            info = json.loads(lines[-1])
            got[load] = (read(out), info)
    print(f"device={args.device} shape={args.shape} batch={args.batch} "
          f"tokens={args.tokens} runs={args.runs}")
    for load in ("free", "json"):
        (paths, _, total), info = got[load]
        rates = sorted(info["rates"])
        print(f"{load}: tokens/s best {rates[-1]:.0f}, median {rates[len(rates) // 2]:.0f} "
              "(sampled)")
        report(load, paths, total, info["steps"], args.rate, args.depth, args.least_us)
    (_, free_lines, _), free_info = got["free"]
    (_, json_lines, _), json_info = got["json"]
    per_free = 1e6 / args.rate / max(1, free_info["steps"])
    per_json = 1e6 / args.rate / max(1, json_info["steps"])
    print("\nlines with the most time of their own (not waiting), us a step: free, json, "
          "json - free")
    keys = set(free_lines) | set(json_lines)
    diff = {k: json_lines[k] * per_json - free_lines[k] * per_free for k in keys}
    for k in sorted(keys, key=lambda k: -diff[k])[:args.lines]:
        print(f"{free_lines[k] * per_free:7.1f} {json_lines[k] * per_json:7.1f} "
              f"{diff[k]:+7.1f}  {k}")


if __name__ == "__main__":
    main()

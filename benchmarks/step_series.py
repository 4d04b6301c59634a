"""Where a constrained run's extra time goes: its opening steps, or every step.

``gpu_throughput.py`` part 2 gives one ratio per batch size (constrained tokens/s
over free tokens/s). This script splits that ratio: it runs the same workload
(every row under the JSON Schema of part 2, against free text, same engine,
sides alternating) and times each ``step`` call on the host, the device
synchronized at the ends of each run only. For the fastest run of each side it
prints

- the total, and the time of the first ``--opening`` steps (the prefill, then
  the first steps of the rows' answers; with ``--no-jump-forward``, steps
  whose rows are masked while the schema forces the text of an answer's opening,
  '{"records":[{"name":"', which jump-forward takes in the prefill);
- the median step after those;
- the first steps one by one, each with its number of masked rows
  (``step us/masked``): refusals in bulk show up there as masked rows again;
- the last steps one by one (``--tail``): rows a refused pick set back a step
  end after the rest of the batch.

On the H200 at batch 256 (SmolLM2-135M's shape) the opening was about half of
the constrained run's extra time, and the steps after it were host-bound.

``--parts`` says where the time of those runs goes: the host's time in each
part of the engine's step, step by step, and on CUDA the device's idle time
before each decode forward (events recorded around the forwards and after the
masked picks: the gap from the last of them to a forward's start is time the
device waited for the host to launch it). It prints the steps where the device
waited longest (with the parts of each of them and of the step before), and each
part's mean per step over the opening and after it; ``gc`` is the garbage
collector's time, on any thread, and ``verdicts`` the main thread's wait for the
native worker's verdicts on a step's unmasked picks (inside ``fast_lane`` and
``take_end``; none on the CPU, whose picks the accept thread checks).
Its timers cost the host some microseconds a step. On the H200 at batch 256
(JSON 131 steps, free text 129) the device waited 10.4 ms before forwards in the
constrained run against 0.9 in the free one, 5.3 of them in one step: the one
after most rows ended, which appended their last tokens and finished them
(4.3 ms) before the few rows a refused pick had set a step back could go on;
on a slower host 35.0 ms against 1.7, 10.3 of them in that step and 0.7-2.6 ms
in each of the first two steps and the steps where masked rows unmask. (That
step's wait is the finishing of the ended rows, which a free run does after its
last forward: what the constrained run pays more is the steps after it.) Whole
runs' kernels took 148.1 ms constrained against 144.1 free (two more steps, the
masked picks); with a batch's first tokens in flight and two agreements asked
after a refusal, a fast host's constrained run took 130 steps and 6.8 ms more
than the free one (2.5 in the first 12 steps, 1.7 in the last 5).

    python benchmarks/step_series.py --tokenizer-dir DIR [--batch-sizes 64,256] [--runs 4]
    python benchmarks/step_series.py --tokenizer-dir DIR --device cpu --batch-sizes 4 --tokens 16
    python benchmarks/step_series.py --tokenizer-dir DIR --batch-sizes 256 --parts
"""

from __future__ import annotations

import argparse
import collections
import gc
import statistics
import time

import torch

from formcast.engine.constraint_ops import NativeCheck
import gpu_throughput
from formcast.engine import SamplingParams, Tokenizer
from formcast.grammars import JsonSchema, compile
from gpu_throughput import SCHEMA, limit_host_cores, make_engine, prompts


class StepParts:
    """The host's seconds in each engine part of each step, and on CUDA the
    device's idle time before each decode forward: the engine's methods wrapped
    (on this engine instance, for the rest of its life)."""

    # (pipelined steps' parts, then an ordinary step's forward and sampling): the
    # column's name, the engine part that owns the method (a path from the engine;
    # None: not a method), the method
    PARTS = (("_take_begin", "pipeline.taker", "begin"), ("_masks_for", "pipeline.rows", "masks_for"),
             ("_sample_live", "pipeline.rows", "sample"), ("_fast_lane", "pipeline", "fast_lane"),
             ("_launch_inflight", "pipeline", "launch_inflight"),
             ("_launch_ahead", "pipeline", "launch_ahead"),
             ("execute_decode", "runner", "execute_decode"), ("_take_end", "pipeline.taker", "end"),
             ("execute", "runner", "execute"), ("_sample_and_append", "", "_sample"),
             ("_resample", "pipeline.rows", "resample"),
             # (the sampler's: fill_masks counts the mask thread's time too, in its step)
             ("fill_masks", "sampler", "fill_masks"),
             ("sample_on_device", "sampler", "sample_on_device"),
             ("_finish", "output", "finish"), ("gc", None, None), ("verdicts", None, None))
    RUNNER = ("execute_decode", "execute")

    def __init__(self, eng) -> None:
        self.cuda = eng.device.type == "cuda"
        self.step = 0
        self.now: dict[str, float] = collections.defaultdict(float)
        self.marks: list[tuple[str, int, object]] = []  # (kind, step, event)
        for key, path, name in self.PARTS:
            if path is None:
                continue
            owner = eng
            for part in filter(None, path.split(".")):
                owner = getattr(owner, part, None)
            if owner is None:  # (no pipeline: a synchronous engine's steps are ordinary)
                continue
            forward = key in self.RUNNER
            self._wrap(owner, name, before="start" if forward else None,
                       after="end" if forward else None, key=key)
        self._wrap(eng.sampler, "greedy_masked_", after="end", timed=False)
        # (the class's: a step's check is made anew each step. Every engine of the
        # process then counts it, to this instance's figures, while it lives)
        self._wrap(NativeCheck, "result", key="verdicts")
        gc.callbacks.append(self._collected)  # (the garbage collector's passes, any thread)
        self._gc_start = 0.0

    def _collected(self, phase: str, _info) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.now["gc"] += time.perf_counter() - self._gc_start

    def _wrap(self, owner, name: str, before: str | None = None, after: str | None = None,
              timed: bool = True, key: str | None = None) -> None:
        inner = getattr(owner, name, None)
        key = key or name
        if inner is None:  # (a runner without a decode path of its own: its steps are ordinary)
            return

        def wrapper(*args, **kwargs):
            if before:
                self._mark(before)
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if timed:
                    self.now[key] += time.perf_counter() - start
                if after:
                    self._mark(after)

        setattr(owner, name, wrapper)

    def _mark(self, kind: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((kind, self.step, event))

    def idle(self) -> dict[int, float]:
        """Microseconds the device waited before each step's forwards (synchronized)."""
        waited: dict[int, float] = collections.defaultdict(float)
        last = None
        for kind, step, event in self.marks:
            if kind == "start":
                if last is not None:
                    waited[step] += max(0.0, last.elapsed_time(event) * 1e3)
                last = None
            else:
                last = event
        return waited


def series(eng, ps, sp, compiled=None, parts: StepParts | None = None):
    """Seconds of each ``step`` of one run to completion, and the rows masked
    after each (those a constrained row's next pick is sampled under); with
    ``parts``, also each step's seconds by part and the device's idle time
    before each step's forwards (microseconds, by step)."""
    for p in ps:
        eng.add_request(p, sp, constraint=None if compiled is None else compiled.matcher())
    gpu_throughput.sync()
    times, masked, by_part = [], [], []
    if parts is not None:
        parts.marks.clear()
    while eng.has_unfinished_requests():
        if parts is not None:
            parts.step, parts.now = len(times), collections.defaultdict(float)
        start = time.perf_counter()
        eng.step(finished_only=True)
        times.append(time.perf_counter() - start)
        masked.append(sum(1 for s in eng.scheduler.running if s.masked))
        if parts is not None:
            by_part.append(dict(parts.now))
    gpu_throughput.sync()
    if parts is None:
        return times, masked
    return times, masked, by_part, parts.idle()


def print_parts(side: str, run, opening: int) -> None:
    """``series``' part figures of one run (see the module doc)."""
    times, masked, by_part, idle = run
    names = [key for key, _, _ in StepParts.PARTS]
    print(f"    {side} parts: device idle before forwards {sum(idle.values()) / 1e3:.2f} ms")
    top = sorted(idle.items(), key=lambda kv: -kv[1])[:8]
    print("    longest waits (step: us, masked rows after): " + (", ".join(
        f"{k}: {v:.0f} ({masked[k]})" for k, v in sorted(top)) or "none timed (no CUDA)"))
    # (the step before a wait launched what the device waited for)
    around = sorted({j for k, _ in top[:5] for j in (k - 1, k) if 0 <= j < len(by_part)})
    for j in around:
        print(f"      step {j} ({times[j] * 1e6:.0f} us): " + " ".join(
            f"{n.strip('_')}={us * 1e6:.0f}" for n, us in by_part[j].items() if us >= 20e-6))
    print("    " + " " * 30 + " ".join(f"{n.strip('_')[:10]:>10}" for n in names))
    for label, lo, hi in (("opening", 0, opening), ("after", opening, len(times))):
        rows = by_part[lo:hi]
        if rows:
            wait = sum(idle.get(k, 0.0) for k in range(lo, hi)) / 1e3
            print(f"    {label:>7} host us/step ({wait:6.2f} ms idle) " + " ".join(
                f"{statistics.mean(r.get(n, 0.0) for r in rows) * 1e6:>10.0f}" for n in names))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer-dir", required=True)
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--batch-sizes", default="64,256")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=4, help="runs a side, alternating")
    ap.add_argument("--opening", type=int, default=25, help="steps counted as the opening")
    ap.add_argument("--show", type=int, default=28, help="first steps printed one by one")
    ap.add_argument("--tail", type=int, default=6, help="last steps printed one by one")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--host-cores", type=int, default=None,
                    help="run on this many host cores (a slower host)")
    ap.add_argument("--parts", action="store_true",
                    help="where each step's time goes: host parts, device idle (see above)")
    ap.add_argument("--no-jump-forward", action="store_true",
                    help="decode the schema's opening one step each (jump_forward=False)")
    args = ap.parse_args()
    limit_host_cores(args.host_cores)
    gpu_throughput.DEVICE = torch.device(args.device)
    tok = Tokenizer.from_hf_dir(args.tokenizer_dir)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    eng = make_engine(args.shape, tok, max(sizes),
                      **({"jump_forward": False} if args.no_jump_forward else {}))
    parts = StepParts(eng) if args.parts else None
    compiled = compile(JsonSchema(SCHEMA), tok, vocab_size=eng.model.config.vocab_size)
    sp = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    print(f"host time of each engine step, {args.shape}, {args.tokens} tokens a row; "
          f"the fastest of {args.runs} runs a side")
    for bs in sizes:
        ps = prompts(tok, bs)
        series(eng, ps, sp, parts=parts)  # warm-up, both sides
        series(eng, ps, sp, compiled, parts=parts)
        runs = {"free": [], "json": []}
        for _ in range(args.runs):
            runs["free"].append(series(eng, ps, sp, parts=parts))
            runs["json"].append(series(eng, ps, sp, compiled, parts=parts))
        best = {side: min(got, key=lambda r: sum(r[0])) for side, got in runs.items()}
        for side, (times, masked, *_) in best.items():
            k = args.opening
            later = statistics.median(times[k:]) * 1e6 if len(times) > k else float("nan")
            print(f"batch {bs:>4} {side}: total {sum(times) * 1e3:7.1f} ms, first {k} steps "
                  f"{sum(times[:k]) * 1e3:6.1f} ms, median step after them {later:6.0f} us "
                  f"({len(times)} steps)")
            print("    step us/masked: " + " ".join(
                f"{t * 1e6:.0f}/{m}" for t, m in zip(times[:args.show], masked[:args.show])))
            if args.tail:
                print(f"    last {args.tail} steps us/masked: " + " ".join(
                    f"{t * 1e6:.0f}/{m}" for t, m in zip(times[-args.tail:],
                                                         masked[-args.tail:])))
            if parts is not None:
                print_parts(side, best[side], args.opening)
        free, json_ = best["free"][0], best["json"][0]
        k, t = args.opening, args.tail
        last = f", the last {t} {(sum(json_[-t:]) - sum(free[-t:])) * 1e3:.1f} ms" if t else ""
        print(f"batch {bs:>4} json/free tokens/s {sum(free) / sum(json_):.3f}; extra time "
              f"{(sum(json_) - sum(free)) * 1e3:.1f} ms, of which the first {k} steps "
              f"{(sum(json_[:k]) - sum(free[:k])) * 1e3:.1f} ms{last}")


if __name__ == "__main__":
    main()

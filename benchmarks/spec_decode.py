"""Speculative decoding on constrained extraction: tokens/s with and without, same run.

``llm.extract`` over the texts of ``data/extraction_tune.jsonl``, greedy,
at batch 1 (one text at a time) and batch 8 (eight texts per call), with
``spec="none"`` and with ``spec="prompt_lookup"`` (grammar jump-forward + prompt
lookup, drafts validated against the schema before verification). The two sides run
in turn on the same engine; outputs must be identical (greedy), and the script says
so. Reported: output tokens/s (median over repeats), the ratio, and the draft
statistics: acceptance rate, accepted tokens per verification step, and the share
of output tokens the grammar forced.

Usage::

    python benchmarks/spec_decode.py [--limit N] [--repeats 3] [--batch-sizes 1,8]
                                     [--max-draft 8] [--quantization none|auto|int4]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import extraction_quality as eq  # noqa: E402  (same folder: the data and schemas)

TARGET_BS1 = 1.8


def run(llm, groups, batch: int):
    """Extract every text, ``batch`` texts per call; (seconds, completions)."""
    start = time.perf_counter()
    outs = []
    for name, items in groups.items():
        texts = [it.text for it in items]
        for i in range(0, len(texts), batch):
            outs += llm.extract_batch(texts[i:i + batch], eq.SCHEMAS[name],
                                      max_tokens=192, return_completions=True)
    return time.perf_counter() - start, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=None, help="texts per schema")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--max-draft", type=int, default=8)
    ap.add_argument("--quantization", choices=("none", "auto", "int4", "int8"), default="none",
                    help="engine weights: none (float32, the default here), auto, int4, int8")
    args = ap.parse_args()

    import formcast
    from formcast.engine.speculative import SpecConfig
    from formcast.errors import FormcastError

    groups: dict[str, list] = {}
    for it in eq.load_items(eq.DATA):
        groups.setdefault(it.schema, []).append(it)
    if args.limit:
        groups = {k: v[:args.limit] for k, v in groups.items()}
    quant = None if args.quantization == "none" else args.quantization
    llm = formcast.load(enable_prefix_caching=False, quantization=quant)
    engine = llm.engine
    sides = {"plain": SpecConfig(method="none"),
             "spec": SpecConfig(method="prompt_lookup", max_draft=args.max_draft)}
    n_items = sum(map(len, groups.values()))
    print(f"{llm!r}, {n_items} texts, max_draft={args.max_draft}", flush=True)
    for side in sides.values():  # warm-up: grammars compiled, caches filled
        engine.config = dataclasses.replace(engine.config, spec=side)
        run(llm, {k: v[:1] for k, v in groups.items()}, 1)

    rows = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        times = {k: [] for k in sides}
        outs = {}
        for r in range(args.repeats):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            for name in order:
                engine.config = dataclasses.replace(engine.config, spec=sides[name])
                seconds, outs[name] = run(llm, groups, batch)
                times[name].append(seconds)
                print(f"  batch {batch} repeat {r + 1}: {name:5s} {seconds:6.1f} s", flush=True)
        ok = [o for o in outs["spec"] if not isinstance(o, FormcastError)]
        tokens = sum(o.usage.completion_tokens for o in ok)
        identical = sum(
            (a.token_ids if not isinstance(a, FormcastError) else str(a))
            == (b.token_ids if not isinstance(b, FormcastError) else str(b))
            for a, b in zip(outs["spec"], outs["plain"]))
        drafted = sum(o.usage.draft_tokens for o in ok)
        accepted = sum(o.usage.accepted_draft_tokens for o in ok)
        forced = sum(o.usage.forced_tokens for o in ok)
        verify = sum(o.usage.verification_tokens for o in ok)
        t_plain, t_spec = statistics.median(times["plain"]), statistics.median(times["spec"])
        rows.append((batch, tokens / t_plain, tokens / t_spec, t_plain / t_spec, identical,
                     len(outs["spec"]), accepted / drafted if drafted else 0.0,
                     forced / tokens if tokens else 0.0, tokens, verify, accepted))

    print(f"\n{'batch':>5}  {'plain tok/s':>11}  {'spec tok/s':>10}  {'ratio':>6}  "
          f"{'identical':>9}  {'accept rate':>11}  {'forced share':>12}  "
          f"{'tokens/verify pos':>17}")
    for (batch, plain, spec, ratio, ident, n, rate, forced, tokens, verify, acc) in rows:
        target = f" (target {TARGET_BS1}x: {'PASS' if ratio >= TARGET_BS1 else 'FAIL'})" \
            if batch == 1 else ""
        print(f"{batch:>5}  {plain:>11.1f}  {spec:>10.1f}  {ratio:>5.2f}x  {ident:>4}/{n:<4}  "
              f"{100 * rate:>10.1f}%  {100 * forced:>11.1f}%  {tokens / max(verify, 1):>17.2f}"
              f"{target}")
    print("\ntok/s: output tokens / wall time of all extract calls (median of repeats). "
          "accept rate: accepted / drafted tokens. forced share: grammar-forced tokens / "
          "output tokens. identical: outputs equal token for token (greedy).")


if __name__ == "__main__":
    main()

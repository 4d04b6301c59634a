"""Per-token mask cost over the real-world corpus: formcast vs raw xgrammar.

Per token, one matcher's ``fill_bitmask`` (one row) plus ``accept`` of that token is
timed with ``time.perf_counter_ns``, for formcast and for the xgrammar it wraps, on
the same schemas (the whole corpus of real_world_schemas.py, cached in
~/.cache/formcast-bench; an evenly spread part with ``--limit``) and the same token
streams: the valid instances (compact JSON, keys in schema order, SmolLM2's tokens)
that both systems accept. Each stream is run once untimed (warm-up and check), then
``--reps`` timed passes, alternating which system goes first, so that machine noise
hits both. Each pass compiles the schemas afresh: formcast keeps the masks of texts
a grammar has seen, and a stream it saw before would measure that cache, not the
matcher (instances of one schema do share their grammar within a pass, as a
server's requests do). Each system's matcher is made (formcast's readied as the
engine readies a new request's) before its stream's first token is timed. Prints
p50/p90/p99/mean per token and formcast's ratio to raw xgrammar (the target: within
1.3x at p50 and p99). Objects are closed (formcast's default for generation,
xgrammar's strict_mode), with the keys an instance's schema does not declare
dropped, unless ``--open``. ``--profile`` runs one pass of each under cProfile and
prints where formcast's time goes beside xgrammar's.

    .venv/bin/python benchmarks/mask_speed.py [--limit N] [--reps 5] [--open] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from schema_corpus import real_world
from schema_instances import in_schema_order, instances
from token_protocol import CompileFailure, Formcast, RawXGrammar, compact, run_instance, setup


@dataclass(frozen=True)
class Stream:
    """One valid instance's tokens, and its schema."""

    source: str
    schema: Any
    tokens: list[int]


def percentile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def timed_pass(system, compiled: Any, tokens: list[int], bitmask, fill_ns: list[int],
               accept_ns: list[int], total_ns: list[int]) -> None:
    matcher = system.matcher(compiled)
    fill, accept, clock = matcher.fill_row, matcher.accept, time.perf_counter_ns
    for token in tokens:
        t0 = clock()
        fill(bitmask, 0)
        t1 = clock()
        accept(token)
        t2 = clock()
        fill_ns.append(t1 - t0)
        accept_ns.append(t2 - t1)
        total_ns.append(t2 - t0)


def collect(args, s, systems) -> tuple[list[Stream], dict[str, int]]:
    corpus = real_world(args.per_source)
    if args.limit is not None and args.limit < len(corpus):
        corpus = corpus[::len(corpus) // args.limit][:args.limit]
    counts = {"schemas": len(corpus), "compile failed": 0, "no instances": 0,
              "instances rejected by a system": 0}
    streams: list[Stream] = []
    bitmask = s.bitmask()
    for entry in corpus:
        made = instances(entry, n_valid=args.valid, n_invalid=args.invalid,
                         seconds=args.gen_seconds)
        if not made.valid:
            counts["no instances"] += 1
            continue
        try:
            compiled = {sys_.name: sys_.compile(entry.schema) for sys_ in systems}
        except CompileFailure:
            counts["compile failed"] += 1
            continue
        for instance in made.valid:
            tokens = s.exact_tokens(compact(in_schema_order(instance, entry.schema,
                                                            closed=not args.open)))
            if tokens is None:
                continue
            if all(run_instance(x.matcher(compiled[x.name]), tokens, s.eos, bitmask,
                                s.decode).accepted for x in systems):
                streams.append(Stream(entry.source, entry.schema, tokens))
            else:
                counts["instances rejected by a system"] += 1
    return streams, counts


def fresh(s, strict: bool, deadline_s: float, streams: list[Stream]) -> tuple[list, list]:
    """New systems (so no mask a system keeps for texts it saw is reused from an
    earlier pass) and each stream's compiled schema for each."""
    systems = [Formcast(s.tokenizer, strict=strict, deadline_s=deadline_s),
               RawXGrammar(s.vocab, strict=strict, deadline_s=deadline_s)]
    by_schema: dict[int, dict[str, Any]] = {}
    compiled = []
    for stream in streams:
        key = id(stream.schema)
        if key not in by_schema:
            by_schema[key] = {x.name: x.compile(stream.schema) for x in systems}
        compiled.append(by_schema[key])
    return systems, compiled


def profile(systems, compiled: list[dict], streams: list[Stream], bitmask, top: int) -> None:
    n_tokens = sum(len(x.tokens) for x in streams)
    for system in systems:
        profiler = cProfile.Profile()
        sink: list[int] = []
        profiler.enable()
        for stream, grammars in zip(streams, compiled):
            timed_pass(system, grammars[system.name], stream.tokens, bitmask, sink, sink, sink)
        profiler.disable()
        stats = pstats.Stats(profiler).stats
        rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
        print(f"\n-- cProfile, one pass of {system.name}: own time per token (us), "
              f"profiler overhead included --")
        for (path, line, func), (_, calls, own, cumulative, _) in rows:
            where = f"{path.rsplit('/', 2)[-2:][-1] if '/' in path else path}:{line}({func})"
            print(f"  {own / n_tokens * 1e6:8.2f} own {cumulative / n_tokens * 1e6:8.2f} cum "
                  f"{calls / n_tokens:6.2f} calls/token  {where}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--per-source", type=int, default=75, help="as real_world_schemas.py")
    parser.add_argument("--limit", type=int, default=None,
                        help="an evenly spread N schemas (default: the whole corpus)")
    parser.add_argument("--reps", type=int, default=5, help="timed passes over every stream")
    parser.add_argument("--open", action="store_true", help="spec-open objects")
    parser.add_argument("--profile", action="store_true", help="cProfile one pass of each")
    parser.add_argument("--valid", type=int, default=4)
    parser.add_argument("--invalid", type=int, default=4)
    parser.add_argument("--gen-seconds", type=float, default=5.0)
    parser.add_argument("--deadline", type=float, default=10.0)
    args = parser.parse_args()

    s = setup(strict=not args.open, deadline_s=args.deadline, llguidance=False)
    systems = [x for x in s.systems if isinstance(x, (Formcast, RawXGrammar))]
    for note in s.notes:
        print(f"note: {note}")
    streams, counts = collect(args, s, systems)
    n_tokens = sum(len(x.tokens) for x in streams)
    print("note: " + ", ".join(f"{k}: {v}" for k, v in counts.items()))
    print(f"note: {len(streams)} token streams accepted by both, {n_tokens} tokens a pass, "
          f"{args.reps} passes, alternating which system goes first")

    bitmask = s.bitmask()
    times = {x.name: ([], [], []) for x in systems}     # fill, accept, fill + accept
    for rep in range(args.reps):
        # freshly compiled each pass: formcast keeps masks of texts it has seen
        fresh_systems, compiled = fresh(s, not args.open, args.deadline, streams)
        for i, (stream, grammars) in enumerate(zip(streams, compiled)):
            order = fresh_systems if (rep + i) % 2 == 0 else fresh_systems[::-1]
            for system in order:
                timed_pass(system, grammars[system.name], stream.tokens, bitmask,
                           *times[system.name])

    head = (f"{'system (us per token)':<28}{'p50':>8}{'p90':>8}{'p99':>8}{'mean':>8}"
            f"{'fill p50':>10}{'accept p50':>12}")
    print("\n" + head)
    print("-" * len(head))
    for name, (fill, accept, total) in times.items():
        print(f"{name:<28}{percentile(total, .5) / 1e3:>8.2f}{percentile(total, .9) / 1e3:>8.2f}"
              f"{percentile(total, .99) / 1e3:>8.2f}{statistics.fmean(total) / 1e3:>8.2f}"
              f"{percentile(fill, .5) / 1e3:>10.2f}{percentile(accept, .5) / 1e3:>12.2f}")
    fc, xg = (times[x.name][2] for x in systems)
    print(f"\nformcast / raw xgrammar: p50 x{percentile(fc, .5) / percentile(xg, .5):.2f}, "
          f"p90 x{percentile(fc, .9) / percentile(xg, .9):.2f}, "
          f"p99 x{percentile(fc, .99) / percentile(xg, .99):.2f}, "
          f"mean x{statistics.fmean(fc) / statistics.fmean(xg):.2f} (target: <= 1.3 at p50, p99)")

    by_source: dict[str, list[int]] = {}
    for stream in streams:
        by_source.setdefault(stream.source, []).append(len(stream.tokens))
    print("streams by source: " + ", ".join(f"{k} {len(v)} ({sum(v)} tokens)"
                                            for k, v in sorted(by_source.items())))
    if args.profile:
        profile(*fresh(s, not args.open, args.deadline, streams), streams, bitmask, 18)
    return 0


if __name__ == "__main__":
    sys.exit(main())

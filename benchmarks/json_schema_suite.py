"""The official JSON-Schema-Test-Suite through the token-level protocol.

For each group (one schema, several instances) each system compiles the schema for
SmolLM2's tokenizer; each instance, as compact JSON, is tokenized with SmolLM2's
tokenizer and fed token by token: the token's bit must be set in the mask the matcher
fills, the matcher must take it, and after the last token end-of-sequence must be
allowed. A group passes when every valid instance is accepted and every invalid one
rejected. formcast, raw xgrammar (the library formcast wraps) and llguidance (when
installed) run on the same protocol in the same process. The suite is downloaded
from PyPI (the jsonschema sdist vendors it) into ~/.cache/formcast-bench.

    .venv/bin/python benchmarks/json_schema_suite.py [--draft draft2020-12|draft7|all]
        [--limit N] [--verbose] [--strict] [--optional] [--deadline 10]
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from dataclasses import dataclass, field

from schema_corpus import SuiteGroup, suite_groups
from schema_instances import in_schema_order
from token_protocol import CompileFailure, System, compact, run_instance, setup


@dataclass
class Tally:
    """One system's results over one draft."""

    groups: int = 0
    passed: int = 0
    compile_errors: int = 0
    valid_rejected: int = 0          # groups with at least one valid instance rejected
    invalid_accepted: int = 0        # groups with at least one invalid instance accepted
    invalid_instances_accepted: int = 0
    unwritable: int = 0              # instances SmolLM2's tokenizer cannot write, left out
    failures: list[str] = field(default_factory=list)
    by_file: collections.Counter = field(default_factory=collections.Counter)


def run_group(system: System, group: SuiteGroup, ctx, tally: Tally) -> None:
    tally.groups += 1
    where = f"{group.file} / {group.description}"
    try:
        compiled = system.compile(group.schema)
    except CompileFailure as exc:
        tally.compile_errors += 1
        tally.by_file[f"compile error: {group.file}"] += 1
        tally.failures.append(f"[compile error] {where}: {str(exc)[:300]}")
        return
    valid_bad, invalid_ok = [], []
    for description, instance, valid in group.tests:
        text = compact(in_schema_order(instance, group.schema))
        tokens = ctx.exact_tokens(text)
        if tokens is None:
            tally.unwritable += 1
            continue
        try:
            matcher = system.matcher(compiled)
        except Exception as exc:  # a library that cannot make a matcher rejects all
            verdict_ok, reason = False, f"no matcher: {exc}"
        else:
            verdict = run_instance(matcher, tokens, ctx.eos, ctx.bitmask,
                                   ctx.decode)
            verdict_ok, reason = verdict.accepted, verdict.reason
        if valid and not verdict_ok:
            valid_bad.append(f"valid {text[:80]!r} ({description}) rejected: {reason[:200]}")
        elif not valid and verdict_ok:
            invalid_ok.append(f"invalid {text[:80]!r} ({description}) accepted")
    if valid_bad:
        tally.valid_rejected += 1
        tally.by_file[f"valid rejected: {group.file}"] += 1
    if invalid_ok:
        tally.invalid_accepted += 1
        tally.invalid_instances_accepted += len(invalid_ok)
        tally.by_file[f"invalid accepted: {group.file}"] += 1
    if not valid_bad and not invalid_ok:
        tally.passed += 1
        return
    tally.failures.append(f"[{'valid rejected' if valid_bad else 'invalid accepted'}] {where}")
    tally.failures.extend(f"      {line}" for line in valid_bad + invalid_ok)


class _Context:
    def __init__(self, s) -> None:
        self.exact_tokens, self.decode, self.eos = s.exact_tokens, s.decode, s.eos
        self.bitmask = s.bitmask()


def print_table(draft: str, tallies: dict[str, Tally], seconds: dict[str, float]) -> None:
    head = (f"{'system':<28}{'groups':>7}{'passed':>8}{'compile err':>12}"
            f"{'valid rej':>10}{'inval acc':>10}{'inval inst':>11}{'time s':>8}")
    print(f"\n== {draft}: groups (a group may count in both failure columns) ==")
    print(head)
    print("-" * len(head))
    for name, t in tallies.items():
        print(f"{name:<28}{t.groups:>7}{t.passed:>8}{t.compile_errors:>12}"
              f"{t.valid_rejected:>10}{t.invalid_accepted:>10}"
              f"{t.invalid_instances_accepted:>11}{seconds[name]:>8.1f}")
    print("columns: valid rej = groups with a valid instance rejected; inval acc = groups "
          "with an invalid instance accepted; inval inst = invalid instances accepted")
    left_out = next(iter(tallies.values())).unwritable
    print(f"instances' object keys in their schema's order (the order the systems write); "
          f"{left_out} instances left out per system: SmolLM2's tokenizer cannot write them")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--draft", default="all", choices=["draft2020-12", "draft7", "all"])
    parser.add_argument("--limit", type=int, default=None, help="first N groups per draft")
    parser.add_argument("--verbose", action="store_true",
                        help="list each failing group with its reason, per system")
    parser.add_argument("--strict", action="store_true",
                        help="closed objects (formcast's default, xgrammar's strict_mode); "
                             "the suite's language needs open ones, the default here")
    parser.add_argument("--optional", action="store_true", help="also run optional/")
    parser.add_argument("--deadline", type=float, default=10.0, help="compile deadline, s")
    parser.add_argument("--no-llguidance", action="store_true")
    args = parser.parse_args()

    s = setup(strict=args.strict, deadline_s=args.deadline, llguidance=not args.no_llguidance)
    ctx = _Context(s)
    for note in s.notes:
        print(f"note: {note}")
    drafts = ["draft2020-12", "draft7"] if args.draft == "all" else [args.draft]
    for draft in drafts:
        groups, notes = suite_groups(draft, optional=args.optional)
        for note in notes:
            print(f"note: {note}")
        if args.limit is not None:
            groups = groups[:args.limit]
        tallies, seconds = {}, {}
        for system in s.systems:
            tally, start = Tally(), time.perf_counter()
            for group in groups:
                run_group(system, group, ctx, tally)
            tallies[system.name], seconds[system.name] = tally, time.perf_counter() - start
        print_table(draft, tallies, seconds)
        if args.verbose:
            for name, t in tallies.items():
                print(f"\n-- {draft}, {name}: failures by file --")
                for key, n in sorted(t.by_file.items(), key=lambda kv: (-kv[1], kv[0])):
                    print(f"  {n:4d}  {key}")
                print(f"\n-- {draft}, {name}: failing groups --")
                for line in t.failures:
                    print(f"  {line}")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Per-token mask time and compile time: formcast vs raw xgrammar vs raw outlines-core.

All systems get the same SmolLM2 vocabulary (raw token bytes, special tokens
blanked), the same JSON Schemas and the same token streams (valid documents
tokenized by SmolLM2's tokenizer), in the same process. Per token, only the call that
fills one bitmask row is timed; accepting the token is not. Prints p50/p99 per
system and formcast's ratios to the raw library it wraps.

    .venv/bin/python benchmarks/mask_speed.py [--reps 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import outlines_core
import torch
import xgrammar as xgr
from outlines_core.json_schema import build_regex_from_schema

from formcast.engine import load_tokenizer
from formcast.grammars import GrammarCompiler, JsonSchema, Vocabulary

SCHEMAS = {
    "person": ({"type": "object", "additionalProperties": False,
                "required": ["name", "age", "email"],
                "properties": {"name": {"type": "string"},
                               "age": {"type": "integer", "minimum": 0, "maximum": 150},
                               "email": {"type": "string", "format": "email"},
                               "tags": {"type": "array", "items": {"type": "string"},
                                        "maxItems": 5}}},
               ['{"name":"Ada Lovelace","age":36,"email":"ada@example.com","tags":["math"]}',
                '{"name":"Alan","age":41,"email":"alan.t@bletchley.org"}']),
    "order": ({"type": "object", "additionalProperties": False,
               "required": ["id", "items", "status"],
               "properties": {
                   "id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
                   "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
                   "items": {"type": "array", "minItems": 1, "items": {
                       "type": "object", "additionalProperties": False,
                       "required": ["sku", "qty", "price"],
                       "properties": {"sku": {"type": "string"},
                                      "qty": {"type": "integer", "minimum": 1},
                                      "price": {"type": "number", "minimum": 0}}}},
                   "note": {"type": "string"}}},
              ['{"id":"ORD-123456","status":"shipped","items":[{"sku":"A-1","qty":2,'
               '"price":9.99},{"sku":"B-22","qty":1,"price":120}],"note":"leave at door"}']),
    "nested": ({"type": "object", "additionalProperties": False, "required": ["title", "sections"],
                "properties": {"title": {"type": "string"}, "sections": {
                    "type": "array", "items": {
                        "type": "object", "additionalProperties": False,
                        "required": ["heading", "paragraphs"],
                        "properties": {"heading": {"type": "string"},
                                       "paragraphs": {"type": "array",
                                                      "items": {"type": "string"}}}}}}},
               ['{"title":"Report","sections":[{"heading":"Intro","paragraphs":["It began '
                'in spring.","Then it rained."]},{"heading":"End","paragraphs":[]}]}']),
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class RawXGrammar:
    name = "xgrammar (raw)"

    def __init__(self, vocab: Vocabulary) -> None:
        info = xgr.TokenizerInfo(list(vocab.token_bytes), xgr.VocabType.RAW,
                                 vocab_size=vocab.vocab_size,
                                 stop_token_ids=sorted(vocab.eos_token_ids))
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                 separators=(",", ":"))

    @staticmethod
    def stream(compiled, tokens: list[int], bitmask: torch.Tensor, times: list[float]) -> None:
        m = xgr.GrammarMatcher(compiled)
        for t in tokens:
            start = time.perf_counter_ns()
            m.fill_next_token_bitmask(bitmask, 0)
            times.append(time.perf_counter_ns() - start)
            assert m.accept_token(t)


class RawOutlines:
    name = "outlines-core (raw)"

    def __init__(self, vocab: Vocabulary) -> None:
        table: dict[bytes, list[int]] = {}
        for i, b in enumerate(vocab.token_bytes):
            if b:
                table.setdefault(b, []).append(i)
        self.vocab = outlines_core.Vocabulary(min(vocab.eos_token_ids), table)
        self.words = vocab.bitmask_words

    def compile(self, schema: dict):
        return outlines_core.Index(build_regex_from_schema(json.dumps(schema), ""), self.vocab)

    def stream(self, index, tokens: list[int], bitmask: torch.Tensor, times: list[float]) -> None:
        guide = outlines_core.Guide(index)
        ptr = bitmask.data_ptr()
        for t in tokens:
            start = time.perf_counter_ns()
            guide.write_mask_into(ptr, self.words, 4)
            times.append(time.perf_counter_ns() - start)
            guide.advance(t, return_tokens=False)


class Formcast:
    def __init__(self, vocab: Vocabulary, backend: str) -> None:
        self.vocab, self.backend = vocab, backend
        self.name = f"formcast ({backend})"
        self.compiler = GrammarCompiler()
        # Per-vocabulary set-up happens once, as for the raw libraries above.
        self.compiler.compile(JsonSchema({"type": "null"}), vocab, backend=backend)

        self.compiles = 0

    def compile(self, schema: dict):
        # A title no other compile used: a cache miss, so every compile is cold.
        self.compiles += 1
        fresh = {"title": f"benchmark compile {self.compiles}", **schema}
        return self.compiler.compile(JsonSchema(fresh), self.vocab, backend=self.backend)

    @staticmethod
    def stream(compiled, tokens: list[int], bitmask: torch.Tensor, times: list[float]) -> None:
        m = compiled.matcher()
        for t in tokens:
            start = time.perf_counter_ns()
            m.fill_bitmask(bitmask, 0)
            times.append(time.perf_counter_ns() - start)
            assert m.accept(t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=20, help="passes over every token stream")
    parser.add_argument("--compile-reps", type=int, default=3)
    args = parser.parse_args()

    tok = load_tokenizer("smollm2")
    vocab = Vocabulary.from_tokenizer(tok)
    systems = [Formcast(vocab, "xgrammar"), RawXGrammar(vocab), Formcast(vocab, "outlines-core"),
               RawOutlines(vocab)]
    streams = {name: [tok.encode(doc, add_special_tokens=False) for doc in docs]
               for name, (_, docs) in SCHEMAS.items()}
    n_tokens = sum(len(s) for ss in streams.values() for s in ss)
    print(f"SmolLM2 vocabulary ({vocab.vocab_size} ids), {len(SCHEMAS)} schemas, "
          f"{n_tokens} tokens a pass, {args.reps} passes, compact JSON")

    results = {}
    for system in systems:
        compile_ms, mask_ns = [], []
        for name, (schema, _) in SCHEMAS.items():
            for _ in range(args.compile_reps):
                start = time.perf_counter()
                compiled = system.compile(schema)
                compile_ms.append((time.perf_counter() - start) * 1e3)
            bitmask = torch.zeros(1, vocab.bitmask_words, dtype=torch.int32)
            for stream in streams[name]:      # warm-up pass, not timed
                system.stream(compiled, stream, bitmask, [])
            for _ in range(args.reps):
                for stream in streams[name]:
                    system.stream(compiled, stream, bitmask, mask_ns)
        results[system.name] = {"p50": percentile(mask_ns, 0.5) / 1e3,
                                "p99": percentile(mask_ns, 0.99) / 1e3,
                                "mean": statistics.fmean(mask_ns) / 1e3,
                                "compile_ms": statistics.median(compile_ms)}

    print(f"\n{'system':<26}{'p50 us':>9}{'p99 us':>9}{'mean us':>9}{'compile ms':>12}")
    for name, r in results.items():
        print(f"{name:<26}{r['p50']:>9.2f}{r['p99']:>9.2f}{r['mean']:>9.2f}"
              f"{r['compile_ms']:>12.2f}")
    print()
    for ours, raw in (("formcast (xgrammar)", "xgrammar (raw)"),
                      ("formcast (outlines-core)", "outlines-core (raw)")):
        a, b = results[ours], results[raw]
        print(f"{ours} / {raw}: p50 x{a['p50'] / b['p50']:.3f}, p99 x{a['p99'] / b['p99']:.3f}, "
              f"compile x{a['compile_ms'] / b['compile_ms']:.2f}")
    a, b = results["formcast (xgrammar)"], results["outlines-core (raw)"]
    print(f"formcast (xgrammar) / outlines-core (raw): p50 x{a['p50'] / b['p50']:.3f}, "
          f"p99 x{a['p99'] / b['p99']:.3f}, compile x{a['compile_ms'] / b['compile_ms']:.2f}")


if __name__ == "__main__":
    main()

"""Per-token mask cost of grounded extraction against the plain schema mask.

    python benchmarks/grounding_cost.py [--reps 20] [--engine [--batch N] [--device D]]

For a few extraction schemas, texts and answers (SmolLM2's tokenizer), each answer's
tokens are taken one by one by a plain schema matcher and by a grounded one
(``CompiledGrammar.grounded_matcher``, grounding "strict", distinct items), timing
``fill_bitmask`` + ``accept`` of every token. Each repetition makes a fresh grounded
matcher from the text, so its per-text set-up (the text's tables, the first string
mask) is inside the first tokens' times, as in a real request. Prints per-token
p50/p90/p99 in microseconds, the whole answer's mask time (the sum over its tokens
of each token's median over the repetitions: the machine's scheduler preempts a
busy process now and then for a few milliseconds, which one-off sums would count),
the grounded/plain ratio, and the grounded matcher's set-up for a new text; the
tokenizer's one-time index is printed apart.

``--engine`` also generates the cases' answers with SmolLM2 (greedy, ``--batch``
requests in one batch), with plain and with grounded matchers taking turns, and
prints the output tokens per second of each (best of ``--engine-reps``): the real
weights on the CPU, or on a GPU machine the GGUF cannot reach, random weights of
its shape (``--device cuda --tokenizer-dir DIR``, see benchmarks/device_prep.sh).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from formcast.engine import load_tokenizer
from formcast.grammars import JsonSchema, compile, grounding_plan
from formcast.grammars.grounding_text import token_index

PERSON = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "city", "occupation"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "city": {"type": "string"}, "occupation": {"type": "string"}}}
INVOICE = {"type": "object", "additionalProperties": False,
           "required": ["number", "customer", "currency", "total", "lines"],
           "properties": {
               "number": {"type": "string"}, "customer": {"type": "string"},
               "currency": {"enum": ["EUR", "USD", "GBP"]}, "total": {"type": "number"},
               "lines": {"type": "array", "maxItems": 6, "items": {
                   "type": "object", "additionalProperties": False,
                   "required": ["item", "quantity", "price"],
                   "properties": {"item": {"type": "string"}, "quantity": {"type": "integer"},
                                  "price": {"type": "number"}}}}}}
MEETING = {"type": "object", "additionalProperties": False,
           "required": ["title", "date", "location", "attendees", "notes"],
           "properties": {"title": {"type": "string"}, "date": {"type": "string", "format": "date"},
                          "location": {"type": ["string", "null"]},
                          "attendees": {"type": "array", "items": {"type": "string"}},
                          "notes": {"type": "string", "x-grounded": False}}}

_FILLER = (" The rest of the message covers travel, parking at the north entrance, the "
           "lunch order (vegetarian options were asked for twice) and a reminder that the "
           "quarterly figures are due the week after.")
CASES = [
    ("person", PERSON,
     "Meet Anna Berg, a 35-year-old airline pilot who lives in Oslo and flies to Bergen.",
     {"name": "Anna Berg", "age": 35, "city": "Oslo", "occupation": "airline pilot"}),
    ("invoice", INVOICE,
     "Invoice INV-2024-117 for Maria Lopez. 2 x Oak desk at 349.00 EUR, 4 x Desk lamp at "
     "24.50 EUR, 1 x Delivery at 45.00 EUR. Total due: 1,090.00 EUR by 30 April.",
     {"number": "INV-2024-117", "customer": "Maria Lopez", "currency": "EUR", "total": 1090.00,
      "lines": [{"item": "Oak desk", "quantity": 2, "price": 349.00},
                {"item": "Desk lamp", "quantity": 4, "price": 24.50},
                {"item": "Delivery", "quantity": 1, "price": 45.00}]}),
    ("meeting (long text)", MEETING,
     "Subject: Budget review\nHi all, the budget review is on 2026-03-12 in room 4B "
     "(\"Fjord\"). Invited: Tom Reed, Ana Silva, Li Wei and Sara Khan." + _FILLER * 8,
     {"title": "Budget review", "date": "2026-03-12", "location": "room 4B",
      "attendees": ["Tom Reed", "Ana Silva", "Li Wei", "Sara Khan"],
      "notes": "Quarterly figures are due the week after."}),
]


def _answer_ids(tokenizer, answer: dict) -> list[int]:
    text = json.dumps(answer, ensure_ascii=False, separators=(",", ":"))
    # (1090.00 and 349.00 as written in the text, not as Python prints floats)
    for value in ("1090.0", "349.0", "24.5", "45.0"):
        text = text.replace(value, value + "0")
    return tokenizer.encode(text)


def _run(matcher, ids: list[int], bitmask) -> list[float]:
    times = []
    for t in ids:
        start = time.perf_counter()
        matcher.fill_bitmask(bitmask, 0)
        if not matcher.accept(t):
            raise RuntimeError(f"token {t} refused")
        times.append(time.perf_counter() - start)
    return times


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1e6


def _engine(device: str, tokenizer_dir: str | None, batch: int):
    """SmolLM2 on ``device``: its real weights (GGUF, fetched like the tests), or
    random weights of its shape with the tokenizer saved in ``tokenizer_dir`` (for a
    machine the GGUF cannot travel to)."""
    import torch

    from formcast.engine import Engine, EngineConfig, Tokenizer

    if tokenizer_dir is None:
        from formcast.engine.hub import resolve_model

        return Engine.from_pretrained(str(resolve_model("smollm2").path), device=device,
                                      quantization=None)
    from formcast.engine.loading import build_model
    from formcast.engine.models.shapes import SHAPES, random_llama_weights

    shape = SHAPES["smollm2-135m"]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build_model(shape, random_llama_weights(shape, seed=0, head_std=0.5),
                        device=torch.device(device), dtype=dtype)
    return Engine(model, Tokenizer.from_hf_dir(tokenizer_dir),
                  config=EngineConfig(max_num_seqs=max(batch, 8), num_kv_blocks=4096),
                  device=torch.device(device))


def engine_rates(args: argparse.Namespace) -> None:
    """Output tokens/s of the cases in one batch, plain vs grounded matchers."""
    from formcast.engine import SamplingParams

    engine = _engine(args.device, args.tokenizer_dir, args.batch)
    tok = engine.tokenizer
    width = engine.model.config.vocab_size
    cases = [CASES[k % len(CASES)] for k in range(args.batch)]
    prompts, compiled, plans = [], [], []
    for _, schema, text, _ in cases:
        messages = [{"role": "user", "content": "Extract the fields of this text as JSON.\n\n"
                     + text}]
        prompts.append(tok.apply_chat_template(messages, add_generation_prompt=True,
                                               tokenize=True))
        compiled.append(compile(JsonSchema(schema), tok, vocab_size=width))
        plans.append(grounding_plan(schema, "strict"))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    best = {"plain": 0.0, "grounded": 0.0}
    best_cpu = {"plain": 0.0, "grounded": 0.0}
    for rep in range(-1, args.engine_reps):     # (rep -1 warms the engine up, not counted)
        for kind in ("plain", "grounded"):
            if kind == "plain":
                matchers = [c.matcher() for c in compiled]
            else:   # (texts of their own: each request makes its tables)
                matchers = [c.grounded_matcher(f"{text} Ref {k} {'x' * (rep + 1)}.", plan,
                                               distinct_items=True)
                            for k, (c, plan, (_, _, text, _)) in
                            enumerate(zip(compiled, plans, cases))]
            start, cpu = time.perf_counter(), time.process_time()
            outs = engine.generate(prompts, params, constraints=matchers)
            seconds = time.perf_counter() - start
            cpu_seconds = time.process_time() - cpu
            tokens = sum(len(o.token_ids) for o in outs)
            if rep < 0:
                continue
            best[kind] = max(best[kind], tokens / seconds)
            best_cpu[kind] = max(best_cpu[kind], tokens / cpu_seconds)
            print(f"  {kind:<8} {tokens:>6} tokens in {seconds:6.2f} s: "
                  f"{tokens / seconds:8.1f} tokens/s ({tokens / cpu_seconds:8.1f} per "
                  "CPU-second of this process)")
    weights = "random weights" if args.tokenizer_dir else "real weights"
    print(f"engine ({args.device}, SmolLM2 {weights}, batch {args.batch}, best of "
          f"{args.engine_reps}): plain {best['plain']:.1f} tokens/s, grounded "
          f"{best['grounded']:.1f} tokens/s: {best['grounded'] / best['plain']:.2f}x; per "
          f"CPU-second of the process (a shared machine's waits left out): "
          f"{best_cpu['grounded'] / best_cpu['plain']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--engine", action="store_true")
    parser.add_argument("--engine-reps", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokenizer-dir", default=None,
                        help="random weights of SmolLM2's shape, this tokenizer")
    parser.add_argument("--batch", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=160)
    args = parser.parse_args()
    tok = load_tokenizer("smollm2")
    print(f"{'case':<20} {'tokens':>6} | {'plain p50':>9} {'p90':>5} {'p99':>6} | "
          f"{'grounded p50':>12} {'p90':>5} {'p99':>6} | {'plain ms':>8} {'grounded ms':>11} "
          f"{'ratio':>6}")
    for name, schema, text, answer in CASES:
        compiled = compile(JsonSchema(schema), tok)
        start = time.perf_counter()
        token_index(compiled.vocab)
        index_s = time.perf_counter() - start
        plan = grounding_plan(schema, "strict")
        ids = _answer_ids(tok, answer)
        bitmask = compiled.allocate_bitmask(1)
        plain_runs, grounded_runs, setups = [], [], []
        for rep in range(args.reps + 2):
            p = _run(compiled.matcher(), ids, bitmask)
            # (a text of its own each time: no request finds the last one's tables)
            fresh = f"{text} Ref {'x' * rep}."
            start = time.perf_counter()
            matcher = compiled.grounded_matcher(fresh, plan, distinct_items=True)
            made = time.perf_counter() - start
            g = _run(matcher, ids, bitmask)
            if rep >= 2:                       # (the first two warm the grammar's caches)
                plain_runs.append(p)
                grounded_runs.append(g)
                setups.append(made)
        plain_t = [t for run in plain_runs for t in run]
        grounded_t = [t for run in grounded_runs for t in run]
        plain_ms = sum(statistics.median(ts) for ts in zip(*plain_runs)) * 1e3
        grounded_ms = sum(statistics.median(ts) for ts in zip(*grounded_runs)) * 1e3
        print(f"{name:<20} {len(ids):>6} | {_pct(plain_t, .5):>9.0f} {_pct(plain_t, .9):>5.0f} "
              f"{_pct(plain_t, .99):>6.0f} | {_pct(grounded_t, .5):>12.0f} "
              f"{_pct(grounded_t, .9):>5.0f} {_pct(grounded_t, .99):>6.0f} | {plain_ms:>8.2f} "
              f"{grounded_ms:>11.2f} {grounded_ms / plain_ms:>5.1f}x | "
              f"{statistics.median(setups) * 1e3:>9.2f}")
        if index_s > 0.01:
            print(f"  (the tokenizer's index, built once per process: {index_s:.2f} s)")
    print("per-token times in microseconds (fill_bitmask + accept); set-up: making the "
          "grounded matcher for a new text (its tables and first string mask), on the "
          "caller's thread")
    if args.engine:
        engine_rates(args)


if __name__ == "__main__":
    main()

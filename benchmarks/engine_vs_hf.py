"""Decode throughput of the formcast engine against transformers ``generate``.

Same model (SmolLM2-135M-Instruct from the same GGUF), same chat-templated prompts,
same machine and process, greedy decoding of exactly ``--tokens`` tokens per request
(EOS does not stop either side). For every batch size the two sides are measured in
turn, the first to run switching each repeat (ours, HF, HF, ours, ...), so load from
other processes falls on both alike.

Reported per batch size (medians over ``--repeats``):

- end-to-end tok/s: generated tokens / wall time of the whole generate call
  (prefill included); the ratio of these is checked against the targets
  (>= 2x at batch 1, >= 8x aggregate at batch 16).
- decode-only tok/s: ours from request metrics, tokens after the first over the
  window from the first first-token to the last finish; HF estimated as
  ``B * (N - 1) / (t(N tokens) - t(1 token))``.
- agreement: how many requests produced identical tokens, and the mean fraction of
  each output before the first differing token. A speed-up from diverging outputs
  shows up here.

Usage::

    python benchmarks/engine_vs_hf.py [--tokens 128] [--batch-sizes 1,16] [--repeats 3]
                                      [--threads N] [--device cpu|cuda] [--skip-hf]
                                      [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field

import torch

from formcast.engine import Engine, SamplingParams
from formcast.engine.hub import resolve_model

TARGETS = {1: 2.0, 16: 8.0}  # from the issue: speed-up over HF at 1 and 16 concurrent requests
PAD_ID = 2  # SmolLM2's eos, used as HF's pad token (left padding)
NOISY = 1.5  # repeats of one side further apart than this ratio get a warning

# Realistic, varied user turns: short questions, instructions, extraction tasks and
# longer documents, so a batch holds prompts of different lengths.
PROMPTS = [
    "Explain how a hash map handles collisions, in two or three sentences.",
    "What is the capital of Australia?",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Extract the name, age and city as JSON: John Smith is 42 years old and lives in Boston.",
    "Summarize the following: The meeting covered the Q3 roadmap. Engineering will ship the "
    "new billing service in August, after a two-week beta with five customers. Marketing "
    "asked for a launch post and a webinar. Support needs updated docs before the beta "
    "starts, and finance wants a cost estimate for the extra database capacity.",
    "Give me three tips for improving sleep quality.",
    "Translate to French: 'The library opens at nine and closes at six on weekdays.'",
    "List the planets of the solar system in order from the sun.",
    "I have a list of dictionaries with keys 'name' and 'score'. How do I sort it by score "
    "in descending order and then by name alphabetically when scores tie? Show the code "
    "and explain what the key function does.",
    "What does HTTP status code 404 mean?",
    "Write a haiku about autumn rain.",
    "Classify the sentiment of this review as positive, negative or neutral: 'The battery "
    "lasts all day, but the screen scratches far too easily and support never replied.'",
    "Describe the water cycle for a ten-year-old.",
    "Convert this address into JSON with fields street, city, postcode and country: "
    "221B Baker Street, London NW1 6XE, United Kingdom.",
    "Here is an error from my build: 'ModuleNotFoundError: No module named yaml'. The "
    "project uses a virtual environment and I installed everything from requirements.txt. "
    "What are the likely causes and how do I fix each of them?",
    "Name two differences between TCP and UDP.",
]


@dataclass
class Trial:
    """One timed generate call of one side."""

    seconds: float
    tokens: int
    decode_tok_s: float | None = None  # excluding prefill, when it can be told apart

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


@dataclass
class BatchResult:
    batch: int
    ours: list[Trial] = field(default_factory=list)
    hf: list[Trial] = field(default_factory=list)
    identical: int | None = None  # requests whose outputs match token for token
    prefix_agreement: float | None = None  # mean fraction before the first difference

    def median(self, side: str, attr: str) -> float | None:
        vals = [getattr(t, attr) for t in getattr(self, side)]
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else None


# -- the two sides -------------------------------------------------------------------
def run_ours(engine: Engine, prompts: list[list[int]], n: int) -> tuple[Trial, list[list[int]]]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    # decode window: from the earliest first token to the last finish; prefill of a
    # straggler inside that window only makes the figure conservative
    first = min(o.metrics.first_token_time for o in outs)
    last = max(o.metrics.finished_time for o in outs)
    decode = (tokens - len(outs)) / (last - first) if last > first else None
    return Trial(seconds, tokens, decode), [list(o.token_ids) for o in outs]


def left_pad(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)  # [B, S]
    mask = torch.zeros((len(prompts), width), dtype=torch.long)  # [B, S]
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def hf_generate(model, ids: torch.Tensor, mask: torch.Tensor, n: int) -> tuple[float, list[list[int]]]:
    # eos_token_id=None: run all n tokens straight through EOS, as ignore_eos does for
    # ours. (min_new_tokens would instead forbid EOS and change the greedy path.)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, eos_token_id=None, pad_token_id=PAD_ID).cpu()
    seconds = time.perf_counter() - start
    new = out[:, ids.shape[1]:]  # [B, n]
    if new.shape[1] != n:
        raise RuntimeError(f"transformers generated {new.shape[1]} tokens, expected {n}")
    return seconds, new.tolist()


def run_hf(model, prompts: list[list[int]], n: int, device: torch.device
           ) -> tuple[Trial, list[list[int]]]:
    ids, mask = left_pad(prompts, device)
    seconds, tokens = hf_generate(model, ids, mask, n)
    # HF exposes no per-token times: estimate decode by subtracting a 1-token run
    # (prefill + first token) of the same batch
    prefill, _ = hf_generate(model, ids, mask, 1)
    decode = len(prompts) * (n - 1) / (seconds - prefill) if n > 1 and seconds > prefill else None
    return Trial(seconds, len(prompts) * n, decode), tokens


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> tuple[int, float]:
    """Identical outputs, and the mean fraction of each output before the first
    differing token (tokens after a difference follow different contexts)."""
    identical, fractions = 0, []
    for a, b in zip(ours, theirs):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        identical += a == b
        fractions.append(k / max(len(a), len(b)))
    return identical, statistics.mean(fractions)


# -- driver --------------------------------------------------------------------------
def load_hf(device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    path = resolve_model("smollm2").path
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                     dtype=dtype)
    return model.to(device).eval()


def batch_prompts(all_prompts: list[list[int]], batch: int) -> list[list[int]]:
    return [all_prompts[i % len(all_prompts)] for i in range(batch)]


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(results: list[BatchResult], n: int, skip_hf: bool) -> None:
    head = (f"{'batch':>5}  {'formcast tok/s':>14}  {'HF tok/s':>9}  {'ratio':>6}  {'target':>6}  "
            f"{'result':>6}  {'decode: ours':>12}  {'HF est':>7}  {'ratio':>6}  {'identical':>9}  "
            f"{'prefix agree':>12}")
    print(head)
    print("-" * len(head))
    for r in results:
        ours, hf = r.median("ours", "tok_s"), r.median("hf", "tok_s")
        d_ours, d_hf = r.median("ours", "decode_tok_s"), r.median("hf", "decode_tok_s")
        ratio = ours / hf if hf else None
        d_ratio = d_ours / d_hf if d_ours and d_hf else None
        target = TARGETS.get(r.batch)
        verdict = "-" if ratio is None or target is None else ("PASS" if ratio >= target else "FAIL")
        ident = "-" if r.identical is None else f"{r.identical}/{r.batch}"
        agree = "-" if r.prefix_agreement is None else f"{100 * r.prefix_agreement:.1f}%"
        print(f"{r.batch:>5}  {fmt(ours):>14}  {fmt(hf):>9}  {fmt(ratio, '.2f') + 'x':>6}  "
              f"{fmt(target, '.0f') + 'x' if target else '-':>6}  {verdict:>6}  {fmt(d_ours):>12}  "
              f"{fmt(d_hf):>7}  {fmt(d_ratio, '.2f') + 'x':>6}  {ident:>9}  {agree:>12}")
    for r in results:
        for side in ("ours", "hf"):
            rates = [t.tok_s for t in getattr(r, side)]
            if len(rates) > 1 and max(rates) > NOISY * min(rates):
                name = "formcast" if side == "ours" else "HF"
                print(f"NOISY: batch {r.batch} {name} repeats ranged {min(rates):.1f}-"
                      f"{max(rates):.1f} tok/s; the machine was busy, the median may not hold")
    print(f"\ntok/s: aggregate over the batch, {n} tokens per request, median of repeats; "
          "ratio = formcast / HF; result compares the end-to-end ratio with the target.")
    if skip_hf:
        print("HF skipped (--skip-hf): no ratios or agreement.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--batch-sizes", default="1,16", help="comma-separated concurrent requests")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed runs per side and batch size; the median is reported")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--skip-hf", action="store_true", help="measure formcast only")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--quantization", default="none", choices=["none", "int4", "int8"],
                    help="formcast's CPU weight format (HF always runs float weights)")
    args = ap.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    if args.tokens < 2 or args.repeats < 1 or any(b < 1 for b in batch_sizes):
        ap.error("--tokens must be >= 2, --repeats and batch sizes >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    t0 = time.perf_counter()
    # prefix caching off: the same prompts run every repeat, and cache hits from the
    # previous repeat would skip prefill that HF has to redo
    quantization = None if args.quantization == "none" else args.quantization
    engine = Engine.from_pretrained("smollm2", device=args.device, enable_prefix_caching=False,
                                    quantization=quantization)
    hf = None if args.skip_hf else load_hf(device, engine.dtype)
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                    add_generation_prompt=True, tokenize=True)
               for text in PROMPTS]
    lengths = sorted(len(p) for p in prompts)
    print(f"model {engine.name} on {device} ({engine.dtype}, formcast weights: "
          f"{quantization or 'float'}), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    print(f"{len(prompts)} prompts of {lengths[0]}-{lengths[-1]} tokens "
          f"(median {statistics.median(lengths):.0f}); loaded in {time.perf_counter() - t0:.1f}s")

    # warm-up: every batch shape once on both sides (allocators, kernels, caches)
    for b in batch_sizes:
        run_ours(engine, batch_prompts(prompts, b), 8)
        if hf is not None:
            run_hf(hf, batch_prompts(prompts, b), 8, device)

    results = []
    for b in batch_sizes:
        batch = batch_prompts(prompts, b)
        res = BatchResult(b)
        ours_tokens = hf_tokens = None
        for rep in range(args.repeats):
            sides = ["ours", "hf"] if rep % 2 == 0 else ["hf", "ours"]
            for side in sides:
                if side == "ours":
                    trial, ours_tokens = run_ours(engine, batch, args.tokens)
                    res.ours.append(trial)
                elif hf is not None:
                    trial, hf_tokens = run_hf(hf, batch, args.tokens, device)
                    res.hf.append(trial)
                else:
                    continue
                print(f"  batch {b:>2} repeat {rep + 1}: {side:>4} {trial.tok_s:8.1f} tok/s "
                      f"({trial.seconds:.2f}s)", flush=True)
        if hf_tokens is not None:
            res.identical, res.prefix_agreement = agreement(ours_tokens, hf_tokens)
        results.append(res)

    print()
    print_table(results, args.tokens, hf is None)
    print(f"total time {time.perf_counter() - t0:.0f}s")
    if args.json:
        payload = {
            "tokens": args.tokens, "repeats": args.repeats, "device": str(device),
            "dtype": str(engine.dtype), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "targets": TARGETS,
            "results": [{**asdict(r),
                         "ours": [{**asdict(t), "tok_s": t.tok_s} for t in r.ours],
                         "hf": [{**asdict(t), "tok_s": t.tok_s} for t in r.hf],
                         "ours_tok_s": r.median("ours", "tok_s"),
                         "hf_tok_s": r.median("hf", "tok_s"),
                         "ours_decode_tok_s": r.median("ours", "decode_tok_s"),
                         "hf_decode_tok_s": r.median("hf", "decode_tok_s")} for r in results],
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

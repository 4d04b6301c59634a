"""Batch-invariant mode on CUDA (bfloat16): is it invariant, and what does it cost.

1. The harness: ``--requests`` requests (mixed prompt lengths, two shared
   prefixes, greedy and seeded, ``logprobs=0``) on random weights of ``--shape``,
   run alone, then in each arrangement (all together; random batches; staggered
   arrivals; every prefill chunked at 16, 64 and 256 tokens a step; a KV budget
   that forces preemption; prompt lookup speculation; prefix-cache hits; and the
   first ``--beside`` requests each in one batch of 64 with 63 long neighbours),
   with ``EngineConfig(batch_invariant=True)``. Prints per arrangement how many
   requests' token ids or logprobs differ bit for bit from alone (0 is the goal),
   and the same for the mode off as a control: there differences must show, or
   the harness could not tell the mode from its absence. The head's weights are
   drawn small (``--head-std``) so next-token distributions are flat: logprobs
   are not all 0.0 and greedy picks are close calls that a rounding can flip.
2. The cost: tokens/s with the mode on and off at each of ``--batch-sizes``
   (``gpu_throughput.py``'s part 4: free text, greedy, same weights, sides
   alternating) and the ratio (target: at least 0.85).

    python benchmarks/batch_invariance_cuda.py --tokenizer-dir DIR [--shape smollm2-135m]
"""

from __future__ import annotations

import argparse
import json
import random

import torch

import gpu_throughput as bench
from formcast.engine import Engine, EngineConfig, SamplingParams, Tokenizer
from formcast.engine.models.shapes import SHAPES
from formcast.engine.speculative import SpecConfig

LOOKUP = SpecConfig(method="prompt_lookup", scheduled=False, min_confidence=0.0)


def requests_for(n: int, vocab: int, seed: int = 7) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, vocab) for _ in range(48)] for _ in range(2)]
    out = []
    for i in range(n):
        body = [rng.randrange(100, vocab) for _ in range(rng.randrange(2, 200))]
        if i % 4 == 1:
            body += body[:rng.randrange(1, len(body) + 1)]  # an n-gram for prompt lookup
        prompt = prefixes[i % 2] + body if i % 3 else body
        greedy = i % 2 == 0
        out.append((prompt, SamplingParams(
            max_tokens=rng.randrange(4, 24), ignore_eos=True, logprobs=0,
            temperature=0.0 if greedy else 0.8, top_p=0.9 if i % 8 == 1 else 1.0,
            seed=None if greedy else 1000 + i)))
    return out


def neighbours(n: int, vocab: int, seed: int = 9) -> list[list[int]]:
    """``n`` long prompts (300 to 1000 tokens) to run beside a request."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randrange(300, 1000))]
            for _ in range(n)]


def result(outs) -> list[tuple]:
    return [(tuple(o.token_ids), tuple(lp.logprob for lp in o.logprobs)) for o in outs]


def engine(model, tok, invariant: bool, **config) -> Engine:
    config.setdefault("spec", "none")
    config.setdefault("num_kv_blocks", 4096)
    return Engine(model, tok, config=EngineConfig(batch_invariant=invariant, **config),
                  device=torch.device("cuda"))


def run_alone(model, tok, reqs, inv):
    eng = engine(model, tok, inv, enable_prefix_caching=False)
    return [eng.generate([p], sp)[0] for p, sp in reqs]


def run_together(model, tok, reqs, inv):
    order = list(range(len(reqs)))
    random.Random(1).shuffle(order)
    eng = engine(model, tok, inv, max_num_seqs=len(reqs))
    outs = eng.generate([reqs[i][0] for i in order], [reqs[i][1] for i in order])
    res = [None] * len(reqs)
    for i, o in zip(order, outs):
        res[i] = o
    return res


def run_batches(model, tok, reqs, inv, **config):
    rng = random.Random(2)
    eng = engine(model, tok, inv, **config)
    res, i = [], 0
    while i < len(reqs):
        size = rng.randrange(1, 40)
        res += eng.generate([p for p, _ in reqs[i:i + size]], [sp for _, sp in reqs[i:i + size]])
        i += size
    return res


def run_staggered(model, tok, reqs, inv, **config):
    rng = random.Random(3)
    eng = engine(model, tok, inv, **config)
    pending, ids, done = list(enumerate(reqs)), {}, {}
    while pending or eng.has_unfinished_requests():
        for _ in range(min(len(pending), rng.randrange(0, 6))):
            i, (p, sp) = pending.pop(0)
            ids[eng.add_request(p, sp)] = i
        for out in eng.step():
            if out.finished:
                done[ids[out.request_id]] = out
    return [done[i] for i in range(len(reqs))]


def run_cached(model, tok, reqs, inv):
    """All together once (prefix caching on), then each again: its prompt's full
    blocks come from the cache the batched run wrote."""
    eng = engine(model, tok, inv, max_num_seqs=len(reqs))
    eng.generate([p for p, _ in reqs], [sp for _, sp in reqs])
    return [eng.generate([p], sp)[0] for p, sp in reqs]


def run_beside(model, tok, reqs, inv, count: int):
    """Each of the first ``count`` requests in one batch of 64 with 63 long
    neighbours (their prefill shares its step, their contexts its decode steps);
    the rest alone."""
    cfg_vocab = min(model.config.vocab_size, tok.vocab_size)
    others = neighbours(63, cfg_vocab)
    eng = engine(model, tok, inv, max_num_seqs=64, max_num_batched_tokens=16384,
                 enable_prefix_caching=False)
    busy = SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.0)
    res = []
    for i, (p, sp) in enumerate(reqs):
        if i < count:
            res.append(eng.generate([p] + others, [sp] + [busy] * len(others))[0])
        else:
            res.append(eng.generate([p], sp)[0])
    return res


ARRANGEMENTS = {
    "together": run_together,
    "random batches": run_batches,
    "staggered arrivals": lambda m, t, r, inv: run_staggered(m, t, r, inv, max_num_seqs=32),
    "prefill chunked at 16": lambda m, t, r, inv: run_staggered(
        m, t, r, inv, max_num_batched_tokens=16, enable_prefix_caching=False),
    "prefill chunked at 64": lambda m, t, r, inv: run_staggered(
        m, t, r, inv, max_num_batched_tokens=64, enable_prefix_caching=False),
    "prefill chunked at 256": lambda m, t, r, inv: run_batches(
        m, t, r, inv, max_num_batched_tokens=256, enable_prefix_caching=False),
    "tiny KV budget (preemption)": lambda m, t, r, inv: run_staggered(
        m, t, r, inv, num_kv_blocks=64, max_num_seqs=64, enable_prefix_caching=False),
    "prompt-lookup speculation": lambda m, t, r, inv: run_batches(m, t, r, inv, spec=LOOKUP),
    "prefix-cache hits": run_cached,
}


def harness(shape: str, tok: Tokenizer, n: int, head_std: float, beside: int) -> dict:
    cfg = SHAPES[shape]
    reqs = requests_for(n, min(cfg.vocab_size, tok.vocab_size))
    report = {}
    arrangements = dict(ARRANGEMENTS)
    if beside:
        arrangements[f"beside 63 long neighbours ({beside})"] = \
            lambda m, t, r, inv: run_beside(m, t, r, inv, beside)
    for inv in (True, False):
        model = bench.build_model(cfg, bench.random_llama_weights(cfg, seed=0, head_std=head_std),
                                  device=torch.device("cuda"), dtype=torch.bfloat16)
        alone = result(run_alone(model, tok, reqs, inv))
        label = "on" if inv else "off (control)"
        lps = [lp for _, lps in alone for lp in lps]
        print(f"\n[1] harness, batch_invariant {label}: {n} requests, shape={shape}, "
              f"head_std={head_std}: mean logprob {sum(lps) / max(len(lps), 1):.3f}, "
              f"{sum(lp == 0.0 for lp in lps)} of {len(lps)} exactly 0", flush=True)
        for name, arrange in arrangements.items():
            try:
                got = result(arrange(model, tok, reqs, inv))
            except Exception as exc:  # (a failed arrangement is a finding, not the end)
                print(f"  {name:30s} FAILED: {type(exc).__name__}: {exc}", flush=True)
                report[f"{label}/{name}"] = "failed"
                continue
            tokens = sum(g[0] != a[0] for g, a in zip(got, alone))
            logprobs = sum(g[1] != a[1] for g, a in zip(got, alone))
            print(f"  {name:30s} requests differing: tokens {tokens:3d}, logprobs {logprobs:3d}",
                  flush=True)
            report[f"{label}/{name}"] = [tokens, logprobs]
        del model
        torch.cuda.empty_cache()
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer-dir", required=True)
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--head-std", type=float, default=0.05,
                    help="std of the embedding/head weights (small: flat distributions)")
    ap.add_argument("--beside", type=int, default=8,
                    help="requests run each beside 63 long neighbours (0: none)")
    ap.add_argument("--batch-sizes", default="64,256")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--skip", default="", help="comma list of: harness, cost")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    tok = Tokenizer.from_hf_dir(args.tokenizer_dir)
    print(f"device={torch.cuda.get_device_name()} torch={torch.__version__}")
    report = {}
    if "harness" not in skip:
        report["harness"] = harness(args.shape, tok, args.requests, args.head_std, args.beside)
    if "cost" not in skip:
        bench.part_invariant(args.shape, tok, [int(b) for b in args.batch_sizes.split(",")],
                             args.tokens, {})
    print(json.dumps(report))


if __name__ == "__main__":
    main()

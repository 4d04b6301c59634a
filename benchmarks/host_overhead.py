"""The host's share of a pipelined decode step, measured on any machine.

On the GPU, a decode step of a small model at a large batch is as fast as the
host can schedule it: launching the step, taking the last step's tokens,
checking constrained rows' picks in their grammars, filling masks, detokenizing.
This script measures that host work alone, on the CPU, with the forward taken
out: the engine runs ``gpu_throughput.py``'s part 2 workload (free text, and
every row under its JSON Schema) through its asynchronous scheduling, while the
model runner's decode step stages its inputs as the CUDA graph path does and
returns rows of a fixed pool of random logits (their argmax as the graph's
greedy picks). The masked-argmax kernel, one launch on the GPU, is timed and
left out of the figures.

Prints microseconds per pipelined step, free and JSON, and how many picks the
grammars took and refused. The random logits make a random model, as the GPU
benchmark's random weights do: most picks inside strings are taken, picks where
the schema forces punctuation are refused.

    python benchmarks/host_overhead.py --tokenizer-dir DIR [--batch-sizes 64,256] [--picks mixed]
    python benchmarks/host_overhead.py --tokenizer-dir DIR --picks mixed --closing 2000 \
        --tuning premask_after=2     # B: premasking off

On our CPU (256 rows, --closing 2000, 6 runs a side) premasking took the
refused picks of a JSON run from 63 to 1 and its steps from 130 to 128; the
host's time a run went from 157.8 to 154.0 ms (at 64 rows 83.8 to 78.0 ms),
inside the spread: on a 2-core host the JSON runs' time varies by +-20% from
run to run, and an A/A comparison (B the same code) read 0.84-0.91 with 8 runs
a side. Counts (picks, refusals, steps) are what it tells for sure there.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time
import types

import torch

from formcast.engine import Engine, EngineConfig, SamplingParams, Tokenizer
from formcast.engine.cuda_graph import DecodeStaging
from formcast.engine.loading import build_model
from formcast.engine.models.shapes import SHAPES, random_llama_weights
from formcast.engine.tuning import EngineTuning
from formcast.grammars import JsonSchema, compile
from gpu_throughput import SCHEMA, prompts

POOL = 2048  # rows of random logits the stub hands out
CLOSING = 112  # "mixed" picks: one row in this many closes a string


def stub_engine(tok: Tokenizer, max_batch: int, picks: str = "random", closing: int = CLOSING,
                tuning: EngineTuning | None = None) -> tuple[Engine, list[float]]:
    """An engine on a one-layer model of SmolLM2's vocabulary whose decode steps
    are stubbed out (see the module doc). Returns it and the seconds its
    masked-argmax calls took, a list of one, reset by the caller."""
    cfg = dataclasses.replace(SHAPES["smollm2-135m"], num_hidden_layers=1, hidden_size=32,
                              intermediate_size=32, num_attention_heads=1,
                              num_key_value_heads=1, head_dim=32)
    model = build_model(cfg, random_llama_weights(cfg, seed=0), device=torch.device("cpu"),
                        dtype=torch.float32)
    eng = Engine(model, tok, config=EngineConfig(
        max_num_seqs=max_batch, num_kv_blocks=8192, max_num_batched_tokens=16384,
        async_scheduling=True, spec="none", freeze_gc=True,
        native_accept=True, tuning=tuning or EngineTuning()), device=torch.device("cpu"))  # (as on CUDA: the native worker)
    eng.sampler.batch_fill = True  # (masks filled as on CUDA: the grammar's batch hooks)
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(POOL, cfg.vocab_size, generator=gen)
    pool[:, tok.vocab_size:] = float("-inf")
    texts = [tok.decode([i]) for i in range(tok.vocab_size)] if picks != "random" else []
    if picks == "uniform":  # rows alike but for their argmax: they keep in step
        pool[:] = pool[0].clone()
    if picks != "random":  # each row's argmax a word, which a JSON string takes
        words = torch.tensor([i for i, t in enumerate(texts) if t.strip().isalpha()])
        pool[torch.arange(POOL), words[torch.randint(len(words), (POOL,), generator=gen)]] = 10.0
    if picks == "mixed":  # and 1 row in ``closing`` a token that ends the string
        quotes = torch.tensor([i for i, t in enumerate(texts) if t in ('"', '",', '"}', '"]')])
        rows = torch.arange(0, POOL, closing)
        pool[rows, quotes[torch.randint(len(quotes), (len(rows),), generator=gen)]] = 20.0
    greedy = torch.stack((pool.argmax(-1), torch.zeros(POOL, dtype=torch.long)))
    staging = DecodeStaging(max_batch, 1024, block_size=eng.config.block_size, scratch_slot=0,
                            pin=False)
    state = {"at": 0}

    def execute_decode(runner, seqs, tokens, staged=False):
        runner._replayed = True
        if not staged:
            staging.stage_seqs(seqs, len(seqs))
        staging.upload(len(seqs))  # (what the replay copies)
        staging.host[:len(seqs)].copy_(tokens)
        at = state["at"] = (state["at"] * 1103515245 + 12345) % (POOL - len(seqs))
        return pool[at:at + len(seqs)]

    def greedy_samples(runner, n):  # (as the runner's: only after a stubbed decode step)
        return greedy[:, state["at"]:state["at"] + n] if runner._replayed else None

    def stage_decode_ahead(runner, seqs):
        staging.stage_seqs(seqs, len(seqs), ahead=1)
        return True

    execute = eng.runner.execute

    def execute_invalidating(*args, **kwargs):  # (as an ordinary step does the graphs')
        staging.invalidate()
        return execute(*args, **kwargs)

    eng.runner.execute = execute_invalidating
    eng.runner.forget_rows = staging.invalidate  # (as the graphs' staging)
    eng.runner.execute_decode = types.MethodType(execute_decode, eng.runner)
    eng.runner.stage_decode_ahead = types.MethodType(stage_decode_ahead, eng.runner)
    eng.runner.greedy_samples = types.MethodType(greedy_samples, eng.runner)
    masked_secs = [0.0]
    greedy_masked = eng.sampler.greedy_masked_

    def timed_greedy_masked(*args, **kwargs):
        t = time.perf_counter()
        try:
            return greedy_masked(*args, **kwargs)
        finally:
            masked_secs[0] += time.perf_counter() - t

    eng.sampler.greedy_masked_ = timed_greedy_masked
    return eng, masked_secs


def host_us_per_step(eng: Engine, masked_secs: list[float], ps, sp, constraints
                     ) -> tuple[float, int, int, int]:
    """Microseconds of host work per pipelined step of one run to completion,
    the picks taken unmasked and refused, and the pipelined steps."""
    for p, c in zip(ps, constraints or [None] * len(ps)):
        eng.add_request(p, sp, constraint=c)
    eng.step()  # prefill
    eng.step()  # the first pipelined step launches, takes nothing yet
    stats = eng.stats
    steps, picks, refused = (stats.num_pipelined_steps, stats.num_unmasked_picks,
                             stats.num_refused_picks)
    masked_secs[0] = 0.0
    t = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step(finished_only=True)
    secs = time.perf_counter() - t - masked_secs[0]
    steps = stats.num_pipelined_steps - steps
    return (secs / max(steps, 1) * 1e6, stats.num_unmasked_picks - picks,
            stats.num_refused_picks - refused, steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer-dir", required=True)
    ap.add_argument("--batch-sizes", default="64,256")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5, help="runs of each side, alternating")
    ap.add_argument("--picks", choices=("random", "words", "mixed", "uniform"),
                    default="random",
                    help="random: the pool's argmax anywhere in the vocabulary; words: "
                    "a word's token, as the GPU benchmark's random weights mostly pick "
                    "(rows stay in a JSON string after its opening punctuation); mixed: "
                    "words, and a string's closing quote in one pool row in "
                    f"{CLOSING}, so rows keep leaving their strings for the schema's "
                    "punctuation, where picks are refused (~250 refusals a run at 256 "
                    "rows; see --closing); uniform: words, "
                    "the pool's rows otherwise alike, so that every row picks the "
                    "schema's opening the same way and they reach the string together, "
                    "as the GPU benchmark's rows do (its masked opening, then every row "
                    "unmasked at once)")
    ap.add_argument("--closing", type=int, default=CLOSING,
                    help="mixed picks: one pool row in this many closes a string (at 256 "
                    "rows the default made ~250 refusals a run, 1000 ~85, 2000 ~50; the GPU "
                    "benchmark's runs have had 14-18 of late)")
    ap.add_argument("--tuning", dest="tunings", action="append", default=[],
                    metavar="NAME=LITERAL",
                    help="a side B, as engine_ab.py's --tuning: the runs alternate A and B "
                    "(the order flipped each round) and a line for each side is printed, "
                    "then B's JSON host time a run over A's")
    args = ap.parse_args()
    if args.closing < 1:
        ap.error(f"--closing {args.closing}: must be at least 1")
    torch.set_num_threads(1)
    tok = Tokenizer.from_hf_dir(args.tokenizer_dir)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    eng, masked_secs = stub_engine(tok, max(sizes), args.picks, args.closing)
    engines = {"": (eng, masked_secs), "A": (eng, masked_secs)}
    if args.tunings:
        try:
            tuning = EngineTuning.parse(args.tunings)
        except ValueError as exc:
            ap.error(str(exc))
        engines["B"] = stub_engine(tok, max(sizes), args.picks, args.closing, tuning)
    compiled = compile(JsonSchema(SCHEMA), tok, vocab_size=eng.model.config.vocab_size)
    sp = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    sides = ("A", "B") if args.tunings else ("",)
    print(f"host us per pipelined step (median of {args.reps}, forward stubbed), "
          f"{args.tokens} tokens a row; json ms: the host's time a JSON run")
    print(f"{'batch':>5} {'free':>7} {'json':>7} {'json/free':>9} {'picks':>7} {'refused':>7} "
          f"{'steps':>5} {'json ms':>8}")
    for bs in sizes:
        ps = prompts(tok, bs)
        for side in sides:
            host_us_per_step(*engines[side], ps, sp, None)  # warm-up
        runs: dict[str, list] = {side: [] for side in sides}
        for rep in range(args.reps):
            for side in sides if rep % 2 == 0 else sides[::-1]:
                free = host_us_per_step(*engines[side], ps, sp, None)[0]
                json_ = host_us_per_step(*engines[side], ps, sp,
                                         [compiled.matcher() for _ in ps])
                runs[side].append((free, *json_))
        ms = {}
        for side in sides:
            got = runs[side]
            f = statistics.median(r[0] for r in got)
            j = statistics.median(r[1] for r in got)
            ms[side] = statistics.median(r[1] * r[4] / 1e3 for r in got)
            _, _, picks, refused, steps = got[-1]
            label = f"{bs} {side}".strip()
            print(f"{label:>5} {f:>7.0f} {j:>7.0f} {j / f:>9.2f} {picks:>7} {refused:>7} "
                  f"{steps:>5} {ms[side]:>8.1f}", flush=True)
        if args.tunings:
            print(f"{bs:>5} B/A json ms {ms['B'] / ms['A']:.3f}", flush=True)
    gc.unfreeze()  # (the engine froze the heap: let it go at exit)


if __name__ == "__main__":
    main()

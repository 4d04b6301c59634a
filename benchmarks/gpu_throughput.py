"""GPU decode throughput on random weights of real shapes, three measurements in one run.

1. formcast vs transformers ``generate`` (same weights, same prompts, greedy,
   bfloat16) at each batch size: tokens/s and their ratio.
2. Constrained vs unconstrained on the same engine: every row under a JSON Schema
   (a list of records that cannot close before the token budget) against free
   text, at each batch size: tokens/s and the ratio, with the engine's default
   (greedy rows pick unmasked and the grammar checks the pick) and with a mask
   filled for every row at every step (``unmasked_greedy=False``).
3. The batch-1 decode step of a larger shape against its bytes-moved bound:
   (weight bytes + KV bytes read) / the copy bandwidth measured on this device.

4. With ``--batch-invariant``: what batch-invariant mode costs, tokens/s with
   ``EngineConfig(batch_invariant=True)`` and without (an engine of each over the
   same random weights, the sides alternating) at each of ``--invariant-batch-sizes``,
   and the ratio on/off.

``--shape`` takes a Llama shape (``smollm2-135m``, ``llama-1b``) or a DeepSeek-V4
one (``deepseek-v4-small``; parts 1 and 2): random weights either way, the same
tensors on both sides (transformers' DeepSeek-V4 where the installed transformers
has it). ``--device cpu`` with ``--shape deepseek-v4-tiny`` is a smoke run.

    python benchmarks/gpu_throughput.py --tokenizer-dir DIR [--shape S] [--skip hf,constrained,bound]

A variant's figures: ``--tuning FIELD=LITERAL`` (an EngineTuning field) and
``--config FIELD=LITERAL`` (an EngineConfig field), repeatable, for every engine
built; ``benchmarks/engine_ab.py`` puts a variant beside the defaults in one run.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import os
import pstats
import statistics
import time

import torch

from formcast.engine import Engine, EngineConfig, SamplingParams, Tokenizer
from formcast.engine.config import DeepseekV4Config
from formcast.engine.tuning import EngineTuning
try:
    from formcast.engine.loading import build_model
except ImportError:  # (a commit before the engine's split, run for an old-vs-new comparison)
    from formcast.engine.engine import build_model
from formcast.engine.models.shapes import (DEEPSEEK_V4_SHAPES, SHAPES, random_deepseek_v4_weights,
                                           random_llama_weights)

DEVICE = torch.device("cuda")


def limit_host_cores(n: int | None) -> None:
    """Pin this process (and the threads it starts) to its first ``n`` allowed cores."""
    if n is None:
        return
    allowed = sorted(os.sched_getaffinity(0))
    if not 0 < n <= len(allowed):
        raise SystemExit(f"--host-cores {n}: this process may use {len(allowed)} cores")
    os.sched_setaffinity(0, allowed[:n])
    print(f"host cores: {allowed[:n]}")


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()

# records that cannot close before the token budget runs out: every row stays
# constrained for the whole run. (Strings with maxLength are left out: xgrammar
# fills such a string's mask in milliseconds rather than microseconds, a cost of
# the grammar backend that this benchmark of the engine does not measure.)
SCHEMA = {"type": "object", "required": ["records"], "properties": {"records": {
    "type": "array", "minItems": 200, "items": {
        "type": "object", "required": ["name", "city", "age"], "additionalProperties": False,
        "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120}}}}}}


def hf_model(shape: str, weights: dict[str, torch.Tensor], dtype: torch.dtype):
    """transformers' model of ``shape`` holding ``weights``; None (with the reason
    printed) when the installed transformers has no such architecture."""
    if shape in DEEPSEEK_V4_SHAPES:
        try:
            from transformers import DeepseekV4Config as HFDeepseekConfig
            from transformers import DeepseekV4ForCausalLM
        except ImportError:
            import transformers

            print(f"transformers {transformers.__version__} has no DeepSeek-V4: "
                  "formcast's side only")
            return None
        model = DeepseekV4ForCausalLM(HFDeepseekConfig(**DEEPSEEK_V4_SHAPES[shape]))
        model.load_state_dict(weights, strict=True)
        return model.to(DEVICE, dtype).eval()
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    c = SHAPES[shape]
    cfg = HFConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                   intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
                   num_attention_heads=c.num_attention_heads,
                   num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                   rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
                   max_position_embeddings=c.max_position_embeddings,
                   tie_word_embeddings=c.tie_word_embeddings)
    model = LlamaForCausalLM(cfg)
    model.load_state_dict(weights, strict=False)
    return model.to(DEVICE, dtype).eval()


def config_changes(specs: list[str]) -> dict:
    """The EngineConfig fields that ``field=literal`` specs replace.

    Raises
    ------
    ValueError
        An unknown field, or a value that is not a Python literal.
    """
    import ast

    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    changes = {}
    for spec in specs:
        name, _, value = spec.partition("=")
        if name not in fields:
            raise ValueError(f"--config {spec!r}: EngineConfig has no field {name!r}")
        try:
            changes[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise ValueError(f"--config {spec!r}: the value is not a Python literal") from None
    return changes


def replayable_graph(eng, rows: int, context: int):
    """The CUDA graph that decodes ``rows`` sequences of ``context`` cached tokens,
    run once through the engine's graph runner (captured, inputs staged) so that
    ``replay()`` times a decode step alone."""
    g = eng.runner.graphs
    nb = context // 16 + 1
    tables = [[(i * nb + j) % 4000 for j in range(nb)] for i in range(rows)]
    g.run([5] * rows, [context] * rows, [t[-1] * 16 + context % 16 for t in tables], tables,
          [context + 1] * rows)
    torch.cuda.synchronize()
    return g._graphs[g.size_for(rows)][0]  # (each size is captured twice; one copy)


def make_engine(shape: str, tok: Tokenizer, max_batch: int, **config) -> Engine:
    if shape in DEEPSEEK_V4_SHAPES:
        model_config = DeepseekV4Config.from_dict(DEEPSEEK_V4_SHAPES[shape])
        weights = random_deepseek_v4_weights(DEEPSEEK_V4_SHAPES[shape], seed=0)
    else:
        model_config = SHAPES[shape]
        weights = random_llama_weights(model_config, seed=0, head_std=0.5)
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    model = build_model(model_config, weights, device=DEVICE, dtype=dtype)
    eng = Engine(model, tok, config=EngineConfig(max_num_seqs=max_batch, num_kv_blocks=8192,
                                                 max_num_batched_tokens=16384, **config),
                 device=DEVICE)
    eng.weights = weights  # for the transformers side
    return eng


def prompts(tok: Tokenizer, n: int) -> list[list[int]]:
    return [tok.encode(f"Request number {i}: list the people in the weather report.")
            for i in range(n)]


def timed_outputs(eng: Engine, ps, sp, constraints=None) -> tuple[float, list]:
    """Seconds and outputs of one ``generate`` (after a short warm-up)."""
    eng.generate(ps, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                 constraints=None if constraints is None else constraints())
    sync()
    t = time.perf_counter()
    outs = eng.generate(ps, sp, constraints=None if constraints is None else constraints())
    sync()
    return time.perf_counter() - t, outs


def timed_generate(eng: Engine, ps, sp, constraints=None) -> tuple[float, int]:
    """Seconds and generated tokens of one ``generate`` (after a short warm-up)."""
    secs, outs = timed_outputs(eng, ps, sp, constraints)
    return secs, sum(len(o.token_ids) for o in outs)


def hf_tokens_per_s(hf, ps, n: int) -> float:
    width = max(len(p) for p in ps)
    ids = torch.tensor([[2] * (width - len(p)) + p for p in ps], device=DEVICE)
    mask = (torch.arange(width, device=DEVICE) >= torch.tensor(
        [width - len(p) for p in ps], device=DEVICE).unsqueeze(1)).long()
    with torch.no_grad():
        hf.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=2)
        sync()
        t = time.perf_counter()
        hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                    do_sample=False, pad_token_id=2)
        sync()
    return len(ps) * n / (time.perf_counter() - t)


def part_hf(eng: Engine, tok: Tokenizer, shape: str, sizes: list[int], n: int) -> None:
    dtype = eng.dtype
    print(f"\n[1] decode vs transformers generate: shape={shape} {dtype} greedy, {n} tokens a row")
    hf = hf_model(shape, eng.weights, dtype)
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    print(f"{'batch':>5} {'formcast tok/s':>15} {'hf tok/s':>10} {'ratio':>8}")
    for bs in sizes:
        ps = prompts(tok, bs)
        ours = theirs = 0.0
        for _ in range(3):  # best of three, sides alternating: the host is noisy
            secs, count = timed_generate(eng, ps, sp)
            ours = max(ours, count / secs)
            if hf is not None:
                theirs = max(theirs, hf_tokens_per_s(hf, ps, n))
        ratio = f"{ours / theirs:>7.2f}x" if theirs else "      -"
        print(f"{bs:>5} {ours:>15.0f} {theirs:>10.0f} {ratio}", flush=True)
    del hf
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()


def part_constrained(eng: Engine, tok: Tokenizer, sizes: list[int], n: int,
                     profile: bool) -> None:
    from formcast.grammars import JsonSchema, compile

    compiled = compile(JsonSchema(SCHEMA), tok, vocab_size=eng.model.config.vocab_size)
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    print(f"\n[2] constrained (JSON Schema, every row) vs unconstrained, {n} tokens a row"
          "\n    json: unmasked greedy picks checked by the grammar (the default);"
          "\n    masked: a mask filled for every row at every step (unmasked_greedy=False)"
          "\n    no jump: json without jump-forward (jump_forward=False: the tokens the"
          "\n    schema fixes at the start, `{\"records\":[{\"name\":\"`, decoded one step each"
          "\n    rather than appended to the prompts' prefill)")
    print("    best of five runs a side, sides alternating; in brackets the ratio of the"
          "\n    medians (a constrained run's time varies more than a free run's: the"
          "\n    host's threads take turns with the grammar's)")
    print(f"{'batch':>5} {'free tok/s':>11} {'json tok/s':>11} {'ratio':>15} "
          f"{'no jump tok/s':>14} {'ratio':>15} "
          f"{'masked tok/s':>13} {'ratio':>15} {'picks refused premasked':>24}")
    unmasked = eng.config
    masked = dataclasses.replace(unmasked, unmasked_greedy=False)
    no_jump = dataclasses.replace(unmasked, jump_forward=False)
    for bs in sizes:
        ps = prompts(tok, bs)
        # alternate sides, best of five each: the host is shared and noisy
        free, json_, json_masked, json_no_jump = [], [], [], []
        stats = getattr(eng, "stats", eng)  # (the engine itself before its split)
        picks, refused, premasked = (stats.num_unmasked_picks, stats.num_refused_picks,
                                     stats.num_premasked_picks)
        for _ in range(5):
            secs, count = timed_generate(eng, ps, sp)
            free.append(count / secs)
            secs, count = timed_generate(eng, ps, sp,
                                         lambda: [compiled.matcher() for _ in ps])
            json_.append(count / secs)
            eng.config = masked
            secs, count = timed_generate(eng, ps, sp,
                                         lambda: [compiled.matcher() for _ in ps])
            json_masked.append(count / secs)
            eng.config = no_jump
            secs, count = timed_generate(eng, ps, sp,
                                         lambda: [compiled.matcher() for _ in ps])
            json_no_jump.append(count / secs)
            eng.config = unmasked
        picks, refused, premasked = (stats.num_unmasked_picks - picks,
                                     stats.num_refused_picks - refused,
                                     stats.num_premasked_picks - premasked)
        out = eng.generate(ps[:1], sp, constraints=[compiled.matcher()])[0]
        assert '"records"' in out.text[:60], out.text[:80]
        mid = statistics.median
        print(f"{bs:>5} {max(free):>11.0f} {max(json_):>11.0f} "
              f"{max(json_) / max(free):>6.3f} ({mid(json_) / mid(free):.3f}) "
              f"{max(json_no_jump):>14.0f} "
              f"{max(json_no_jump) / max(free):>6.3f} ({mid(json_no_jump) / mid(free):.3f}) "
              f"{max(json_masked):>13.0f} "
              f"{max(json_masked) / max(free):>6.3f} ({mid(json_masked) / mid(free):.3f}) "
              f"{picks:>8} {refused:>5} {premasked:>9}", flush=True)
        if profile:  # where the host's time goes (main thread), free then constrained
            for constraints in (None, [compiled.matcher() for _ in ps]):
                prof = cProfile.Profile()
                prof.enable()
                eng.generate(ps, sp, constraints=constraints)
                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats(14)


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device copy (read + write counted), median of 10."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    times.sort()
    return 2 * src.numel() / times[len(times) // 2]


def part_bound(tok: Tokenizer, shape: str, n: int, config: dict) -> None:
    eng = make_engine(shape, tok, 1, **config)
    cfg = eng.model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in eng.model.parameters())
    ps = prompts(tok, 1)
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=n // 4, temperature=0.0, ignore_eos=True)
    # the decode step by difference of two lengths: prefill and start-up cancel out
    t_long, c_long = timed_generate(eng, ps, sp)
    t_short, c_short = timed_generate(eng, ps, short)
    step = (t_long - t_short) / (c_long - c_short)
    mean_ctx = len(ps[0]) + (n + n // 4) / 2
    kv_bytes = 2 * cfg.num_hidden_layers * mean_ctx * cfg.num_key_value_heads * cfg.head_dim * 2
    bw = copy_bandwidth()
    bound = (weight_bytes + kv_bytes) / bw
    print(f"\n[3] batch-1 decode step vs bytes moved: shape={shape} bf16")
    print(f"weights {weight_bytes / 1e9:.3f} GB, KV read {kv_bytes / 1e6:.2f} MB, "
          f"copy bandwidth {bw / 1e12:.2f} TB/s -> bound {bound * 1e3:.3f} ms")
    print(f"measured step {step * 1e3:.3f} ms ({1 / step:.0f} tok/s): "
          f"{bound / step:.1%} of the bound", flush=True)


def part_invariant(shape: str, tok: Tokenizer, sizes: list[int], n: int, config: dict,
                   runs: int = 3) -> None:
    """Tokens/s with batch-invariant mode on and off, free text, greedy."""
    print(f"\n[4] batch-invariant mode's cost: shape={shape}, {n} tokens a row, "
          f"best of {runs} alternating runs", flush=True)
    config = {k: v for k, v in config.items() if k != "batch_invariant"}
    for b in sizes:
        engines = {on: make_engine(shape, tok, b, batch_invariant=on, **config)
                   for on in (False, True)}
        ps = prompts(tok, b)
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        rates: dict[bool, list[float]] = {False: [], True: []}
        for r in range(runs):
            for on in ((False, True) if r % 2 == 0 else (True, False)):
                # (each model's linears follow its own engine's mode)
                secs, tokens = timed_generate(engines[on], ps, sp)
                rates[on].append(tokens / secs)
        off, on = max(rates[False]), max(rates[True])
        print(f"batch {b:4d}: off {off:9.1f} tok/s, on {on:9.1f} tok/s, ratio on/off "
              f"{on / off:.3f}", flush=True)
        del engines
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer-dir", required=True)
    ap.add_argument("--shape", default="smollm2-135m",
                    choices=sorted(SHAPES) + sorted(DEEPSEEK_V4_SHAPES))
    ap.add_argument("--bound-shape", default="llama-1b", choices=sorted(SHAPES))
    ap.add_argument("--batch-sizes", default="1,64,256")
    ap.add_argument("--constrained-batch-sizes", default="64,256")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--skip", default="", help="comma list of: hf, constrained, bound")
    ap.add_argument("--profile", action="store_true", help="host profile of a constrained run")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run")
    ap.add_argument("--tuning", dest="tunings", action="append", default=[],
                    metavar="FIELD=LITERAL",
                    help="an EngineTuning field of every engine built (repeatable, as "
                    "engine_ab.py's --tuning): a variant's figures")
    ap.add_argument("--config", dest="configs", action="append", default=[],
                    metavar="FIELD=LITERAL",
                    help="an EngineConfig field of every engine built (repeatable)")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="also measure batch-invariant mode's cost (part 4)")
    ap.add_argument("--invariant-batch-sizes", default="64,256")
    ap.add_argument("--host-cores", type=int, default=None,
                    help="run on this many host cores (a slower host: the constrained "
                    "steps of a large batch are host-bound on some H200 machines)")
    args = ap.parse_args()
    limit_host_cores(args.host_cores)
    try:
        config = dict(config_changes(args.configs), tuning=EngineTuning.parse(args.tunings))
    except ValueError as exc:
        ap.error(str(exc))
    if args.tunings or args.configs:
        print("with " + "; ".join(args.tunings + args.configs))
    global DEVICE
    DEVICE = torch.device(args.device)
    skip = set(filter(None, args.skip.split(",")))
    tok = Tokenizer.from_hf_dir(args.tokenizer_dir)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    csizes = [int(b) for b in args.constrained_batch_sizes.split(",")]
    name = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu"
    print(f"device={name} torch={torch.__version__}")
    if not {"hf", "constrained"} <= skip:
        t = time.perf_counter()
        eng = make_engine(args.shape, tok, max(sizes + csizes), **config)
        graphs = getattr(eng.runner, "graphs", None)
        print(f"engine built with CUDA graphs {graphs.sizes if graphs else None}"
              f" in {time.perf_counter() - t:.1f} s")
        if "hf" not in skip:
            part_hf(eng, tok, args.shape, sizes, args.tokens)
        if "constrained" not in skip:
            part_constrained(eng, tok, csizes, args.tokens, args.profile)
        del eng
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
    if args.batch_invariant:
        part_invariant(args.shape, tok, [int(b) for b in args.invariant_batch_sizes.split(",")],
                       args.tokens, config)
    if "bound" not in skip and DEVICE.type != "cuda":
        print("[3] skipped: the bytes-moved bound is measured on CUDA only")
    elif "bound" not in skip:
        part_bound(tok, args.bound_shape, args.tokens, config)
    print(json.dumps({"done": True}))


if __name__ == "__main__":
    main()

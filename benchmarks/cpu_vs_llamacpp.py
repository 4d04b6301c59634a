"""formcast vs llama.cpp on the CPU: the same GGUF, greedy, in the same run.

llama.cpp runs through ``llama-cpp-python`` (``pip install -e '.[bench]'``; it builds
from source, about 10 minutes on 2 cores). Both sides get the same prompt token ids
and the same thread count. Each measurement is printed with its ratio:

1. **decode**: batch 1, free text, 128 tokens after a short chat prompt (end of
   sequence ignored on both sides). Decode tokens/s counts from the first generated
   token to the last (prefill excluded); the whole request is printed too.
1b. **prefill**: batch 1, a 512-token prompt and one generated token (a different
   first token each time, so neither side finds it in a prefix cache).
2. **extraction**: JSON Schema extraction over texts of ``data/extraction_tune.jsonl``
   (eleven schemas), one request at a time, whole request time. formcast uses
   ``llm.extract`` (its default speculation included); llama.cpp its GBNF grammar
   made from the same schema (``LlamaGrammar.from_json_schema``, built once per
   schema, outside the timing; formcast's grammars are compiled, once per schema,
   before the timing too).
3. **concurrent**: 16 extraction requests (mixed schemas) submitted at once to
   formcast's engine, aggregate output tokens/s, against llama.cpp running the same
   16 one after another.
4. **mask overhead** (formcast alone): the extraction prompts constrained by their
   schema, and unconstrained with each row's length fixed to what it produced
   constrained (so every step has the same batch), speculation and prefix caching
   off, the two sides alternating (median of 3); tokens/s ratio at batch 1 (four
   texts one at a time) and 16 (sixteen at once).
5. **peak RSS**: a fresh process per side loads the model and generates 32 tokens;
   its peak resident memory.

Schemas that llama.cpp's JSON-Schema-to-GBNF converter cannot convert are left out
on both sides (named in the output). The machine's other load shows in every
figure: compare ratios of one run, never figures of different runs.

Usage::

    python benchmarks/cpu_vs_llamacpp.py [--texts 10] [--threads N] [--quantization auto]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import extraction_quality as eq  # noqa: E402  (same folder: the texts and schemas)

TARGETS = {"decode": 1.1, "prefill": 1.0, "extraction": 2.0, "concurrent": 4.0, "mask": 0.95}
RSS_TARGET_MB = 600
STORY = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def verdict(name: str, ratio: float) -> str:
    target = TARGETS[name]
    return f"(target >= {target}x: {'PASS' if ratio >= target else 'FAIL'})"


# ------------------------------------------------------------------ llama.cpp side

def load_llamacpp(path: Path, threads: int):
    from llama_cpp import Llama

    return Llama(model_path=str(path), n_ctx=4096, n_batch=512, n_threads=threads,
                 n_threads_batch=threads, verbose=False, seed=0)


def llamacpp_decode(llm, ids: list[int], n: int) -> tuple[float, float, int]:
    """(decode tokens/s, whole-request seconds, tokens) for ``n`` greedy tokens."""
    llm.reset()
    start = time.perf_counter()
    first = last = None
    count = 0
    for _ in llm.create_completion(ids, max_tokens=n, temperature=0.0, stream=True,
                                   logit_bias={llm.token_eos(): -1e9}):
        last = time.perf_counter()
        first = first or last
        count += 1
    return (count - 1) / (last - first), last - start, count


def llamacpp_extract(llm, ids: list[int], grammar, max_tokens: int) -> tuple[float, int, str]:
    """(seconds, output tokens, text) of one grammar-constrained greedy request."""
    start = time.perf_counter()
    out = llm.create_completion(ids, max_tokens=max_tokens, temperature=0.0, grammar=grammar)
    seconds = time.perf_counter() - start
    return seconds, out["usage"]["completion_tokens"], out["choices"][0]["text"]


# ------------------------------------------------------------------- formcast side

def formcast_decode(engine, ids: list[int], n: int) -> tuple[float, float, int]:
    from formcast.engine import SamplingParams

    engine.add_request(ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    start = time.perf_counter()
    first = None
    count = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            count = len(out.token_ids)
        if first is None and count:
            first, first_count = time.perf_counter(), count
    end = time.perf_counter()
    return (count - first_count) / (end - first), end - start, count


def formcast_prefill(engine, ids: list[int]) -> float:
    """Seconds for a request of prompt ``ids`` and one generated token."""
    from formcast.engine import SamplingParams

    start = time.perf_counter()
    engine.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    return time.perf_counter() - start


def llamacpp_prefill(llm, ids: list[int]) -> float:
    start = time.perf_counter()
    llm.create_completion(ids, max_tokens=1, temperature=0.0)
    return time.perf_counter() - start


_RSS_PROBE = """
if {side!r} == "formcast":
    import torch
    torch.set_num_threads({threads})
    import formcast
    from formcast.engine import SamplingParams
    llm = formcast.load({path!r}, quantization={quant!r})
    ids = llm.tokenizer.encode({story!r})
    llm.engine.generate([ids], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
else:
    from llama_cpp import Llama
    llm = Llama(model_path={path!r}, n_ctx=4096, n_batch=512,
                n_threads={threads}, n_threads_batch={threads}, verbose=False, seed=0)
    llm.create_completion({story!r}, max_tokens=32, temperature=0.0)
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork and exec, so a child of
# this (large) benchmark process would report the parent's peak
print(next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")) / 1024)
"""


def peak_rss(side: str, threads: int, path: Path, quant: str | None) -> float:
    """Peak resident MB of a fresh process that loads ``side`` (the GGUF at ``path``)
    and generates 32 tokens."""
    import subprocess

    code = _RSS_PROBE.format(side=side, threads=threads, story=STORY, path=str(path),
                             quant=quant)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    return float(done.stdout.strip().splitlines()[-1])


def run_engine(engine, requests: list[tuple[list[int], object, object]]) -> tuple[float, list]:
    """Submit ``(ids, params, constraint)`` requests at once; (seconds, outputs in order)."""
    start = time.perf_counter()
    order = [engine.add_request(ids, params, constraint=c) for ids, params, c in requests]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return time.perf_counter() - start, [done[r] for r in order]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--texts", type=int, default=10, help="extraction texts (sequential)")
    ap.add_argument("--concurrent", type=int, default=16)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--model", default="smollm2",
                    help="a catalogue name (formcast models) or a GGUF path, for both sides")
    ap.add_argument("--quantization", default="auto",
                    help="formcast's quantization: auto (a Llama GGUF's own blocks on the native "
                    "kernels, else int4/int8 where the file allows), gguf, int4, int8, none")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: "
                    "decode,prefill,extraction,concurrent,mask,rss")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))

    import formcast
    from formcast.engine import SamplingParams
    from formcast.engine.hub import resolve_model
    from formcast.engine.speculative import SpecConfig
    from formcast.extraction import extraction_messages, extraction_spec
    from llama_cpp import LlamaGrammar

    torch.set_num_threads(args.threads)
    path = resolve_model(args.model).path
    quant = None if args.quantization == "none" else args.quantization
    llm = formcast.load(str(path), quantization=quant)
    engine, tok = llm.engine, llm.tokenizer
    lcpp = load_llamacpp(path, args.threads)
    print(f"{llm!r} vs llama.cpp (llama-cpp-python) on {path.name}, {args.threads} threads, "
          f"torch {torch.__version__}", flush=True)

    items = eq.load_items(eq.DATA)
    by_schema: dict[str, list] = {}
    for it in items:
        by_schema.setdefault(it.schema, []).append(it)
    mixed = [g[i] for i in range(max(map(len, by_schema.values())))
             for g in by_schema.values() if i < len(g)]  # round robin over schemas
    specs = {name: extraction_spec(model) for name, model in eq.SCHEMAS.items()}
    grammars = {}
    for name, s in specs.items():
        try:
            grammars[name] = LlamaGrammar.from_json_schema(json.dumps(s.json_schema),
                                                           verbose=False)
        except Exception as exc:  # noqa: BLE001  (llama.cpp's converter has gaps)
            print(f"   (llama.cpp cannot convert schema {name}: {type(exc).__name__} {exc}; "
                  "its texts are left out on both sides)")
    mixed = [it for it in mixed if it.schema in grammars]
    compiled = {name: s.compile(tok, vocab_size=engine.model.config.vocab_size)
                for name, s in specs.items()}

    def prompt(it) -> list[int]:
        return tok.apply_chat_template(extraction_messages(it.text, specs[it.schema].json_schema),
                                       add_generation_prompt=True, tokenize=True)

    results: dict[str, float] = {}

    # 1. decode, batch 1
    if "decode" not in skip:
        ids = tok.apply_chat_template([{"role": "user", "content": STORY}],
                                      add_generation_prompt=True, tokenize=True)
        n = args.decode_tokens
        formcast_decode(engine, ids, 8), llamacpp_decode(lcpp, ids, 8)  # warm-up
        fc, lc = [], []
        for r in range(3):
            fc.append(formcast_decode(engine, ids, n))
            lc.append(llamacpp_decode(lcpp, ids, n))
        fc_tps = statistics.median(x[0] for x in fc)
        lc_tps = statistics.median(x[0] for x in lc)
        fc_req = statistics.median(x[1] for x in fc)
        lc_req = statistics.median(x[1] for x in lc)
        results["decode"] = fc_tps / lc_tps
        print(f"\n1. decode, batch 1, {n} tokens after a {len(ids)}-token prompt (median of 3)")
        print(f"   formcast  {fc_tps:7.1f} tok/s decode   {fc_req:6.2f} s request")
        print(f"   llama.cpp {lc_tps:7.1f} tok/s decode   {lc_req:6.2f} s request")
        print(f"   ratio {results['decode']:.2f}x decode, {lc_req / fc_req:.2f}x request "
              f"{verdict('decode', results['decode'])}", flush=True)

    # 1b. prefill of a long prompt, batch 1 (a different first token each time: no
    # prefix cache on either side)
    if "prefill" not in skip:
        # (no special tokens: a model that adds bos would get it twice, mid-prompt)
        body = tok.encode(" ".join([STORY] * 40),
                          add_special_tokens=False)[:args.prefill_tokens - 1]
        fc, lc = [], []
        for r in range(4):
            # (the digit's token: " 0" .. " 3" all start with the space token)
            ids = [tok.encode(f" {r}", add_special_tokens=False)[-1]] + body
            fc.append(formcast_prefill(engine, ids))
            lcpp.reset()
            lc.append(llamacpp_prefill(lcpp, ids))
        fc_tps = statistics.median(len(body) / t for t in fc[1:])
        lc_tps = statistics.median(len(body) / t for t in lc[1:])
        results["prefill"] = fc_tps / lc_tps
        print(f"\n1b. prefill, batch 1, a {len(body) + 1}-token prompt and one token (median of 3)")
        print(f"   formcast  {fc_tps:7.1f} tok/s   llama.cpp {lc_tps:7.1f} tok/s")
        print(f"   ratio {results['prefill']:.2f}x {verdict('prefill', results['prefill'])}",
              flush=True)

    # 2. extraction, one request at a time
    if "extraction" not in skip:
        chosen = mixed[:args.texts]
        # warm-up; each schema's grammar is made before the timing on both sides
        # (llama.cpp's GBNF grammars above, formcast's compiled grammars here)
        # (on a text of its own: no timed prompt is in the prefix cache before its turn)
        for name in sorted({it.schema for it in chosen}):
            llm.extract_batch([f"A warm-up note about nothing in particular ({name})."],
                              eq.SCHEMAS[name], max_tokens=16)
        llamacpp_extract(lcpp, prompt(chosen[0]), grammars[chosen[0].schema], 192)
        fc_s = lc_s = 0.0
        fc_tok = lc_tok = same = lc_valid = 0
        for it in chosen:
            start = time.perf_counter()
            done = llm.extract_batch([it.text], eq.SCHEMAS[it.schema], max_tokens=192,
                                     return_completions=True)[0]
            fc_s += time.perf_counter() - start
            fc_tok += getattr(getattr(done, "usage", None), "completion_tokens", 0)
            seconds, count, text = llamacpp_extract(lcpp, prompt(it), grammars[it.schema], 192)
            lc_s += seconds
            lc_tok += count
            try:
                theirs = json.loads(text)
                lc_valid += 1
            except ValueError:
                theirs = None
            mine = getattr(done, "text", None)
            same += mine is not None and theirs is not None and json.loads(mine) == theirs
        results["extraction"] = lc_s / fc_s
        print(f"\n2. extraction, {len(chosen)} texts one at a time, JSON Schema / GBNF, greedy")
        print(f"   formcast  {fc_s:6.2f} s  {fc_tok} tokens  {fc_s / len(chosen):.2f} s/request")
        print(f"   llama.cpp {lc_s:6.2f} s  {lc_tok} tokens  {lc_s / len(chosen):.2f} s/request  "
              f"({lc_valid}/{len(chosen)} parse as JSON)")
        print(f"   same JSON value on both sides: {same}/{len(chosen)}")
        print(f"   ratio {results['extraction']:.2f}x (llama.cpp time / formcast time) "
              f"{verdict('extraction', results['extraction'])}", flush=True)

    # 3. 16 concurrent extraction requests
    if "concurrent" not in skip:
        chosen = mixed[:args.concurrent]
        reqs = [(prompt(it), SamplingParams(max_tokens=192, temperature=0.0),
                 compiled[it.schema].matcher()) for it in chosen]
        fc_s, outs = run_engine(engine, reqs)
        fc_tok = sum(len(o.token_ids) for o in outs)
        lc_s = lc_tok = 0
        for it in chosen:
            seconds, count, _ = llamacpp_extract(lcpp, prompt(it), grammars[it.schema], 192)
            lc_s += seconds
            lc_tok += count
        fc_rate, lc_rate = fc_tok / fc_s, lc_tok / lc_s
        results["concurrent"] = fc_rate / lc_rate
        print(f"\n3. {len(chosen)} extraction requests: formcast all at once, llama.cpp in turn")
        print(f"   formcast  {fc_tok} tokens in {fc_s:6.2f} s = {fc_rate:7.1f} tok/s")
        print(f"   llama.cpp {lc_tok} tokens in {lc_s:6.2f} s = {lc_rate:7.1f} tok/s")
        print(f"   ratio {results['concurrent']:.2f}x {verdict('concurrent', results['concurrent'])}",
              flush=True)

    # 4. constrained vs unconstrained decode on formcast's engine
    if "mask" not in skip:
        import dataclasses

        from formcast.engine import Engine

        # an engine of its own over the same model: prefix caching off (the second
        # side would otherwise find the first side's prompts cached) and no drafts
        plain = Engine(engine.model, tok, device=engine.device, name=engine.name,
                       config=dataclasses.replace(engine.config, enable_prefix_caching=False,
                                                  spec=SpecConfig(method="none")))
        print("\n4. formcast constrained vs unconstrained decode, same rows and lengths, "
              "speculation and prefix caching off")
        for batch in (1, 16):
            # at batch 1, four texts one after another: one short request alone is
            # too brief a measurement on a noisy machine
            chosen = mixed[:max(batch, 4)]
            groups = [chosen[i:i + batch] for i in range(0, len(chosen), batch)]
            lengths = {}  # each text's constrained length, which the free side gets too
            for group in groups:  # warm-up
                _, outs = run_engine(plain, [(prompt(it), SamplingParams(
                    max_tokens=192, temperature=0.0), compiled[it.schema].matcher())
                    for it in group])
                lengths.update((id(it), len(o.token_ids)) for it, o in zip(group, outs))
            rates = {"constrained": [], "unconstrained": []}
            for r in range(3):
                for side in (("constrained", "unconstrained") if r % 2 == 0
                             else ("unconstrained", "constrained")):
                    secs = tokens = 0
                    for group in groups:
                        if side == "constrained":
                            reqs = [(prompt(it), SamplingParams(max_tokens=192, temperature=0.0),
                                     compiled[it.schema].matcher()) for it in group]
                        else:
                            reqs = [(prompt(it), SamplingParams(max_tokens=lengths[id(it)],
                                                                temperature=0.0, ignore_eos=True),
                                     None) for it in group]
                        took, outs = run_engine(plain, reqs)
                        secs += took
                        tokens += sum(len(o.token_ids) for o in outs)
                    rates[side].append(tokens / secs)
            c = statistics.median(rates["constrained"])
            u = statistics.median(rates["unconstrained"])
            results[f"mask{batch}"] = c / u
            print(f"   batch {batch:2d}: constrained {c:7.1f} tok/s, unconstrained {u:7.1f} tok/s, "
                  f"ratio {c / u:.3f} {verdict('mask', c / u)}", flush=True)

    if "rss" not in skip:
        fc_mb = peak_rss("formcast", args.threads, path, quant)
        lc_mb = peak_rss("llama.cpp", args.threads, path, quant)
        print(f"\n5. peak resident memory, load + a 32-token generation, a process each")
        print(f"   formcast  {fc_mb:6.0f} MB   llama.cpp {lc_mb:6.0f} MB   "
              f"(target formcast <= {RSS_TARGET_MB} MB: "
              f"{'PASS' if fc_mb <= RSS_TARGET_MB else 'FAIL'})", flush=True)

    print("\nsummary: " + ", ".join(f"{k} {v:.2f}x" for k, v in results.items()))


if __name__ == "__main__":
    main()

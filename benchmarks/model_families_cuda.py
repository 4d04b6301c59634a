"""Each family on the Llama path (Qwen2, Qwen3, Mistral, Gemma 3, Phi-3) on a GPU:
random weights of a small shape (``formcast.engine.models.shapes.family_shapes``)
in bfloat16, greedy generation with CUDA graphs on and off, with and without
prompt-lookup speculation (a difference reports the eager run's top-two gap where
it starts: a near tie is rounding), the same in the batch-invariant mode, and
prefill logits against the float32 CPU model.

Prompts are longer than the sliding windows, so the Triton kernels' window
masking runs in prefill, decode and verification. Prints one line a check: OK or
what differs. Exits 1 when a check fails.

    python benchmarks/model_families_cuda.py [--families gemma3,qwen3] [--tokens 48]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def _tokenizer(vocab: int):
    """Ids only: a word-level vocabulary of ``<i>`` strings, no special tokens."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    from formcast.engine.tokenizer import Tokenizer

    backend = Backend(models.WordLevel({f"<{i}>": i for i in range(vocab)}, unk_token="<0>"))
    return Tokenizer(backend, bos_token_id=None, eos_token_id=None)


def _engine(config, weights, device: str, dtype: torch.dtype, **engine):
    from formcast.engine import Engine
    from formcast.engine.config import EngineConfig
    from formcast.engine.loading import build_model

    model = build_model(config, weights, device=torch.device(device), dtype=dtype)
    return Engine(model, _tokenizer(config.vocab_size),
                  config=EngineConfig(num_kv_blocks=512, max_num_seqs=8, **engine))


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    pieces = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (40, 150, 300)]
    return pieces + [pieces[0] * 4]  # (a repetitive one: drafts for prompt lookup)


def _generate(eng, prompts: list[list[int]], tokens: int, margins: list | None = None
              ) -> list[list[int]]:
    """Greedy tokens of each prompt; ``margins`` (a list) gets each row's gaps
    between the top two log-probs at every step."""
    from formcast.engine import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True,
                            logprobs=None if margins is None else 1)
    outs = eng.generate(prompts, params)
    if margins is not None:
        margins.extend([[lp.logprob - next((v for t, v in lp.top if t != lp.token_id), -1e9)
                         for lp in o.logprobs] for o in outs])
    return [list(o.token_ids) for o in outs]


def _first_difference(a: list[list[int]], b: list[list[int]], margins: list[list[float]]) -> str:
    """Where ``a`` first differs from ``b`` (the eager run, whose top-two gaps are
    ``margins``): a near tie there is bfloat16 rounding, a wide gap a bug."""
    for row, (x, y) in enumerate(zip(a, b)):
        if x != y:
            at = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            gap = margins[row][at] if at < len(margins[row]) else float("nan")
            return (f"row {row} differs from token {at} on; eager's top-two log-prob gap "
                    f"there {gap:.4f}")
    return "same"


def check_family(name: str, tokens: int) -> list[tuple[str, bool, str]]:
    from formcast.engine.models.shapes import family_shapes, random_family_weights

    config = family_shapes()[name]
    weights = random_family_weights(config, seed=0)
    prompts = _prompts(config.vocab_size, 1)
    results = []
    t0 = time.perf_counter()
    margins: list[list[float]] = []
    eager = _generate(_engine(config, weights, "cuda", torch.bfloat16, cuda_graphs=False,
                              spec="none"), prompts, tokens, margins)
    graphs_eng = _engine(config, weights, "cuda", torch.bfloat16, cuda_graphs=True, spec="none")
    graphs = _generate(graphs_eng, prompts, tokens)
    results.append(("graphs vs eager", graphs == eager,
                    _first_difference(graphs, eager, margins)))
    spec = _generate(_engine(config, weights, "cuda", torch.bfloat16, cuda_graphs=True,
                             spec="prompt_lookup"), prompts, tokens)
    results.append(("prompt lookup vs eager", spec == eager,
                    _first_difference(spec, eager, margins)))
    # the batch-invariant mode's kernels round a row the same whatever the step's
    # shape: graphs and eager must agree there, near ties included
    inv_margins: list[list[float]] = []
    inv_eager = _generate(_engine(config, weights, "cuda", torch.bfloat16, cuda_graphs=False,
                                  spec="none", batch_invariant=True), prompts, tokens,
                          inv_margins)
    inv_graphs = _generate(_engine(config, weights, "cuda", torch.bfloat16, cuda_graphs=True,
                                   spec="none", batch_invariant=True), prompts, tokens)
    results.append(("invariant: graphs vs eager", inv_graphs == inv_eager,
                    _first_difference(inv_graphs, inv_eager, inv_margins)))
    # Triton prefill (bf16) against the torch path in float32 on the CPU
    ids = prompts[2]
    gpu = graphs_eng.forward_logits(ids).float()
    cpu = _engine(config, weights, "cpu", torch.float32, spec="none").forward_logits(ids)
    top1 = (gpu.argmax(-1) == cpu.argmax(-1)).float().mean().item()
    rel = ((gpu - cpu).abs().max() / cpu.abs().max()).item()
    results.append(("bf16 cuda vs f32 cpu logits", top1 >= 0.9 and rel < 0.05,
                    f"top-1 agreement {top1:.3f}, max |d| / max |logit| {rel:.4f}"))
    results.append(("time", True, f"{time.perf_counter() - t0:.1f} s"))
    return results


def main() -> int:
    from formcast.engine.models.shapes import family_shapes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(family_shapes()))
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    print(f"device: {torch.cuda.get_device_name()}")
    failed = False
    for name in args.families.split(","):
        try:
            results = check_family(name, args.tokens)
        except Exception as exc:  # noqa: BLE001  (report and go on to the next family)
            results = [("run", False, f"{type(exc).__name__}: {exc}")]
        for check, ok, detail in results:
            failed |= not ok
            print(f"{name:8s} {check:30s} {'OK  ' if ok else 'DIFF'} {detail}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

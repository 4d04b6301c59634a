"""Quality of the quantized CPU path against the float32 path, on real prompts.

"gguf": the file's own blocks on the native kernels, prompt rows included (int4 runs
prompts on float32 weights); each projection's input with more than 8 bits (16-bit
codes on Q4_0/Q4_1 weights, else int8 codes plus the codes of their rounding error),
and, for comparison, as one set of int8 codes (llama.cpp's Q8 activations). For each prompt the float32 engine (the GGUF dequantized) generates ``--tokens``
greedy tokens; each quantized engine then scores that same sequence in one pass
(teacher forcing). Reported per format: the max and mean absolute logit difference
over all generated positions, the greedy agreement (share of positions where both
argmaxes agree), and how many tokens its own free-running greedy output shares
with float32's before the first difference.

Usage::

    python benchmarks/quant_quality.py [--tokens 200] [--fast]
"""

from __future__ import annotations

import argparse

import torch

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten-year-old.",
    "Extract the name and city as JSON: 'Maria Gonzalez, 34, works as a nurse in Valencia.'",
    "List five tips for writing clear technical documentation.",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--fast", action="store_true", help="only gguf and int4 (int8 head)")
    args = ap.parse_args()

    from formcast.engine import Engine, SamplingParams
    from formcast.engine.layers.quant import Bf16Linear

    ref = Engine.from_pretrained("smollm2", device="cpu", quantization=None)
    formats = {"gguf (native kernels)": Engine.from_pretrained(
        "smollm2", device="cpu", quantization="gguf")}
    one_level = Engine.from_pretrained("smollm2", device="cpu", quantization="gguf")
    for layer in one_level.model.model.layers:
        layer.two_level_activations = 0
    formats["gguf, one set of activation codes"] = one_level
    formats["int4 (file's Q4_1 blocks), int8 head"] = Engine.from_pretrained(
        "smollm2", device="cpu", quantization="int4")
    if not args.fast:
        bf16_head = Engine.from_pretrained("smollm2", device="cpu", quantization="int4")
        bf16_head.model.lm_head = Bf16Linear(ref.model.lm_head)
        formats["int4 (file's Q4_1 blocks), bf16 head"] = bf16_head
        formats["int8 (per channel)"] = Engine.from_pretrained("smollm2", device="cpu",
                                                                quantization="int8")
    greedy = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    tok = ref.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}],
                                       add_generation_prompt=True, tokenize=True)
               for p in PROMPTS]
    refs = ref.generate(prompts, greedy)
    print(f"{len(prompts)} prompts x {args.tokens} greedy tokens of the float32 engine\n")
    print(f"{'format':40s} {'max |dlogit|':>12} {'mean |dlogit|':>13} {'agreement':>9} "
          f"{'same prefix':>11}")
    for name, engine in formats.items():
        worst, total, count, agree, prefix = 0.0, 0.0, 0, 0, []
        mine = engine.generate(prompts, greedy)
        for ids, out, own in zip(prompts, refs, mine):
            seq = list(ids) + list(out.token_ids)
            n = len(out.token_ids)
            a = engine.forward_logits(seq, as_generated=True)[len(ids) - 1:len(ids) - 1 + n]
            b = ref.forward_logits(seq)[len(ids) - 1:len(ids) - 1 + n]
            diff = (a - b).abs()
            worst = max(worst, diff.max().item())
            total += diff.mean().item() * n
            count += n
            agree += (a.argmax(-1) == b.argmax(-1)).sum().item()
            same = next((i for i, (x, y) in enumerate(zip(own.token_ids, out.token_ids))
                         if x != y), min(len(own.token_ids), n))
            prefix.append(same)
        print(f"{name:40s} {worst:12.3f} {total / count:13.4f} {agree / count:9.1%} "
              f"{sum(prefix) / len(prefix):11.1f}")
    print("\nsame prefix: mean tokens of the format's own greedy output equal to float32's "
          "before the first difference.")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()

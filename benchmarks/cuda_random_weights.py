"""Decode throughput on CUDA with random weights of a real shape, vs transformers.

The GGUF does not travel to the GPU machine, so both sides get the same random
weights (SmolLM2-135M shape by default) and our tokenizer's prompts. Prints
tokens/s of formcast and of transformers' greedy ``generate`` in the same run, and
their ratio, at each batch size.

    python benchmarks/cuda_random_weights.py --tokenizer-dir DIR [--shape smollm2-135m]
"""

from __future__ import annotations

import argparse
import time

import torch

from formcast.engine import Engine, EngineConfig, SamplingParams, Tokenizer
from formcast.engine.engine import build_model
from formcast.engine.models.shapes import SHAPES, random_llama_weights


def hf_model(shape: str, weights: dict[str, torch.Tensor], dtype: torch.dtype):
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
    return model.to("cuda", dtype).eval()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer-dir", required=True)
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    tok = Tokenizer.from_hf_dir(args.tokenizer_dir)
    weights = random_llama_weights(SHAPES[args.shape], seed=0, head_std=0.5)
    dtype = torch.bfloat16
    model = build_model(SHAPES[args.shape], weights, device=torch.device("cuda"), dtype=dtype)
    eng = Engine(model, tok, config=EngineConfig(max_num_seqs=256, num_kv_blocks=4096),
                 device=torch.device("cuda"))
    hf = hf_model(args.shape, weights, dtype)
    n = args.tokens
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    print(f"shape={args.shape} dtype={dtype} tokens={n} device={torch.cuda.get_device_name()}")
    print(f"{'batch':>5} {'formcast tok/s':>15} {'hf tok/s':>10} {'ratio':>7}")
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        prompts = [tok.encode(f"Request number {i}: summarise the weather report.") for i in range(bs)]
        width = max(len(p) for p in prompts)
        eng.generate(prompts, sp)
        torch.cuda.synchronize()
        t = time.perf_counter()
        eng.generate(prompts, sp)
        torch.cuda.synchronize()
        ours = bs * n / (time.perf_counter() - t)
        ids = torch.tensor([[2] * (width - len(p)) + p for p in prompts], device="cuda")
        mask = (torch.arange(width, device="cuda") >= torch.tensor(
            [width - len(p) for p in prompts], device="cuda").unsqueeze(1)).long()
        with torch.no_grad():
            hf.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=2)
            torch.cuda.synchronize()
            t = time.perf_counter()
            hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, pad_token_id=2)
            torch.cuda.synchronize()
        theirs = bs * n / (time.perf_counter() - t)
        print(f"{bs:>5} {ours:>15.1f} {theirs:>10.1f} {ours / theirs:>7.2f}x")


if __name__ == "__main__":
    main()

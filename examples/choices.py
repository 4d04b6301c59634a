"""Classification with a fixed set of answers, two ways.

- ``generate(prompt, choices=[...])`` constrains generation: the output is always
  exactly one of the strings (``Completion.value`` holds it).
- ``choose(prompt, choices)`` scores every choice as a continuation (sum of token
  log-probabilities) and returns the likeliest, without generating at all.

Run: python examples/choices.py
"""

from __future__ import annotations

import formcast

LABELS = ["positive", "negative", "neutral"]
REVIEWS = [
    "Absolutely love this blender, it crushes ice in seconds!",
    "The screen cracked on day two and support never answered.",
    "It arrived on Tuesday. It is a phone case.",
    "Best purchase I've made all year, the battery lasts forever.",
]
QUESTIONS = [
    ("What is the capital of Japan?", ["Tokyo", "Paris", "Cairo"]),
    ("What colour is the sky on a clear day?", ["blue", "green", "red"]),
    ("What do bees make?", ["honey", "milk", "silk"]),
]


def main() -> None:
    # on a CPU the GGUF's 4-bit blocks run on native kernels; on a GPU: formcast.load("smollm2")
    llm = formcast.load("smollm2", device="cpu")

    print("Sentiment, constrained generation (one batch):")
    prompts = [f"Is the sentiment of this review positive, negative or neutral?\n\n{r}"
               for r in REVIEWS]
    for review, out in zip(REVIEWS, llm.generate_batch(prompts, choices=LABELS, max_tokens=4)):
        print(f"  {out.value:9s} <- {review}")

    print("\nQuestions, answered by scoring each choice with choose():")
    for question, options in QUESTIONS:
        best = llm.choose(question, options)
        scores = llm.score(question, options)
        ranked = ", ".join(f"{option} {score:.1f}" for score, option
                           in sorted(zip(scores, options), reverse=True))
        print(f"  {question} -> {best}   [log-probs: {ranked}]")


if __name__ == "__main__":
    main()

"""Regex-constrained generation: the output always fully matches the pattern.

Each pattern is compiled into a token-level automaton; at every step only tokens
that keep the output on a path to a full match can be sampled.

Run: python examples/regex_patterns.py

(Not named regex.py: a script's folder comes first on sys.path, and a regex.py there
would shadow the `regex` package that xgrammar imports through transformers.)
"""

from __future__ import annotations

import re

import formcast

CASES = [
    ("What is the date of the first Moon landing? Answer as YYYY-MM-DD.",
     r"\d{4}-\d{2}-\d{2}"),
    ("Invent a US phone number for a fictional pizza shop.",
     r"\(\d{3}\) \d{3}-\d{4}"),
    ("Suggest a work email address for Jane Smith at example.com.",
     r"[a-z]+\.[a-z]+@example\.com"),
    ("Give a hex colour code for a deep ocean blue.",
     r"#[0-9a-fA-F]{6}"),
    ("How warm is it in Lisbon in July? Answer like '27 C'.",
     r"[1-4]?[0-9] C"),
]


def main() -> None:
    # on a CPU the GGUF's 4-bit blocks run on native kernels; on a GPU: formcast.load("smollm2")
    llm = formcast.load("smollm2", device="cpu")
    for prompt, pattern in CASES:
        out = llm.generate(prompt, regex=pattern, max_tokens=32)
        ok = re.fullmatch(pattern, out.text) is not None
        print(f"{prompt}\n  /{pattern}/ -> {out.text!r}  fullmatch={ok}  "
              f"({out.usage.completion_tokens} tokens)")
        if not ok:
            raise SystemExit(f"output {out.text!r} does not match {pattern!r}")
    print(f"\nall {len(CASES)} outputs match their patterns")


if __name__ == "__main__":
    main()

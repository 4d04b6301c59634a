"""Batch extraction: many texts, one engine batch, failures per item.

``llm.extract_batch(texts, Model)`` submits every text at once, so the engine
runs them together (continuous batching). An item that fails (say, it ran out of
max_tokens) comes back as its ``FormcastError`` in place; the rest still succeed.

Run: python examples/batch.py
"""

from __future__ import annotations

import time

from pydantic import BaseModel, Field

import formcast


class Book(BaseModel):
    title: str
    author: str
    year: int = Field(description="year of publication")


TEXTS = [
    "Dune by Frank Herbert (1965) is a classic of science fiction.",
    "Beloved, a novel by Toni Morrison, was published in 1987.",
    "Chinua Achebe's novel Things Fall Apart first appeared in 1958.",
    "'The Left Hand of Darkness' by Ursula K. Le Guin was published in 1969.",
    "Published in 1937, The Hobbit by J.R.R. Tolkien remains a classic.",
    "Project Hail Mary (2021) is Andy Weir's third novel.",
    "Kazuo Ishiguro published Never Let Me Go in 2005.",
    "Station Eleven, by Emily St. John Mandel, came out in 2014.",
]


def main() -> None:
    # on a CPU the GGUF's 4-bit blocks run on native kernels; on a GPU: formcast.load("smollm2")
    llm = formcast.load("smollm2", device="cpu")

    start = time.perf_counter()
    results = llm.extract_batch(TEXTS, Book, max_tokens=64)
    elapsed = time.perf_counter() - start

    ok = 0
    for text, result in zip(TEXTS, results):
        if isinstance(result, formcast.FormcastError):
            print(f"  FAILED  {text}\n          {type(result).__name__}: {result}")
            continue
        ok += 1
        print(f"  {result!r}\n      <- {text}")
    print(f"\n{ok}/{len(TEXTS)} extracted in one batch, {elapsed:.1f} s "
          f"({len(TEXTS) / elapsed:.2f} items/s)")


if __name__ == "__main__":
    main()

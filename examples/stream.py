"""Streaming a typed object: partial values while it is generated, then the final one.

``llm.stream(prompt, output_type=Model)`` yields plain dicts that grow as the
constrained JSON is generated (fields appear as soon as they can be parsed), and
finally the validated pydantic object.

Run: python examples/stream.py
"""

from __future__ import annotations

import time

from pydantic import BaseModel, Field

import formcast


class Trip(BaseModel):
    destination: str
    nights: int
    travellers: int
    activities: list[str] = Field(min_length=1, max_length=3)


def main() -> None:
    # on a CPU the GGUF's 4-bit blocks run on native kernels; on a GPU: formcast.load("smollm2")
    llm = formcast.load("smollm2", device="cpu")
    prompt = ("We are 4 friends going to Rome for 3 nights; we want to see the Colosseum, "
              "eat pizza and visit the Vatican. Summarise the trip as JSON.")

    start, partials, final = time.perf_counter(), 0, None
    for item in llm.stream(prompt, output_type=Trip, max_tokens=120):
        if isinstance(item, Trip):
            final = item
            break
        partials += 1
        print(f"  {time.perf_counter() - start:5.2f} s  partial: {item}")
    print(f"\nfinal ({partials} partial values before it): {final!r}")


if __name__ == "__main__":
    main()

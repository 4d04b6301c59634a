"""A small synthetic dataset: every record follows the schema, by construction.

The prompts come from a Jinja template filled with every combination of the
variables; each record samples with its own seed, duplicates are redrawn, and the
JSONL can be resumed after a crash by running the same call again.

Run: python examples/synthetic_dataset.py [output.jsonl]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

import formcast


class Product(BaseModel):
    name: str = Field(max_length=30, description="A short product name")
    category: Literal["kitchen", "garden", "office", "toys"]
    price_eur: int = Field(ge=1, le=500)
    in_stock: bool


def main() -> None:
    output = Path(sys.argv[1]) if len(sys.argv) > 1 else \
        Path(tempfile.mkdtemp(prefix="formcast-")) / "products.jsonl"
    # on a CPU the GGUF's 4-bit blocks run on native kernels; on a GPU: formcast.load("smollm2")
    llm = formcast.load("smollm2", device="cpu")
    summary = formcast.dataset.generate(
        llm, Product, n=8, output=output, batch_size=8, max_tokens=64,
        template="Invent a {{ quality }} product for the {{ room }}.",
        variables={"quality": ["cheap", "premium"], "room": ["garden", "office", "playroom"]})

    for line in output.read_text().splitlines():
        record = json.loads(line)
        print(f"  #{record['id']} (prompt {record['prompt_id']}, seed {record['seed']}): "
              f"{Product.model_validate(record['data'])!r}")
    categories = summary.fields["category"]["string"]["counts"]
    print(f"{summary.n} records, {summary.duplicates} duplicates redrawn, "
          f"{summary.completion_tokens} tokens in {summary.elapsed_s:.1f} s")
    print(f"categories: {categories}")
    print(f"records -> {summary.output}\nsummary -> {summary.summary}")


if __name__ == "__main__":
    main()

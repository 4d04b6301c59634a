"""Typed extraction: pydantic models in, validated pydantic objects out.

``llm.extract(text, Model)`` shows the model the fields, constrains generation with
the model's JSON Schema (so the output always parses), and validates the result
with pydantic. Literals, bounded integers and booleans come back as Python values.
String fields are grounded: their values are spans of whole words of the text;
numbers are numbers the text writes where it writes any, and a number marked
``formcast.Grounded`` must always be one.

Run: python examples/extract.py   (the first run fetches the 94 MiB model)
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, Field

import formcast


class Contact(BaseModel):
    name: str = Field(description="the person's full name")  # (not the company's)
    company: str
    email: str


class Person(BaseModel):
    name: str = Field(description="full name")
    age: int
    city: str
    occupation: str


class Review(BaseModel):
    product: str
    stars: int = Field(ge=1, le=5, description="rating from 1 to 5")
    sentiment: Literal["positive", "negative", "mixed"]


class Recipe(BaseModel):
    dish: str
    servings: Annotated[int, formcast.Grounded]   # a number the text writes
    minutes: Annotated[int, formcast.Grounded] = Field(description="total cooking time in minutes")
    vegetarian: bool


class Book(BaseModel):
    title: str
    author: str
    year: int = Field(description="year of publication")


TEXTS: list[tuple[str, type[BaseModel]]] = [
    ("From: Dana Whitfield <dana.w@larkspur.io>\nCompany: Larkspur Analytics", Contact),
    ("Maria Gonzalez, age 34, nurse, Valencia.", Person),
    ("The Aeropress is wonderful. 5 stars.", Review),
    ("Chicken curry. Serves: 4. Time: 45 minutes.", Recipe),
    ("Dune by Frank Herbert (1965) is a classic of science fiction.", Book),
]


def main() -> None:
    # on a CPU the GGUF's own 4-bit blocks run on native kernels (the default); on a GPU
    # use formcast.load("smollm2").
    start = time.perf_counter()
    llm = formcast.load("smollm2", device="cpu")
    print(f"loaded {llm!r} in {time.perf_counter() - start:.1f} s\n")

    start = time.perf_counter()
    for text, model in TEXTS:
        t0 = time.perf_counter()
        obj = llm.extract(text, model)             # an instance of `model`, validated
        print(f"text: {text!r}")
        print(f"  -> {obj!r}   ({time.perf_counter() - t0:.1f} s)\n")
    print(f"{len(TEXTS)} typed objects in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()

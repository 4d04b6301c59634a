"""The extraction benchmark's schemas, texts and scoring (pure functions, no model).

Texts live in ``data/extraction_tune.jsonl`` (for tuning prompts and options) and
``data/extraction_heldout.jsonl`` (for reporting), split half and half per schema.
One JSON object a line::

    {"schema": "Receipt", "text": "...", "gold": {...},
     "alternates": {"merchant": ["LAWSON"], "items/0/description": ["Onigiri"]}}

``gold`` is the value a careful reader copies from the text (strings as spans of it,
null where the text does not say); ``alternates`` lists other acceptable values for a
field, keyed by its path (``/`` between names and list positions).

Scoring:

- A field is a leaf of the gold object: a nested object's fields count one by one (a
  null object counts as one field); a list counts as one field.
- A leaf is correct when the prediction equals the gold value or an alternate after
  normalisation: strings case- and whitespace-insensitively, numbers numerically,
  booleans exactly, null only as null (dates are ISO strings after validation).
- A list scores the share of items matched one to one, order free:
  ``matched / max(len(gold), len(predicted))`` (1.0 when both are empty); objects in
  a list match when all their leaves do.
- Hallucination: a string value of a plain string field (no enum, const, pattern or
  format: the fields extraction grounds) is hallucinated when its normalised form is
  not a substring of the normalised text; a number is hallucinated when no number
  written in the text equals it.
"""

from __future__ import annotations

import datetime
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

DATA_DIR = Path(__file__).parent / "data"
SPLITS = {"tune": DATA_DIR / "extraction_tune.jsonl",
          "heldout": DATA_DIR / "extraction_heldout.jsonl"}

Currency = Literal["USD", "EUR", "GBP", "JPY"]


# -- the schemas ------------------------------------------------------------------------
class Person(BaseModel):
    """A person mentioned in the text."""

    name: str = Field(description="full name")
    age: int | None = Field(description="age in years")
    city: str | None = Field(description="city where the person lives or works")
    occupation: str | None = Field(description="job or role")


class Product(BaseModel):
    """A product offer."""

    name: str = Field(description="product name, without the brand")
    brand: str
    price: float = Field(description="price as a number, without the currency sign")
    currency: Currency
    in_stock: bool = Field(description="whether the product can be bought now")


class Event(BaseModel):
    """An event announcement."""

    title: str = Field(description="name of the event")
    date: datetime.date = Field(description="the (first) day of the event")
    city: str
    venue: str | None = Field(description="building or place inside the city")


class Invoice(BaseModel):
    """An invoice or payment reminder."""

    invoice_number: str
    vendor: str = Field(description="company that issued the invoice")
    total: float = Field(description="amount due, as a number")
    due_date: datetime.date


class Book(BaseModel):
    """A book."""

    title: str
    author: str
    year: int = Field(description="year of publication")
    pages: int | None = Field(description="number of pages")


class Salary(BaseModel):
    """Pay offered for a job."""

    amount: float = Field(description="the figure as a number; the lower end of a range")
    currency: Currency
    period: Literal["hour", "month", "year"]


class JobPosting(BaseModel):
    """A job advertisement."""

    title: str = Field(description="job title")
    company: str = Field(description="the hiring company")
    city: str | None = Field(description="city of the workplace; null if not given")
    remote: bool = Field(description="whether the job can be done fully remotely")
    salary: Salary | None = Field(description="null if no pay is given")
    skills: list[str] = Field(description="required skills or tools, as written")


class MeetingEmail(BaseModel):
    """An email that sets up a meeting."""

    topic: str = Field(description="what the meeting is about")
    organizer: str = Field(description="name of the person who sends the invitation")
    date: datetime.date = Field(description="day of the meeting")
    location: str | None = Field(description="room, address or call link; null if not given")
    attendees: list[str] = Field(description="names of the other people invited")


class Review(BaseModel):
    """A customer review of a product."""

    product: str = Field(description="the product reviewed")
    rating: int = Field(description="stars given, 1 to 5")
    pros: list[str] = Field(description="good points, as short phrases from the text")
    cons: list[str] = Field(description="bad points, as short phrases from the text")


class Recipe(BaseModel):
    """A recipe."""

    title: str
    servings: int = Field(description="number of people it serves")
    minutes: int = Field(description="total time in minutes")
    difficulty: Literal["easy", "medium", "hard"] | None = Field(
        description="null if the text does not say")


class LineItem(BaseModel):
    """One line of a receipt."""

    description: str = Field(description="what was bought")
    quantity: int
    unit_price: float = Field(description="price of one unit, as a number")


class Receipt(BaseModel):
    """A receipt or order confirmation."""

    merchant: str = Field(description="shop or company that sold the items")
    date: datetime.date = Field(description="day of the purchase")
    items: list[LineItem]
    total: float = Field(description="amount paid, as a number")
    currency: Currency


class Address(BaseModel):
    """A postal address."""

    street: str = Field(description="street and house number")
    city: str
    postcode: str | None
    country: str | None


class Contact(BaseModel):
    """Contact details of the person who wrote or signed the text."""

    name: str
    company: str | None
    email: str | None
    phone: str | None
    address: Address | None = Field(description="null if no street address is given")


SCHEMAS: dict[str, type[BaseModel]] = {m.__name__: m for m in (
    Person, Product, Event, Invoice, Book, JobPosting, MeetingEmail, Review, Recipe, Receipt,
    Contact)}


# -- data ---------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Item:
    """One text with its gold object."""

    schema: str
    text: str
    gold: dict[str, Any]
    alternates: dict[str, list[Any]] = field(default_factory=dict)


def load_items(path: Path) -> list[Item]:
    """Read a ``.jsonl`` file of items; raises ``ValueError`` on an unknown schema or a
    gold object its schema rejects."""
    items = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        model = SCHEMAS.get(row["schema"])
        if model is None:
            raise ValueError(f"{path}:{number}: unknown schema {row['schema']!r}")
        model.model_validate(row["gold"])  # a gold object must be a valid answer
        items.append(Item(**row))
    return items


def load_split(split: str) -> list[Item]:
    """The items of ``"tune"``, ``"heldout"`` or ``"all"`` (tune then held-out)."""
    names = list(SPLITS) if split == "all" else [split]
    if not set(names) <= set(SPLITS):
        raise ValueError(f"unknown split {split!r}; use tune, heldout or all")
    return [it for name in names for it in load_items(SPLITS[name])]


# -- field accuracy -----------------------------------------------------------------------
def normalize(value: Any) -> Any:
    """The comparable form of a leaf value (see the module docstring)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, (datetime.date, datetime.datetime)):
        return value.isoformat()
    if isinstance(value, str):
        return " ".join(value.split()).casefold()
    return value


def leaf_equal(predicted: Any, gold: Any) -> bool:
    """Whether two leaf values are equal after normalisation."""
    p, g = normalize(predicted), normalize(gold)
    if isinstance(p, float) and isinstance(g, float):
        return math.isclose(p, g, rel_tol=0, abs_tol=1e-6)
    return type(p) is type(g) and p == g


def score_value(predicted: Any, gold: Any, alternates: dict[str, list[Any]],
                path: str = "") -> tuple[float, int]:
    """(credit, fields) of ``predicted`` against ``gold`` at ``path``: credit is the sum
    over the gold leaves of each one's score in [0, 1]; fields is their number."""
    options = [gold, *alternates.get(path, [])]
    if isinstance(gold, dict):
        if not isinstance(predicted, dict):
            hit = any(leaf_equal(predicted, alt) for alt in options[1:])
            return float(hit) * _leaves(gold), _leaves(gold)
        credit, fields = 0.0, 0
        for name, sub in gold.items():
            c, n = score_value(predicted.get(name), sub, alternates, _join(path, name))
            credit, fields = credit + c, fields + n
        best = max((1.0 for alt in options[1:] if _matches(predicted, alt, {}, path)),
                   default=0.0)
        return max(credit, best * fields), fields
    if isinstance(gold, list):
        return max(_list_credit(predicted, g, alternates, path) for g in options), 1
    return float(any(leaf_equal(predicted, g) for g in options)), 1


def _list_credit(predicted: Any, gold: list, alternates: dict[str, list[Any]],
                 path: str) -> float:
    if not isinstance(predicted, list):
        return 0.0
    if not gold and not predicted:
        return 1.0
    unused = list(range(len(predicted)))
    matched = 0
    for i, g in enumerate(gold):
        hit = next((j for j in unused
                    if _matches(predicted[j], g, alternates, _join(path, str(i)))), None)
        if hit is not None:
            unused.remove(hit)
            matched += 1
    return matched / max(len(gold), len(predicted))


def _matches(predicted: Any, gold: Any, alternates: dict[str, list[Any]], path: str) -> bool:
    credit, fields = score_value(predicted, gold, alternates, path)
    return math.isclose(credit, fields)


def _leaves(gold: Any) -> int:
    if isinstance(gold, dict):
        return sum(_leaves(v) for v in gold.values()) or 1
    return 1


def _join(path: str, name: str) -> str:
    return f"{path}/{name}" if path else name


def score_item(item: Item, predicted: dict[str, Any] | None) -> tuple[float, int]:
    """(credit, fields) of one validated prediction (``None``: invalid, credit 0)."""
    credit, fields = score_value(predicted, item.gold, item.alternates)
    return (credit if predicted is not None else 0.0), fields


# -- field accuracy per kind of field ---------------------------------------------------
KINDS = ("string", "number", "date", "enum", "bool", "list", "null")


def score_kinds(item: Item, predicted: dict[str, Any] | None) -> dict[str, tuple[float, int]]:
    """(credit, fields) of one prediction per kind of gold leaf (:data:`KINDS`): "null"
    is every leaf whose gold value is null (an optional field the text does not fill),
    "enum" a Literal, "date" a ``format: date`` string; the others by JSON type."""
    schema = SCHEMAS[item.schema].model_json_schema()
    tallies: dict[str, tuple[float, int]] = {}

    def walk(pred: Any, gold: Any, node: dict, path: str) -> None:
        node = _leaf_schema(node, schema.get("$defs", {}))
        if isinstance(gold, dict):
            for name, sub in gold.items():
                walk(pred.get(name) if isinstance(pred, dict) else None, sub,
                     node.get("properties", {}).get(name, {}), _join(path, name))
            return
        credit, fields = score_value(pred, gold, item.alternates, path)
        kind = _kind(gold, node)
        old = tallies.get(kind, (0.0, 0))
        tallies[kind] = (old[0] + (credit if predicted is not None else 0.0), old[1] + fields)

    walk(predicted, item.gold, schema, "")
    return tallies


def _leaf_schema(node: dict, defs: dict) -> dict:
    """``node`` with its ``$ref`` followed and an ``X | None`` union read as ``X``."""
    if "$ref" in node:
        node = defs.get(node["$ref"].split("/")[-1], node)
    for option in node.get("anyOf", []):
        if option.get("type") != "null":
            return _leaf_schema(option, defs)
    return node


def _kind(gold: Any, node: dict) -> str:
    if gold is None:
        return "null"
    if isinstance(gold, list):
        return "list"
    if "enum" in node or "const" in node:
        return "enum"
    if isinstance(gold, bool):
        return "bool"
    if node.get("format") == "date":
        return "date"
    return "number" if isinstance(gold, (int, float)) else "string"


# -- hallucination ------------------------------------------------------------------------
_NUMBER = re.compile(r"\d[\d,.' ]*\d|\d")


def numbers_in(text: str) -> set[float]:
    """Every number written in ``text`` in digits: ``,`` read as the decimal mark
    unless it groups thousands (``37,980``) or a ``.`` follows it; ``'`` and spaces as
    thousands separators (each space-separated part counts on its own too)."""
    found: set[float] = set()
    for match in _NUMBER.finditer(text):
        token = match.group().rstrip(".,' ")
        for part in {token, *token.split(" ")}:
            number = _read_number(part)
            if number is not None:
                found.add(number)
    return found


def _read_number(token: str) -> float | None:
    token = token.replace("'", "").replace(" ", "")
    if "," in token and "." in token:
        decimal = "," if token.rfind(",") > token.rfind(".") else "."
    elif "," in token:
        decimal = "" if all(len(g) == 3 for g in token.split(",")[1:]) else ","
    else:
        decimal = "." if token.count(".") <= 1 else ""
    for separator in ",.":
        if separator != decimal:
            token = token.replace(separator, "")
    try:
        return float(token.replace(",", "."))
    except ValueError:
        return None


def grounded_values(value: Any, schema: dict, defs: dict) -> tuple[list[str], list[float]]:
    """The plain-string values and the numbers of a validated value, walked with its JSON
    Schema (the string fields extraction grounds: no enum, const, pattern or format)."""
    schema = defs.get(schema.get("$ref", "").split("/")[-1], schema) if "$ref" in schema \
        else schema
    if value is None:
        return [], []
    if "anyOf" in schema:
        for option in schema["anyOf"]:
            if option.get("type") != "null":
                return grounded_values(value, option, defs)
    strings: list[str] = []
    numbers: list[float] = []
    if isinstance(value, dict):
        for name, sub in value.items():
            s, n = grounded_values(sub, schema.get("properties", {}).get(name, {}), defs)
            strings, numbers = strings + s, numbers + n
    elif isinstance(value, list):
        for sub in value:
            s, n = grounded_values(sub, schema.get("items", {}), defs)
            strings, numbers = strings + s, numbers + n
    elif isinstance(value, str):
        if not any(k in schema for k in ("enum", "const", "pattern", "format")):
            strings.append(value)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        numbers.append(float(value))
    return strings, numbers


def hallucinations(text: str, value: dict[str, Any], model: type[BaseModel]
                   ) -> tuple[int, int, int, int]:
    """(strings not in text, strings, numbers not in text, numbers) of one output."""
    schema = model.model_json_schema()
    strings, numbers = grounded_values(value, schema, schema.get("$defs", {}))
    haystack = normalize(text)
    missing_s = sum(normalize(s) not in haystack for s in strings)
    written = numbers_in(text)
    missing_n = sum(not any(math.isclose(x, w, abs_tol=1e-6) for w in written)
                    for x in numbers)
    return missing_s, len(strings), missing_n, len(numbers)

"""Typed extraction: the spec of one ``extract`` call and its per-text work.

``LLM.extract`` asks for the schema's fields with the prompt of
:mod:`formcast.extraction_prompt`, generates under the schema of
:mod:`formcast.extraction_schema` (bounded strings and lists, distinct items,
nullable optional fields) with each text's own grounded matcher, and validates
what comes back against the caller's schema. Unless grounding is "off", a text's
date and enum fields keep to the dates and enum values it writes
(:func:`formcast.extraction_choices.narrowed`, compiled for that text).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, is_typeddict

from formcast.errors import (ConstraintError, FormcastError, GroundingError, OutputValidationError,
                             RequestError)
from formcast.extraction_choices import narrowed
from formcast.extraction_prompt import ABSENT_NOTE, extraction_messages, form_lines, type_name
from formcast.extraction_schema import (MAX_FREE_STRING, MAX_LIST_ITEMS, cap_free_strings,
                                        generation_schema, lists_distinct, tidy, tidy_then)
from formcast.grammars.errors import UnsupportedTypeError
from formcast.grammars.grounding import grounding_plan
from formcast.completion import Completion
from formcast.spec import OutputSpec, parse_json, type_spec

GROUNDING_MODES = ("auto", "strict", "off")

__all__ = ["ABSENT_NOTE", "GROUNDING_MODES", "MAX_FREE_STRING", "MAX_LIST_ITEMS", "Extraction",
           "cap_free_strings", "check_grounding", "check_text", "extraction_messages",
           "extraction_spec", "form_lines", "generation_schema", "lists_distinct", "tidy",
           "type_name"]


def extraction_spec(schema: Any, *, grounding: str = "auto") -> OutputSpec:
    """Spec for ``extract``: a JSON Schema dict (returns dicts) or a class (instances).

    Parameters
    ----------
    schema : pydantic model, dataclass, TypedDict or JSON Schema dict
    grounding : {"auto", "strict", "off"}
        Checked here; applied per text by :class:`Extraction`.

    Returns
    -------
    OutputSpec
        ``constraint`` is compiled from :func:`generation_schema`; ``parse`` drops
        repeated list items and the nulls the caller's schema does not allow
        (:func:`tidy`), then validates against the schema as given (``json_schema``).

    Raises
    ------
    UnsupportedTypeError
        ``schema`` is not a schema.
    ConstraintError
        ``grounding`` is not one of :data:`GROUNDING_MODES`.
    """
    from formcast import grammars

    check_grounding(grounding)
    if isinstance(schema, dict):
        spec = OutputSpec(kind="json", parser=lambda text: parse_json(text, schema),
                          json_schema=schema)
    else:
        is_model = hasattr(schema, "model_json_schema")
        if not (is_model or dataclasses.is_dataclass(schema) or is_typeddict(schema)):
            raise UnsupportedTypeError(f"extract() takes a pydantic model, dataclass, TypedDict "
                                       f"or JSON Schema dict, got {schema!r}")
        spec = type_spec(schema)
    gen = generation_schema(spec.json_schema, grounded=grounding != "off")
    return dataclasses.replace(spec, constraint=grammars.JsonSchema(gen),
                               parser=tidy_then(spec.parse, gen))


def check_grounding(grounding: Any) -> str:
    """``grounding`` if it is a mode; else :class:`ConstraintError` naming the modes."""
    if grounding not in GROUNDING_MODES:
        raise ConstraintError(f"grounding must be one of "
                              f"{', '.join(map(repr, GROUNDING_MODES))}, got {grounding!r}")
    return grounding


def check_text(text: Any, index: int | None = None) -> str:
    """``text`` if there is something in it to extract from; else :class:`RequestError`."""
    where = "text" if index is None else f"texts[{index}]"
    if not isinstance(text, str):
        raise RequestError(f"{where} must be a str, got {type(text).__name__}")
    if not text.strip():
        raise RequestError(f"{where} is empty: there is nothing to extract from (extract() "
                           f"refuses it rather than invent values)")
    return text


class Extraction:
    """One ``extract`` call over its texts: prompts, matchers and result checks.

    Parameters
    ----------
    schema : pydantic model, dataclass, TypedDict or JSON Schema dict
    texts : sequence of str
    grounding : {"auto", "strict", "off"}
    instructions : str | None
        Extra guidance added to each prompt.

    Raises
    ------
    UnsupportedTypeError, ConstraintError
        As :func:`extraction_spec`.
    """

    def __init__(self, schema: Any, texts: Sequence[str], *, grounding: str,
                 instructions: str | None) -> None:
        self.spec = extraction_spec(schema, grounding=grounding)
        gen = self.spec.constraint.schema
        # (spans of whole words, capitalised words too: a small model writes "Nurse"
        # for "a nurse", and left free to stop mid-word it writes "Plu" for "plumber")
        # (and no span runs past a clause of the text, nor a list item past its "and")
        self.plan = grounding_plan(gen, "strict" if grounding == "auto" else grounding,
                                   words=True, capitalise=True, clauses=True)
        # under "auto" a number keeps to the text's numbers when it has one, and is
        # the model's own otherwise (no GroundingError): "Five stars" gives 5
        self.soft_numbers = self.plan.numbers - grounding_plan(gen, grounding).numbers
        self.distinct_items = lists_distinct(gen)
        self.narrow = grounding != "off"  # (date and enum fields keep to the text)
        self.instructions = instructions
        self.texts = list(texts)
        self._ids: list[list[int] | FormcastError] | None = None
        self._matchers: dict[int, Any] = {}

    def ids(self, tokenizer: Any) -> list[list[int] | FormcastError]:
        """Each text's prompt token ids, or the :class:`RequestError` refusing the text."""
        if self._ids is None:
            self._ids = []
            for i, text in enumerate(self.texts):
                try:
                    text = check_text(text, i if len(self.texts) > 1 else None)
                except RequestError as exc:
                    self._ids.append(exc)
                    continue
                messages = extraction_messages(text, self.spec.json_schema,
                                               instructions=self.instructions)
                self._ids.append(tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True))
        return self._ids

    def matcher(self, index: int, compiled: Any) -> Any:
        """Text ``index``'s own matcher of the compiled generation schema: its grounded
        values are whole words of the text (or of its words capitalised), its date and
        enum fields keep to the dates and values the text writes where it writes any
        (:func:`~formcast.extraction_choices.narrowed`, compiled for this text), its
        lists end at their first repeated item."""
        narrow = narrowed(self.spec.constraint.schema, self.texts[index]) \
            if self.narrow else None
        if narrow is not None:
            from formcast import grammars

            try:
                compiled = grammars.compile(
                    dataclasses.replace(self.spec.constraint, schema=narrow), compiled.vocab)
            except ConstraintError:
                pass  # (the call's own schema still holds)
        matcher = compiled.grounded_matcher(self.texts[index], self.plan,
                                            distinct_items=self.distinct_items)
        self._matchers[index] = matcher
        return matcher

    def finished(self, results: list, tokenizer: Any, engine: Any, greedy: bool) -> list:
        """``results`` as ``extract`` returns them: in ``greedy`` calls, each grounded
        number field the text's number ``engine`` scores best in its place
        (:func:`~formcast.extraction_numbers.rechosen`); then each :meth:`checked`."""
        if greedy:
            from formcast.extraction_numbers import rechosen  # (its tables import torch)

            results = rechosen(results, self.ids(tokenizer), self.texts, self.plan,
                               self.spec.parse, tokenizer, engine)
        return [self.checked(i, r) for i, r in enumerate(results)]

    def checked(self, index: int, result: Any) -> Any:
        """``result`` of text ``index``, or a :class:`GroundingError` naming the field
        whose value its matcher could not keep in the text."""
        matcher = self._matchers.get(index)
        if matcher is None or not isinstance(result, (OutputValidationError, Completion)):
            return result
        missing = [v for v in matcher.violations if v.kind == "ungrounded"
                   and not _pointer_in(v.pointer, self.soft_numbers)]
        if not missing:
            return result
        first = missing[0]
        return GroundingError(
            f"{first.pointer or 'the value'} is grounded but the text holds no value for it "
            f"(the model wrote {first.value!r}); make the field optional (X | None) so it "
            f"can be null, mark it NotGrounded, or pass grounding='off'",
            text=result.text, path=first.pointer)


def _pointer_in(pointer: str, paths: frozenset[tuple[str, ...]]) -> bool:
    """Whether JSON pointer ``pointer`` is one of ``paths`` (``"*"``: any array index)."""
    steps = tuple(p.replace("~1", "/").replace("~0", "~") for p in pointer.split("/")[1:])
    return any(len(path) == len(steps) and all(a == b or (a == "*" and b.isdigit())
                                               for a, b in zip(path, steps))
               for path in paths)

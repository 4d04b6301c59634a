"""The formcast error hierarchy, all in one place for callers.

The base class and the engine's errors live in ``formcast.engine.errors``, the
constraint error in ``formcast.grammars.errors``; the SDK's own errors are here.

Every error formcast raises on purpose derives from :class:`FormcastError`, so a
caller can catch the family with one clause. Errors about a caller's arguments
also derive from :class:`ValueError`, so code written against the standard
library's conventions keeps working.
"""

from __future__ import annotations

from formcast.engine.errors import (
    CorruptModelError,
    EngineError,
    FormcastError,
    ModelError,
    ModelFetchError,
    ModelNotFoundError,
    RequestError,
    UnsupportedModelError,
)
from formcast.grammars.errors import ConstraintError, UnsupportedTypeError


class IncompleteOutputError(FormcastError):
    """Generation stopped (e.g. at ``max_tokens``) before the constrained output was complete.

    Attributes
    ----------
    text : str
        The partial output produced so far.
    """

    def __init__(self, message: str, *, text: str = "") -> None:
        super().__init__(message)
        self.text = text


class RepetitionError(IncompleteOutputError):
    """Generation reached ``max_tokens`` because the output kept repeating itself.

    A larger ``max_tokens`` would only buy more repeats: bound the part that loops
    instead (``maxItems`` or ``uniqueItems`` on a list, a ``Literal`` or enum for a
    field with known values, ``maxLength`` on a string).

    Attributes
    ----------
    text : str
        The partial output produced so far.
    repeated : str
        The value or text that repeats.
    path : str
        JSON pointer of the list or value where it repeats ("" for the whole output).
    """

    def __init__(self, message: str, *, text: str = "", repeated: str = "", path: str = ""
                 ) -> None:
        super().__init__(message, text=text)
        self.repeated = repeated
        self.path = path


class OutputValidationError(FormcastError):
    """The output conformed to its constraint but the schema's validators rejected it.

    Attributes
    ----------
    text : str
        The raw generated text.
    error : Exception
        The validation error (e.g. ``pydantic.ValidationError``).
    """

    def __init__(self, message: str, *, text: str, error: Exception) -> None:
        super().__init__(message)
        self.text = text
        self.error = error


class GroundingError(OutputValidationError):
    """A grounded field of an extraction could not take any value from the text.

    Attributes
    ----------
    path : str
        JSON pointer of the field (e.g. ``/vendor``).
    """

    def __init__(self, message: str, *, text: str, path: str) -> None:
        super().__init__(message, text=text, error=ValueError(message))
        self.path = path


class QueueFullError(FormcastError):
    """Too many requests are in flight on a served model; retry later (HTTP 429)."""


class DatasetError(FormcastError):
    """A dataset run cannot go on: its output file is damaged or not formcast's, or a
    record could not be generated within its attempts."""


class ResumeMismatchError(DatasetError, ValueError):
    """A dataset run was asked to resume an output made with different parameters.

    Attributes
    ----------
    differences : dict[str, tuple]
        Parameter name -> (value recorded in the manifest, value asked for now).
    """

    def __init__(self, message: str, *, differences: dict[str, tuple]) -> None:
        super().__init__(message)
        self.differences = differences


__all__ = [
    "FormcastError",
    "ModelError",
    "ModelNotFoundError",
    "ModelFetchError",
    "CorruptModelError",
    "UnsupportedModelError",
    "RequestError",
    "ConstraintError",
    "UnsupportedTypeError",
    "IncompleteOutputError",
    "RepetitionError",
    "OutputValidationError",
    "GroundingError",
    "QueueFullError",
    "EngineError",
    "DatasetError",
    "ResumeMismatchError",
]

"""The formcast error hierarchy.

Every error formcast raises on purpose derives from :class:`FormcastError`, so a
caller can catch the family with one clause. Errors about a caller's arguments
also derive from :class:`ValueError`, so code written against the standard
library's conventions keeps working.
"""

from __future__ import annotations


class FormcastError(Exception):
    """Base class of every error formcast raises on purpose."""


class ModelError(FormcastError):
    """A model could not be found, fetched or loaded."""


class ModelNotFoundError(ModelError):
    """The name or path given does not resolve to a model formcast can load."""


class ModelFetchError(ModelError):
    """Fetching a registry model failed (network, pip, checksum)."""


class CorruptModelError(ModelError):
    """A model file exists but is truncated, damaged or inconsistent."""


class UnsupportedModelError(ModelError):
    """A well-formed model file of an architecture or format formcast does not run."""


class RequestError(FormcastError, ValueError):
    """A request was rejected before any work was queued (bad prompt or parameters)."""


class ConstraintError(FormcastError, ValueError):
    """A constraint (schema, regex, grammar, choices) is invalid, unsatisfiable or too costly."""


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


class EngineError(FormcastError):
    """The engine failed while running (not caused by one request's input)."""


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
    "IncompleteOutputError",
    "OutputValidationError",
    "EngineError",
    "DatasetError",
    "ResumeMismatchError",
]

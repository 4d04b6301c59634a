"""The error hierarchy's base and the engine's errors (the lowest layer owns them).

Every error formcast raises on purpose derives from :class:`FormcastError`, so a
caller can catch the family with one clause. Errors about a caller's arguments
also derive from :class:`ValueError`, so code written against the standard
library's conventions keeps working. ``formcast.grammars`` adds
``ConstraintError``; ``formcast`` re-exports them all.
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


class EngineError(FormcastError):
    """The engine failed while running (not caused by one request's input)."""


__all__ = [
    "CorruptModelError",
    "EngineError",
    "FormcastError",
    "ModelError",
    "ModelFetchError",
    "ModelNotFoundError",
    "RequestError",
    "UnsupportedModelError",
]

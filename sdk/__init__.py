"""formcast: structured-output generation with an embedded inference engine."""

from formcast.errors import (
    ConstraintError,
    CorruptModelError,
    EngineError,
    FormcastError,
    IncompleteOutputError,
    ModelError,
    ModelFetchError,
    ModelNotFoundError,
    OutputValidationError,
    RequestError,
    UnsupportedModelError,
)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "ConstraintError",
    "CorruptModelError",
    "EngineError",
    "FormcastError",
    "IncompleteOutputError",
    "ModelError",
    "ModelFetchError",
    "ModelNotFoundError",
    "OutputValidationError",
    "RequestError",
    "UnsupportedModelError",
]

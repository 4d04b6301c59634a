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

# The model API is imported lazily: formcast.engine imports formcast.errors, so
# importing the engine from here at import time would be circular (and slow).
_LAZY = {"load": "formcast.llm", "LLM": "formcast.llm", "Completion": "formcast.completion",
         "Usage": "formcast.completion"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'formcast' has no attribute {name!r}")


__all__ = [
    "__version__",
    "load",
    "LLM",
    "Completion",
    "Usage",
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

"""formcast: structured-output generation with an embedded inference engine."""

from formcast.errors import (
    ConstraintError,
    CorruptModelError,
    DatasetError,
    EngineError,
    FormcastError,
    GroundingError,
    IncompleteOutputError,
    ModelError,
    ModelFetchError,
    ModelNotFoundError,
    OutputValidationError,
    RepetitionError,
    QueueFullError,
    RequestError,
    ResumeMismatchError,
    UnsupportedModelError,
    UnsupportedTypeError,
)

__version__ = "0.1.0"

# The model API is imported lazily: formcast.engine imports formcast.errors, so
# importing the engine from here at import time would be circular (and slow).
_LAZY = {"load": "formcast.llm", "LLM": "formcast.llm", "AsyncLLM": "formcast.async_llm",
         "Completion": "formcast.completion", "Usage": "formcast.completion",
         "evaluate": "formcast.evaluation",
         "Grounded": "formcast.grammars.grounding", "NotGrounded": "formcast.grammars.grounding"}
# Submodules reached as attributes (``formcast.dataset.generate``), imported on first use.
# (evaluate() lives in formcast.evaluation: a module named evaluate would replace the
# function attribute as soon as it was imported.)
_LAZY_MODULES = ("dataset",)


def __getattr__(name: str):
    import importlib

    if name in _LAZY_MODULES:
        return importlib.import_module(f"formcast.{name}")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'formcast' has no attribute {name!r}")


__all__ = [
    "__version__",
    "load",
    "LLM",
    "AsyncLLM",
    "Completion",
    "Usage",
    "dataset",
    "evaluate",
    "Grounded",
    "NotGrounded",
    "ConstraintError",
    "CorruptModelError",
    "DatasetError",
    "EngineError",
    "FormcastError",
    "GroundingError",
    "IncompleteOutputError",
    "ModelError",
    "ModelFetchError",
    "ModelNotFoundError",
    "OutputValidationError",
    "RepetitionError",
    "QueueFullError",
    "RequestError",
    "ResumeMismatchError",
    "UnsupportedModelError",
    "UnsupportedTypeError",
]

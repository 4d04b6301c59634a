"""formcast.engine: the inference engine (paged KV cache, continuous batching).

The engine knows nothing of JSON or grammars; it drives any
:class:`LogitsConstraint` handed to it with a request. Names are imported on first
use, so that ``formcast.engine.errors`` is cheap to import (it loads no torch).
"""

import importlib

_EXPORTS = {
    "Engine": "formcast.engine.engine",
    "EngineConfig": "formcast.engine.config",
    "IncrementalDetokenizer": "formcast.engine.detokenizer",
    "LlamaConfig": "formcast.engine.config",
    "LogitsConstraint": "formcast.engine.constraint",
    "ParallelConfig": "formcast.engine.parallel.config",
    "Request": "formcast.engine.sequence",
    "RequestOutput": "formcast.engine.sequence",
    "SamplingParams": "formcast.engine.sampling_params",
    "TokenLogprob": "formcast.engine.sequence",
    "Tokenizer": "formcast.engine.tokenizer",
    "load_tokenizer": "formcast.engine.tokenizer_files",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'formcast.engine' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = sorted(_EXPORTS)

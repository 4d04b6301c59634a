"""formcast.engine: the inference engine (paged KV cache, continuous batching).

The engine knows nothing of JSON or grammars; it drives any
:class:`LogitsConstraint` handed to it with a request.
"""

from formcast.engine.config import EngineConfig, LlamaConfig
from formcast.engine.constraint import LogitsConstraint
from formcast.engine.engine import Engine
from formcast.engine.parallel.config import ParallelConfig
from formcast.engine.sampling_params import SamplingParams
from formcast.engine.sequence import Request, RequestOutput, TokenLogprob
from formcast.engine.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer

__all__ = [
    "Engine",
    "EngineConfig",
    "IncrementalDetokenizer",
    "LlamaConfig",
    "LogitsConstraint",
    "ParallelConfig",
    "Request",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
    "Tokenizer",
    "load_tokenizer",
]

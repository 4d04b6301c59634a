"""Shared fixtures: the real SmolLM2 model (fetched once into the user cache)."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs one worker per core: a worker that also spread torch over every
    # core would have its OpenMP threads spin against the other worker's.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# Test files that share an expensive session fixture run in one xdist worker.
_SHARED_WORKER = {"test_catalog.py": "gemma", "test_catalog_gemma.py": "gemma"}


@pytest.fixture(scope="session")
def smollm2_source():
    """The embedded default model, resolved (and fetched on first use) via the registry."""
    from formcast.engine.hub import resolve_model

    return resolve_model("smollm2")


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_source):
    """Path of the SmolLM2-135M-Instruct GGUF file."""
    return smollm2_source.path


def pytest_collection_modifyitems(config, items):
    for item in items:  # with --dist loadgroup: a file's tests stay in one worker
        name = item.path.name
        item.add_marker(pytest.mark.xdist_group(_SHARED_WORKER.get(name, str(item.path))))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is available on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_source):
    """Our engine on the real SmolLM2 weights (CPU, float32)."""
    from formcast.engine import Engine

    return Engine.from_pretrained(str(smollm2_source.path), device="cpu", quantization=None)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf):
    """transformers' LlamaForCausalLM from the same GGUF: the correctness oracle."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def llm(smollm2_engine):
    """formcast.LLM over the shared SmolLM2 engine."""
    from formcast.llm import LLM

    return LLM(smollm2_engine)


@pytest.fixture(scope="session")
def gemma_llm():
    """formcast.load of the catalogue's Gemma 3 270M by name (real weights, fetched on
    first use); loaded once, as loading requantizes its K-quant blocks."""
    import formcast

    return formcast.load("gemma3-270m", device="cpu")

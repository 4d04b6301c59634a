"""``formcast serve`` claims its KV cache at start: every page of the cache is resident
before the first request, so the server's memory stays flat under load, and outputs
do not change."""

from __future__ import annotations

import ctypes
import os
import sys
from types import SimpleNamespace

import pytest

from formcast.engine import Engine, SamplingParams
from formcast.server.launch import commit_kv_cache

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore: Linux")

BLOCKS = 128


@pytest.fixture(scope="module")
def fresh_engine(smollm2_gguf):
    return Engine.from_pretrained(str(smollm2_gguf), device="cpu", quantization=None,
                                  num_kv_blocks=BLOCKS, enable_prefix_caching=False)


def _resident_pages(buffers) -> tuple[int, int]:
    """(resident, total) pages under the tensors' memory, as the kernel reports them."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    resident = total = 0
    for t in buffers:
        addr = t.data_ptr()
        start = addr - addr % page
        length = addr + t.numel() * t.element_size() - start
        vec = (ctypes.c_ubyte * -(-length // page))()
        assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0
        resident += sum(v & 1 for v in vec)
        total += len(vec)
    return resident, total


def _greedy(engine: Engine) -> list[tuple[int, ...]]:
    outs = engine.generate([[1, 504, 3458, 314], [1, 28120, 45]],
                           SamplingParams(max_tokens=8, temperature=0))
    return [out.token_ids for out in outs]


def test_commit_makes_every_page_of_the_cache_resident_and_keeps_outputs(fresh_engine):
    cfg, block_size = fresh_engine.model.config, fresh_engine.config.block_size
    expected = (cfg.num_hidden_layers * 2 * block_size * cfg.num_key_value_heads
                * cfg.head_dim * 4 * BLOCKS)  # (float32 keys and values, every layer)
    before = _greedy(fresh_engine)
    assert commit_kv_cache(fresh_engine) == expected
    resident, total = _resident_pages(fresh_engine.runner.kv_caches)
    assert resident == total
    assert _greedy(fresh_engine) == before


@pytest.mark.parametrize("engine", [
    SimpleNamespace(),                                      # ranks in other processes
    SimpleNamespace(runner=SimpleNamespace()),              # no paged cache
])
def test_commit_is_a_no_op_without_a_local_paged_cache(engine):
    assert commit_kv_cache(engine) == 0

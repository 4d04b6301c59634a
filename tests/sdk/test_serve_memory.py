"""``formcast serve`` claims its KV cache at start: the cache is resident before the
first request, so the server's memory stays flat under load, and outputs do not change."""

from __future__ import annotations

import pytest

from formcast.engine import Engine, SamplingParams
from formcast.server.launch import commit_kv_cache

psutil = pytest.importorskip("psutil")

BLOCKS = 128


@pytest.fixture(scope="module")
def fresh_engine(smollm2_gguf):
    # (a cache no request has written yet: its pages are not resident)
    return Engine.from_pretrained(str(smollm2_gguf), device="cpu", quantization=None,
                                  num_kv_blocks=BLOCKS, enable_prefix_caching=False)


def _greedy(engine: Engine) -> list[list[int]]:
    outs = engine.generate([[1, 504, 3458, 314], [1, 28120, 45]],
                           SamplingParams(max_tokens=8, temperature=0))
    return [out.token_ids for out in outs]


def test_commit_makes_the_whole_cache_resident_and_keeps_outputs(fresh_engine):
    cfg, block_size = fresh_engine.model.config, fresh_engine.config.block_size
    expected = (cfg.num_hidden_layers * 2 * block_size * cfg.num_key_value_heads
                * cfg.head_dim * 4 * BLOCKS)  # (float32 keys and values, every layer)
    before = _greedy(fresh_engine)  # (writes one block a prompt, no more)
    rss = psutil.Process().memory_info().rss
    committed = commit_kv_cache(fresh_engine)
    grew = psutil.Process().memory_info().rss - rss
    assert committed >= expected
    assert grew >= 0.8 * expected  # (the blocks the prompts wrote were resident already)
    assert _greedy(fresh_engine) == before

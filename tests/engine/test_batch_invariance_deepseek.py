"""Batch-invariant mode on DeepSeek-V4 (CPU): a request's tokens and logprobs are
bitwise the same whatever it shares a step with, through per-request states
(sliding windows, compressed entries, attention sinks), hyper-connections and
MoE layers. The harness of tests/engine/test_batch_invariance.py on a tiny
DeepSeek-V4 loaded as the engine loads it, with MTP speculation, and a mode-off
control that shows the harness can tell the difference, and data-parallel
placement (with and without expert parallel) against one process.
"""

from __future__ import annotations

import pytest
import torch

from formcast.engine import Engine, EngineConfig, ParallelConfig
from formcast.engine.speculative import SpecConfig
from tests.engine.deepseek_v4_helpers import _one_thread  # noqa: F401  (autouse)
from tests.engine.test_batch_invariance import (ARRANGEMENTS, CPU, _check, _result, alone,
                                                make_requests, random_batches)


# -- DeepSeek-V4 (per-request states: sliding windows, compressed entries, sinks) -------

MTP = SpecConfig(method="mtp", scheduled=False, min_confidence=0.0)
DEEPSEEK_ARRANGEMENTS = {
    "together, prefix caching on": ARRANGEMENTS["together, prefix caching on"],
    "every prefill chunked": ARRANGEMENTS["every prefill chunked"],
    "tiny KV budget (preemption)": ARRANGEMENTS["tiny KV budget (preemption)"],
    "prompt-lookup speculation": ARRANGEMENTS["prompt-lookup speculation"],
    "MTP speculation": lambda m, t, r: random_batches(m, t, r, spec=MTP),
}


@pytest.fixture(scope="module")
def deepseek_run(tmp_path_factory):
    """A tiny DeepSeek-V4 (every layer type, hash and score routing, an MTP layer)
    loaded as the engine loads it, its requests, and their results run alone."""
    from tests.engine.deepseek_v4_folders import CONFIGS, write_folder

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("deepseek_v4")
    write_folder(folder, "all_layers_mtp", 0)
    eng = Engine.from_pretrained(str(folder), device="cpu", spec="none")
    vocab = CONFIGS["all_layers_mtp"]["vocab_size"]
    requests = make_requests(12, seed=7, vocab=(3, vocab - 1), shared=20, longest=60,
                             max_tokens=(2, 7))
    outs, _ = alone(eng.model, eng.tokenizer, requests)
    torch.set_num_threads(before)
    eng.folder = folder  # (for the data-parallel test's ranks to load)
    return eng, requests, _result(outs)


@pytest.mark.parametrize("name", list(DEEPSEEK_ARRANGEMENTS))
def test_deepseek_v4_outputs_are_the_same_in_every_arrangement(deepseek_run, name):
    eng, requests, expected = deepseek_run
    outs, ran = DEEPSEEK_ARRANGEMENTS[name](eng.model, eng.tokenizer, requests)
    _check(name, outs, expected, ran, exercised=False)


def test_deepseek_v4_mode_off_is_not_batch_invariant(deepseek_run):
    """The control: with the mode off the same requests run together differ from
    their runs alone, so the harness above can tell the mode from its absence."""
    eng, requests, _ = deepseek_run
    off = {"batch_invariant": False, "spec": "none", "num_kv_blocks": 512}
    ref = Engine(eng.model, eng.tokenizer, device=CPU,
                 config=EngineConfig(enable_prefix_caching=False, **off))
    expected = _result([ref.generate([p], sp)[0] for p, sp in requests])
    eng_off = Engine(eng.model, eng.tokenizer, device=CPU,
                     config=EngineConfig(max_num_seqs=len(requests), **off))
    got = _result(eng_off.generate([p for p, _ in requests], [sp for _, sp in requests]))
    assert sum(g != e for g, e in zip(got, expected)) > 0


@pytest.mark.parametrize("ep", [1, 2], ids=["data parallel", "data and expert parallel"])
def test_data_parallel_placement_gives_the_bits_of_one_process(deepseek_run, ep):
    """Two ranks (gloo, CPU) each take some of the requests, in other company than
    on one process; with ``ep=2`` each MoE layer's experts are split between them
    and tokens cross to the rank holding theirs. Every token and logprob equals
    the request run alone on one process."""
    eng, requests, expected = deepseek_run
    par = Engine.from_pretrained(str(eng.folder), device="cpu", spec="none",
                                 parallel=ParallelConfig(dp=2, ep=ep))
    try:
        got = _result(par.generate([p for p, _ in requests], [sp for _, sp in requests]))
    finally:
        par.shutdown()
    assert got == expected

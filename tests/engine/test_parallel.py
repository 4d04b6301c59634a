"""Attention data parallel + MoE expert parallel over 2 CPU processes (gloo), held
against the single-process engine on tiny DeepSeek-V4 configs (score- and
hash-routed MoE layers)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

import formcast
from formcast.engine import Engine, ParallelConfig, SamplingParams
from formcast.errors import EngineError, RequestError
from tests.engine.deepseek_v4_folders import CONFIGS, write_folder

PAR = ParallelConfig(dp=2, ep=2)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for seed, name in enumerate(("hca_hc4", "csa_sigmoid_yarn_mtp")):
        folder = tmp_path_factory.mktemp(name)
        write_folder(folder, name, seed + 2)
        out[name] = folder
    return out


def prompts(name: str, n: int) -> list[list[int]]:
    vocab = CONFIGS[name]["vocab_size"]
    return [torch.randint(0, vocab, (4 + 3 * i,), generator=torch.Generator().manual_seed(i))
            .tolist() for i in range(n)]


def params(n: int) -> list[SamplingParams]:
    # budgets differ, so one rank runs out of work first and steps idle
    return [SamplingParams(max_tokens=6 + 5 * i, temperature=0.0, ignore_eos=True, logprobs=3)
            for i in range(n)]


def assert_same(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        for a, b in zip(g.logprobs, w.logprobs, strict=True):
            assert abs(a.logprob - b.logprob) <= 1e-5
            for (ta, la), (tb, lb) in zip(a.top, b.top):
                assert ta == tb and abs(la - lb) <= 1e-5


@pytest.mark.parametrize("name", ["hca_hc4", "csa_sigmoid_yarn_mtp"])
def test_two_ranks_give_the_single_process_outputs(folders, name):
    single = Engine.from_pretrained(str(folders[name]), device="cpu", spec="none")
    ps, sp = prompts(name, 5), params(5)
    want = single.generate(ps, sp)
    par = Engine.from_pretrained(str(folders[name]), device="cpu", spec="none", parallel=PAR)
    try:
        got = par.generate(ps, sp)
        assert_same(got, want)
        stats = par.worker_stats()
        # both ranks ran forwards; the one that ran out of work joined the rest idle
        assert all(s["forwards"] > 0 for s in stats)
        assert sum(s["idle_forwards"] for s in stats) > 0
        assert [s["forwards"] + s["idle_forwards"] for s in stats][0] == \
            stats[1]["forwards"] + stats[1]["idle_forwards"]
        for ids in ps[:3]:  # the logits themselves, through the expert exchange
            diff = (par.forward_logits(ids) - single.forward_logits(ids)).abs().max().item()
            assert diff <= 1e-5, diff
        loads = par.expert_loads()
        assert len(loads) == CONFIGS[name]["num_hidden_layers"]
        assert all(int(layer.sum()) > 0 for layer in loads)
    finally:
        par.shutdown()


@pytest.mark.parametrize("spec", ["mtp", "prompt_lookup"])
def test_speculation_under_parallelism_keeps_greedy_outputs(folders, spec):
    """Each rank drafts and verifies its own requests (MTP drafts; prompt lookup on
    prompts that repeat): the greedy tokens of one process without drafts."""
    name = "csa_sigmoid_yarn_mtp"
    ps = [p * 3 for p in prompts(name, 4)]
    sp = [SamplingParams(max_tokens=8 + 4 * i, temperature=0.0, ignore_eos=True) for i in range(4)]
    want = Engine.from_pretrained(str(folders[name]), device="cpu", spec="none").generate(ps, sp)
    par = Engine.from_pretrained(str(folders[name]), device="cpu", spec=spec, parallel=PAR)
    try:
        got = par.generate(ps, sp)
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        assert sum(o.metrics.num_draft_tokens for o in got) > 0
    finally:
        par.shutdown()


def test_expert_replicas_applied_mid_run_keep_the_outputs(folders):
    name = "hca_hc4"
    single = Engine.from_pretrained(str(folders[name]), device="cpu", spec="none")
    ps, sp = prompts(name, 6), params(6)
    want = single.generate(ps, sp)
    par = Engine.from_pretrained(str(folders[name]), device="cpu", spec="none", parallel=PAR)
    try:
        ids = [par.add_request(p, s) for p, s in zip(ps, sp)]
        done = {}
        for step in range(40):
            for out in par.step():
                if out.finished:
                    done[out.request_id] = out
            if step == 3:
                # a skewed load: expert 0 hot -> it gets a replica on the other rank
                skew = [torch.tensor([1000, 10, 10, 10, 10]) for _ in range(3)]
                plans = par.rebalance(skew)
                assert all(len(p.copies(0)) == 2 for p in plans)
            if step == 7:
                par.rebalance()  # from the measured loads
            if len(done) == len(ids):
                break
        assert_same([done[i] for i in ids], want)
    finally:
        par.shutdown()


def test_a_killed_worker_makes_the_caller_raise_and_leaves_no_process(folders):
    name = "hca_hc4"
    par = Engine.from_pretrained(str(folders[name]), device="cpu", spec="none", parallel=PAR)
    pids = [s["pid"] for s in par.worker_stats()]
    killed_at = []

    def kill():
        time.sleep(1.0)
        killed_at.append(time.monotonic())
        os.kill(pids[1], signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    with pytest.raises(EngineError, match="rank 1|rank 0"):
        while True:  # steps until the kill lands
            par.generate(prompts(name, 4), long)
    assert time.monotonic() - killed_at[0] < 10
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or _zombie_or_gone(pid)
    with pytest.raises(EngineError, match="shut down"):
        par.add_request([1, 2, 3], long)


def _zombie_or_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_sdk_call_site_is_unchanged_and_bad_configs_are_named(folders):
    from typing import Annotated

    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: Annotated[str, Field(max_length=6)]
        age: Annotated[int, Field(ge=0, le=99)]
        ok: bool

    class LocalConstraint:  # a constraint that cannot be pickled
        def fill_bitmask(self, bitmask, row): ...
        def accept(self, token_id): return True
        def rollback(self, n): ...
        def is_terminated(self): return False
        def forced_tokens(self): return []
        def valid_prefix(self, draft): return len(draft)

    llm = formcast.load(str(folders["hca_hc4"]), device="cpu", spec="none", parallel=PAR)
    try:
        ref = formcast.load(str(folders["hca_hc4"]), device="cpu", spec="none")
        assert llm.generate("hello", max_tokens=8, temperature=0.0).token_ids == \
            ref.generate("hello", max_tokens=8, temperature=0.0).token_ids
        # extraction: the grammar's matcher travels to the rank and is rebuilt there
        texts = ["Ada, 36, is ok", "Bo, 7, not ok", "Cy is 50"]
        got = llm.extract_batch(texts, Person, max_tokens=60)
        assert got == ref.extract_batch(texts, Person, max_tokens=60)
        assert all(isinstance(p, Person) for p in got)
        with pytest.raises(RequestError, match="cannot be sent to rank"):
            llm.engine.add_request([1, 2], SamplingParams(max_tokens=2),
                                   constraint=LocalConstraint())
    finally:
        llm.engine.shutdown()
    with pytest.raises(ValueError, match="ep must be 1 or equal to dp"):
        ParallelConfig(dp=2, ep=3)
    with pytest.raises(ValueError, match="dp must be a positive"):
        ParallelConfig(dp=0)


def test_torchrun_entry_point_spreads_a_batch_over_ranks(folders, tmp_path):
    import json
    import subprocess
    import sys

    from formcast.engine.parallel.engine import _free_port

    name = "hca_hc4"
    ps = prompts(name, 5)
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in ps))
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(_free_port()), "-m", "formcast.engine.parallel.worker", "--model",
         str(folders[name]), "--prompts", str(tmp_path / "in.jsonl"), "--output",
         str(tmp_path / "out.jsonl"), "--max-tokens", "9", "--device", "cpu"],
        capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    got = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    single = Engine.from_pretrained(str(folders[name]), device="cpu", spec="none")
    want = single.generate(ps, SamplingParams(max_tokens=9, temperature=0.0))
    assert [g["token_ids"] for g in got] == [list(w.token_ids) for w in want]
    assert {g["rank"] for g in got} == {0, 1}

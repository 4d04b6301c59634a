"""DeepSeek-V4 through the whole engine, held against transformers.

Three tiny configs (tests/engine/deepseek_v4_folders.py) are saved with
transformers' ``save_pretrained`` from seeded random weights (plus seeded MTP
weights of our own in two of them) next to a byte-level BPE tokenizer, and loaded
with ``Engine.from_pretrained``. Windows are short (5-8 tokens) and compress rates
4 and 8, so every prompt and every 24-token generation crosses many window and
compression boundaries.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from formcast import grammars
from formcast.engine import Engine, SamplingParams
from formcast.engine.constraint import BaseConstraint
from formcast.engine.models.deepseek_v4_runner import DeepseekV4Runner
from formcast.engine.scheduler import ScheduledSeq
from formcast.engine.speculative import SpecConfig
from tests.engine.deepseek_v4_folders import CONFIGS, WITH_MTP, write_folder
from tests.engine.deepseek_v4_helpers import _one_thread  # noqa: F401  (autouse)
from tests.engine.helpers import make_seq

ATOL = 1e-4
NAMES = list(CONFIGS)
SEEDS = {"all_layers_mtp": 0, "csa_sigmoid_yarn_mtp": 1, "hca_hc4": 2}
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> (folder, transformers' model)."""
    out = {}
    for name in NAMES:
        folder = tmp_path_factory.mktemp(name)
        out[name] = folder, write_folder(folder, name, SEEDS[name])
    return out


def engine(folders, name: str, spec="none", **config) -> Engine:
    return Engine.from_pretrained(str(folders[name][0]), device="cpu", spec=spec, **config)


def prompt(name: str, length: int, seed: int) -> list[int]:
    vocab = CONFIGS[name]["vocab_size"]
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_logits(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0]


def reference_generate(ref, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_configs_cover_every_part(folders):
    layer_types = {t for c in CONFIGS.values() for t in c["layer_types"]}
    assert layer_types == {"sliding_attention", "compressed_sparse_attention",
                           "heavily_compressed_attention"}
    assert {t for c in CONFIGS.values() for t in c["mlp_layer_types"]} == {"hash_moe", "moe"}
    assert all(c["n_shared_experts"] == 1 for c in CONFIGS.values())
    assert sorted(c["hc_mult"] for c in CONFIGS.values()) == [2, 3, 4]
    for name in NAMES:
        eng = engine(folders, name)
        assert isinstance(eng.runner, DeepseekV4Runner)
        assert (len(eng.model.mtp) == 1) == (name in WITH_MTP)
        assert not eng.prefix_caching and not eng.block_manager.enable_prefix_caching
        assert eng.tokenizer.vocab_size == eng.model.config.vocab_size
        # "auto" drafts with the MTP layer where the model has one
        assert (engine(folders, name, spec="auto").speculative.mtp is not None) == (name in WITH_MTP)


@pytest.mark.parametrize("budget", [2048, 5, 1], ids=["prefill", "chunked", "decode"])
@pytest.mark.parametrize("name", NAMES)
def test_forward_logits_match_transformers(folders, name, budget):
    ids = prompt(name, 40, 1)
    want = reference_logits(folders[name][1], ids)
    eng = engine(folders, name, max_num_batched_tokens=budget)
    got = eng.forward_logits(ids)
    assert (got - want).abs().max().item() <= ATOL
    assert eng.runner.num_states == 0  # the temporary sequence's state was freed


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generation_matches_transformers_generate(folders, name):
    ref = folders[name][1]
    ids = prompt(name, 19, 2)
    want = reference_generate(ref, ids, 24)
    full = reference_logits(ref, ids + want)[len(ids) - 1:-1]  # scores of each generated token
    top2 = full.topk(2).values
    assert (top2[:, 0] - top2[:, 1]).min().item() > 1e-3  # no near-tie could flip an argmax
    eng = engine(folders, name, max_num_batched_tokens=7)  # chunked prefill, then decode
    out = eng.generate([ids], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                             logprobs=0))[0]
    assert list(out.token_ids) == want
    # each decode step's distribution is the full forward's at that position
    expected = torch.log_softmax(full, dim=-1)
    got = torch.tensor([lp.logprob for lp in out.logprobs])
    assert (got - expected[torch.arange(24), torch.tensor(want)]).abs().max().item() <= ATOL


def test_batch_gives_each_sequence_what_it_gives_alone(folders):
    name = "all_layers_mtp"
    # decode runs from position 3..21 up to 35..46: every one crosses CSA (4) and
    # HCA (8) compression windows and the 8-token sliding window while batched
    lengths = [3, 9, 14, 22]
    prompts = [prompt(name, n, 10 + n) for n in lengths]
    params = [SamplingParams(max_tokens=24 - 2 * i, temperature=0.0, ignore_eos=True, logprobs=0)
              for i in range(len(prompts))]
    alone = [engine(folders, name).generate([p], [sp])[0] for p, sp in zip(prompts, params)]
    eng = engine(folders, name, max_num_batched_tokens=16)  # prefill chunks next to decodes
    together = eng.generate(prompts, params)
    for a, b in zip(alone, together):
        assert a.token_ids == b.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5
    assert eng.runner.num_states == 0


def test_preempted_sequences_are_recomputed_from_scratch(folders):
    name = "hca_hc4"
    prompts = [prompt(name, 10, 20 + i) for i in range(3)]
    alone = [engine(folders, name).generate([p], GREEDY)[0].token_ids for p in prompts]
    # 3 x 34 tokens need 27 blocks of 4; 16 make the scheduler preempt
    eng = engine(folders, name, block_size=4, num_kv_blocks=16)
    together = eng.generate(prompts, GREEDY)
    assert eng.scheduler.num_preemptions > 0
    assert [o.token_ids for o in together] == alone
    assert eng.runner.num_states == 0


SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}


def _json_run(eng: Engine, spec_seed: int | None) -> list:
    prompts = [eng.tokenizer.encode('Return {"name": "Ada", "age": 36, "ok": true}'),
               eng.tokenizer.encode("the JSON for Bo, 7 years old")]
    compiled = grammars.compile(grammars.JsonSchema(SCHEMA), eng.tokenizer,
                                vocab_size=eng.model.config.vocab_size)
    params = SamplingParams(max_tokens=60, temperature=0.0) if spec_seed is None else \
        SamplingParams(max_tokens=60, temperature=0.8, seed=spec_seed)
    return eng.generate(prompts, params, constraints=[compiled.matcher() for _ in prompts])


@pytest.mark.parametrize("name, spec", [("all_layers_mtp", "none"), ("hca_hc4", "none"),
                                        ("all_layers_mtp", "mtp")])
def test_json_schema_constrained_generation(folders, name, spec):
    # greedy and sampled; under "mtp" sampled drafts come from the masked MTP distribution
    eng = engine(folders, name, spec=SpecConfig(method=spec, scheduled=False, min_confidence=0.0))
    outs = _json_run(eng, None) + _json_run(eng, 3)
    for out in outs:
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), SCHEMA)
    if spec == "mtp":
        assert eng.runner.stats.mtp_positions > 0 and sum(o.metrics.num_draft_tokens for o in outs) > 0


def _spec_case(folders, name: str, method: str, constrained: bool):
    plain = engine(folders, name)
    spec = engine(folders, name, spec=SpecConfig(method=method, scheduled=False, min_confidence=0.0))
    if constrained:
        return _json_run(plain, None), _json_run(spec, None), spec
    prompts = [prompt(name, 6, 30) * 3, prompt(name, 13, 31), prompt(name, 4, 32) * 5]
    return plain.generate(prompts, GREEDY), spec.generate(prompts, GREEDY), spec


@pytest.mark.parametrize("constrained", [False, True], ids=["text", "json"])
@pytest.mark.parametrize("name, method", [("all_layers_mtp", "mtp"), ("csa_sigmoid_yarn_mtp", "mtp"),
                                          ("all_layers_mtp", "prompt_lookup"),
                                          ("hca_hc4", "prompt_lookup")])
def test_speculative_greedy_output_is_identical(folders, name, method, constrained):
    plain, spec, eng = _spec_case(folders, name, method, constrained)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    drafted = sum(o.metrics.num_draft_tokens for o in spec)
    accepted = sum(o.metrics.num_accepted_draft_tokens for o in spec)
    assert drafted > accepted  # drafts were verified, and some were rejected
    stats = eng.runner.stats
    # rejected drafts were rolled back, some across a compression boundary (a
    # window's entry emitted by the verification pass, then dropped)
    assert stats.truncations > 0 and stats.truncations_across_compression > 0
    if method == "mtp":
        assert stats.mtp_positions > 0


def test_mtp_state_follows_accepts_and_rollbacks(folders, monkeypatch):
    """Drafts accepted (an oracle swaps in the target's own token at 2 of 3 steps)
    and rejected alike leave the MTP layer where a from-scratch MTP pass over the
    sequence puts it: its window never keeps a rolled-back token, and accepted
    positions are read in order."""
    name = "all_layers_mtp"
    ids = prompt(name, 11, 40)
    target = engine(folders, name).generate([ids], GREEDY)[0].token_ids
    eng = engine(folders, name, spec=SpecConfig(method="mtp", scheduled=False, min_confidence=0.0))
    mtp_drafts = eng.speculative.mtp.propose_batch

    def oracle(seqs):
        drafts = mtp_drafts(seqs)  # the MTP layer runs (and advances) as ever
        for seq, draft in zip(seqs, drafts):
            j = seq.num_output_tokens
            if draft.tokens and j % 3 and j < len(target):
                draft.tokens[0] = target[j]
        return drafts

    monkeypatch.setattr(eng.speculative.mtp, "propose_batch", oracle)
    rid = eng.add_request(ids, GREEDY)
    seq = eng.output.requests[rid]
    while seq.num_output_tokens < 17:
        eng.step()
    assert tuple(seq.output_ids) == target[:seq.num_output_tokens]
    assert seq.num_uncomputed_tokens == 1
    assert seq.num_accepted_draft_tokens >= 4 and eng.runner.stats.truncations >= 2
    got = eng.runner.mtp_logits([seq])[0]
    model, tokens = eng.model, torch.tensor(seq.token_ids)
    k = len(tokens) - 1
    with torch.no_grad():
        state = model.new_state()
        hidden = model(tokens[:k], torch.arange(k), [state], [k])
        want = model.mtp_logits(hidden, tokens[1:], torch.arange(k), [state], [k])[-1]
    assert (got - want).abs().max().item() <= 1e-5


class DeadEndOnce(BaseConstraint):
    """A LogitsConstraint that allows every token, meets a dead end after ``length``
    tokens and asks to roll ``back`` tokens back (as an end check that fails does);
    the second time there, it ends."""

    def __init__(self, length: int, back: int) -> None:
        self.length, self.back = length, back
        self.accepted: list[int] = []
        self.rolled_back = False

    def _at_end(self) -> bool:
        return len(self.accepted) >= self.length

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0 if self._at_end() and not self.rolled_back else -1

    def accept(self, token_id: int) -> bool:
        self.accepted.append(token_id)
        return True

    def rollback(self, num_tokens: int) -> None:
        del self.accepted[len(self.accepted) - num_tokens:]
        self.rolled_back = True

    def rollback_hint(self) -> int:
        return self.back if self._at_end() and not self.rolled_back else 0

    def is_terminated(self) -> bool:
        return self._at_end() and self.rolled_back

    def forced_tokens(self) -> list[int]:
        return []

    def valid_prefix(self, draft: list[int]) -> int:
        return len(draft)


def test_constraint_rollback_past_max_rollback_restores_the_state(folders):
    """A dead end backed out of 20 tokens deep (more than the state can truncate):
    the runner restores its snapshot and recomputes; the output's logprobs are
    transformers' full forward over it."""
    name = "all_layers_mtp"
    ids = prompt(name, 70, 60)  # a snapshot is taken at 70 (every 64 committed tokens)
    eng = engine(folders, name)
    out, = eng.generate([ids], SamplingParams(max_tokens=40, temperature=0.0, logprobs=0,
                                              ignore_eos=True),
                        constraints=[DeadEndOnce(length=24, back=20)])
    assert out.finish_reason == "stop" and len(out.token_ids) == 24
    stats = eng.runner.stats
    assert stats.restores == 1 and stats.recomputed_tokens == 3  # snapshot at 70, back to 73
    full = torch.log_softmax(reference_logits(folders[name][1], ids + list(out.token_ids)), dim=-1)
    want = full[len(ids) - 1:-1].gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    got = torch.tensor([lp.logprob for lp in out.logprobs])
    assert (got - want).abs().max().item() <= ATOL


def test_rollback_past_max_rollback_restores_a_snapshot(folders):
    """A rollback farther than the state can truncate (a constraint dead end deep in
    the output) restores the newest snapshot before it and recomputes from there."""
    name = "all_layers_mtp"
    eng = engine(folders, name)
    runner = DeepseekV4Runner(eng.model, max_rollback=4, snapshot_interval=8)
    ids = prompt(name, 40, 50)
    seq = make_seq(ids)

    def run(n: int) -> torch.Tensor:
        logits = runner.execute([ScheduledSeq(seq=seq, num_tokens=n)], all_logits=True)
        seq.num_computed_tokens += n
        return logits

    straight = torch.cat([run(17), run(1), run(12)])  # a snapshot at 17 (every 8 or more)
    seq.num_computed_tokens = 21  # back 9 tokens: more than max_rollback
    again = run(9)
    assert runner.stats.restores == 1 and runner.stats.recomputed_tokens == 4
    assert (again - straight[21:]).abs().max().item() <= 1e-5
    seq.num_computed_tokens = 2  # before every snapshot: recomputed from scratch
    assert (run(28) - straight[2:]).abs().max().item() <= 1e-5
    assert runner.stats.restores == 2 and runner.stats.recomputed_tokens == 6
    runner.release(seq)
    assert runner.num_states == 0


def test_formcast_load_extracts_a_valid_object(folders):
    """The SDK on a DeepSeek-V4 folder: chat template, grammar, engine, validation."""
    from typing import Annotated

    from pydantic import BaseModel, Field

    import formcast

    class Person(BaseModel):
        name: Annotated[str, Field(max_length=6)]
        age: Annotated[int, Field(ge=0, le=99)]
        ok: bool

    llm = formcast.load(str(folders["hca_hc4"][0]), device="cpu")
    person = llm.extract("Ada, 36, is ok", Person, max_tokens=60)
    assert isinstance(person, Person) and len(person.name) <= 6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bfloat16_engine_runs_the_same_model(folders):
    """The engine on CUDA (bfloat16 weights): logits close to float32 on the CPU,
    JSON-constrained output valid, MTP speculation verified and rolled back."""
    name = "all_layers_mtp"
    cpu = engine(folders, name)
    gpu = Engine.from_pretrained(str(folders[name][0]), device="cuda",
                                 spec=SpecConfig(method="mtp", scheduled=False, min_confidence=0.0))
    assert gpu.dtype == torch.bfloat16
    ids = prompt(name, 40, 7)
    want = cpu.forward_logits(ids)
    got = gpu.forward_logits(ids).float().cpu()
    scale = want.abs().max().item()
    close = ((got - want).abs().amax(dim=-1) <= 0.1 * scale).float().mean().item()
    assert close >= 0.9, f"only {close:.0%} of positions within 10% of the logit scale"
    outs = _json_run(gpu, None) + _json_run(gpu, 3)
    for out in outs:
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0
    assert gpu.runner.stats.mtp_positions > 0

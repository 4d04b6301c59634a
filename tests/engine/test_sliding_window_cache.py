"""Sliding-window layers' KV cache: bounded blocks, exact outputs, prefix hits.

A tiny Llama-family model with a sliding window (every layer, Mistral's way, or
some layers, Gemma 3's way) is held against transformers' Ministral model (the
same weights, per-layer sliding or full attention), and the engine with its
sliding blocks freed against itself with them kept.
"""

from __future__ import annotations

import pytest
import torch

from formcast.engine import Engine, EngineConfig, SamplingParams
from formcast.engine.block_manager import NULL_BLOCK
from formcast.engine.kv_groups import GroupedBlockManager, KVGroup, group_layers, window_blocks
from formcast.engine.models.decoder_config import DecoderConfig
from formcast.engine.models.llama import LlamaForCausalLM
from formcast.engine.tokenizer import Tokenizer
from tests.engine.deepseek_v4_helpers import _one_thread  # noqa: F401  (autouse)
from tests.engine.helpers import make_seq

VOCAB, WINDOW, BS = 64, 8, 4
LAYERS = {
    "mistral": ("sliding_attention",) * 4,
    "gemma_like": ("sliding_attention", "sliding_attention", "full_attention",
                   "sliding_attention"),
}


def reference(kinds: tuple[str, ...]):
    """transformers' MinistralForCausalLM, seeded random weights, float32."""
    from transformers import MinistralConfig, MinistralForCausalLM

    torch.manual_seed(0)
    cfg = MinistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=len(kinds), num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                          sliding_window=WINDOW, layer_types=list(kinds), rope_theta=10000.0,
                          tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    return MinistralForCausalLM(cfg).eval()


def ours(ref, kinds: tuple[str, ...]) -> LlamaForCausalLM:
    c = ref.config
    model = LlamaForCausalLM(DecoderConfig(
        vocab_size=VOCAB, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps, max_position_embeddings=512, sliding_window=WINDOW,
        layer_types=kinds))
    model.load_weights(dict(ref.state_dict()))
    return model.eval()


def tokenizer() -> Tokenizer:
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    backend = Backend(WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t1"))
    backend.pre_tokenizer = WhitespaceSplit()
    return Tokenizer(backend, bos_token_id=None, eos_token_id=0)


@pytest.fixture(scope="module")
def models():
    out = {}
    for name, kinds in LAYERS.items():
        ref = reference(kinds)
        out[name] = ref, ours(ref, kinds)
    return out


def engine(model: LlamaForCausalLM, **config) -> Engine:
    base = dict(block_size=BS, num_kv_blocks=256, spec="none", max_num_batched_tokens=16,
                max_num_seqs=4)
    return Engine(model, tokenizer(), config=EngineConfig(**{**base, **config}),
                  device=torch.device("cpu"))


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (n,), generator=g).tolist()


GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("windows, expected", [
    ((None, None), [(None, (0, 1))]),
    ((8, 8, 8), [(8, (0, 1, 2))]),
    ((8, 8, None, 8, 4), [(None, (2,)), (4, (4,)), (8, (0, 1, 3))]),
])
def test_layers_group_by_window_full_attention_first(windows, expected):
    assert [(g.window, g.layers) for g in group_layers(windows)] == expected


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_logits_match_transformers_over_several_windows(models, name):
    ref, model = models[name]
    ids = prompt(40, seed=1)  # five windows; chunks of 16 tokens start mid-window
    got = engine(model).forward_logits(ids)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].float()
    assert (got - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_greedy_generation_matches_transformers(models, name):
    ref, model = models[name]
    ids = prompt(20, seed=2)
    out = engine(model).generate([ids], SamplingParams(max_tokens=32, **GREEDY))[0]
    with torch.no_grad():
        want = ref.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                            min_new_tokens=32)[0, len(ids):].tolist()
    assert list(out.token_ids) == want


def run_holding(eng: Engine, ids: list[int], max_tokens: int) -> tuple[list[int], list[list[int]]]:
    """Greedy tokens of ``ids`` and the blocks its request held in each KV group
    after every step."""
    eng.add_request(ids, SamplingParams(max_tokens=max_tokens, **GREEDY))
    held, out = [], None
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o
        for seq in eng.scheduler.running:
            held.append(eng.block_manager.held_blocks(seq))
    return list(out.token_ids), held


@pytest.mark.parametrize("name, spec", [("mistral", "none"), ("gemma_like", "none"),
                                        ("gemma_like", "prompt_lookup")])
def test_long_generation_holds_a_window_of_sliding_blocks(models, name, spec):
    _, model = models[name]
    ids = prompt(24, seed=3) * 2  # (repeats: prompt lookup drafts, and rolls some back)
    freed, held = run_holding(engine(model, spec=spec), ids, 160)
    kept, held_kept = run_holding(engine(model, spec=spec, free_out_of_window_blocks=False),
                                  ids, 160)
    assert freed == kept
    groups = group_layers(tuple(model.config.window(i) for i in range(len(LAYERS[name]))))
    sliding = [g for g, group in enumerate(groups) if group.window is not None]
    bound = window_blocks(WINDOW, 16, BS, lookahead=16)  # (spec's margin: max(16, draft + 1))
    assert max(h[g] for h in held for g in sliding) <= bound
    # kept, they grow with the context: 208 tokens, 52 blocks
    assert max(h[g] for h in held_kept for g in sliding) >= (len(ids) + 150) // BS
    if len(groups) > 1:  # the full group keeps every block either way
        assert max(h[0] for h in held) >= (len(ids) + 150) // BS


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_prefix_hit_on_a_long_shared_prefix_gives_the_cold_outputs(models, name):
    _, model = models[name]
    shared = prompt(96, seed=4)  # twelve windows
    first, second = shared + prompt(5, seed=5), shared + prompt(7, seed=6)
    params = SamplingParams(max_tokens=24, **GREEDY)
    warm = engine(model)
    warm.generate([first], params)
    hit = warm.generate([second], params)[0]
    cold = engine(model, enable_prefix_caching=False).generate([second], params)[0]
    assert hit.token_ids == cold.token_ids
    assert hit.metrics.num_cached_prompt_tokens == len(shared)  # (96: whole blocks)
    assert cold.metrics.num_cached_prompt_tokens == 0
    assert warm.block_manager.replayed_tokens <= WINDOW


# (all sliding: a small pool; with a full group: sized from the memory, the sliding
# pool holding two requests' windows and the full group the rest)
EVICTING = {"mistral": dict(num_kv_blocks=24),
            "gemma_like": dict(num_kv_blocks=None, max_num_seqs=2)}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_a_prefix_hit_after_its_window_was_evicted_recomputes_to_the_cold_outputs(models, name):
    """Another request cycles the sliding pool, evicting the shared prefix's windows
    (the full group still holds the prefix): the hit falls back to the start and
    the prefix is computed again, with the cold run's outputs."""
    _, model = models[name]
    shared = prompt(96, seed=4)
    first, second = shared + prompt(5, seed=5), shared + prompt(7, seed=6)
    params = SamplingParams(max_tokens=24, **GREEDY)
    warm = engine(model, **EVICTING[name])
    bm = warm.block_manager
    sliding = [m.num_blocks for m in bm.managers if m.window is not None]
    warm.generate([first], params)
    warm.generate([prompt(max(sliding) * BS + 8, seed=7)], params)
    hit = warm.generate([second], params)[0]
    cold = engine(model, enable_prefix_caching=False).generate([second], params)[0]
    assert hit.token_ids == cold.token_ids
    assert hit.metrics.num_cached_prompt_tokens == 0
    # the full group had the prefix: its 96 tokens are replayed (none without one)
    assert bm.replayed_tokens == (len(shared) if len(bm.managers) > 1 else 0)


def seq_of(n: int, seed: int, rid: str):
    return make_seq(prompt(n, seed), rid=rid)


def computed(bm: GroupedBlockManager, seq, n: int) -> None:
    """``n`` more tokens of ``seq`` computed, as a step would."""
    bm.grow(seq, n)
    seq.num_computed_tokens += n
    bm.commit(seq)


@pytest.mark.parametrize("free, expected_first", [(True, (40 - 4 - 8 + 1) // BS), (False, 0)])
def test_blocks_behind_the_window_and_margin_are_released(free, expected_first):
    bm = GroupedBlockManager((KVGroup(window=WINDOW, layers=(0,), num_blocks=32),), BS,
                             margin=4, free_out_of_window=free)
    seq = seq_of(41, 7, "a")
    for _ in range(10):
        computed(bm, seq, 4)
    table = seq.block_table
    first_held = next(i for i, b in enumerate(table) if b != NULL_BLOCK)
    assert first_held == expected_first
    assert all(b == NULL_BLOCK for b in table[:first_held])
    assert bm.held_blocks(seq) == [len(table) - first_held]


def mixed(sliding_blocks: int = 64) -> GroupedBlockManager:
    return GroupedBlockManager((KVGroup(window=None, layers=(1,), num_blocks=64),
                                KVGroup(window=WINDOW, layers=(0,), num_blocks=sliding_blocks)),
                               BS, margin=0)


def test_a_prefix_hit_takes_only_the_window_of_sliding_blocks():
    bm = mixed()
    a = seq_of(41, 8, "a")
    computed(bm, a, 41)
    bm.free(a)
    b = make_seq(a.token_ids[:40] + [3, 4, 5], rid="b")
    assert bm.allocate_prefix(b) == 40
    assert bm.held_blocks(b) == [10, WINDOW // BS]
    assert bm.replayed_tokens == 0


def test_an_evicted_window_shortens_the_hit_and_the_full_group_replays():
    bm = mixed(sliding_blocks=16)
    a = seq_of(33, 9, "a")
    computed(bm, a, 33)
    bm.free(a)
    # another request takes 14 of the sliding pool's 15 blocks: the never used
    # first, then a's released ones, oldest first, its last window among them
    other = seq_of(56, 10, "other")
    bm.grow(other, 56)
    b = make_seq(a.token_ids[:32] + [3], rid="b")
    assert bm.allocate_prefix(b) == 0
    assert bm.replayed_tokens == 32  # the full group had all of it
    assert bm.held_blocks(b) == [0, 0]


@pytest.mark.parametrize("back, recomputes", [(4, False), (20, True)])
def test_a_rollback_past_the_margin_recomputes_from_the_start(back, recomputes):
    bm = GroupedBlockManager((KVGroup(window=WINDOW, layers=(0,), num_blocks=32),), BS,
                             margin=4)
    seq = seq_of(48, 11, "a")
    for _ in range(12):
        computed(bm, seq, 4)
    bm.truncate(seq, 48 - back)
    assert seq.num_computed_tokens == (0 if recomputes else 48 - back)
    assert (bm.held_blocks(seq) == [0]) == recomputes


def test_deepseek_v4_keeps_its_sliding_window_bounded_in_its_state():
    # V4 keeps its SWA keys in each request's state, not in paged blocks: the last
    # window - 1 + max_rollback rows, however long the sequence grows
    from tests.engine.deepseek_v4_helpers import our_model, reference_model, run_chunks

    model = our_model(reference_model(seed=0))
    window, rollback = model.config.sliding_window, 4
    state = model.new_state(max_rollback=rollback)
    tokens = torch.randint(1, model.config.vocab_size, (64,),
                           generator=torch.Generator().manual_seed(12))
    rows = []
    for n in [16] + [1] * 48:
        run_chunks(model, tokens, [n], state)
        rows.append(max(layer.window.shape[0] for layer in state.layers))
    assert state.num_tokens == 64
    assert max(rows) == window - 1 + rollback


@pytest.mark.parametrize("back", [8, 30])  # within the margin (16), and past it
def test_a_dead_end_backed_out_of_gives_the_outputs_of_kept_blocks(models, back):
    from tests.engine.test_deepseek_v4_engine import DeadEndOnce

    _, model = models["gemma_like"]
    ids = prompt(30, seed=13)
    params = SamplingParams(max_tokens=60, logprobs=0, **GREEDY)
    outs = [engine(model, free_out_of_window_blocks=free).generate(
                [ids], params, constraints=[DeadEndOnce(length=48, back=back)])[0]
            for free in (True, False)]
    assert outs[0].finish_reason == "stop" and len(outs[0].token_ids) == 48
    assert outs[0].token_ids == outs[1].token_ids
    # (past the margin the sequence is computed again as a prompt, whose attention
    # rounds apart from a decode step's, as a preempted request's recompute does)
    diff = max(abs(a.logprob - b.logprob) for a, b in zip(outs[0].logprobs, outs[1].logprobs))
    assert diff <= 1e-5


@pytest.mark.parametrize("windows, expected", [
    ((None, None), [2000 // 2]),          # one full group: all the memory
    ((8, 8), [2000 // 2]),                # one sliding group: all of it too
    # a sliding group: 2 sequences' windows (8 + margin 4 + lookahead 4: 4 blocks,
    # +1) and a step's 16 tokens (4 blocks), +1; the full group the rest
    ((8, None), [2000 - 15, 15]),
])
def test_pools_are_sized_from_the_memory(windows, expected):
    from formcast.engine.kv_groups import size_groups

    groups = size_groups(group_layers(windows), layer_block_bytes=1, memory=2000,
                         num_blocks=None, max_num_seqs=2, margin=4, block_size=BS,
                         lookahead=4, step_tokens=16)
    assert [g.num_blocks for g in groups] == expected

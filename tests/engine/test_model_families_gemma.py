"""Gemma 3 270M (Q4_K_M GGUF: Q4_K, Q5_0, Q6_K and Q8_0 tensors), real weights,
against transformers loading the same GGUF: logits within 1e-3 in float32 and
greedy generation identical for 32 tokens, one prompt longer than the sliding
window (512). The file is fetched into the formcast cache on first use (as
``formcast pull gemma3-270m`` does). Token ids only: the tokenizer is not under test.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from formcast.engine import Engine, SamplingParams
from formcast.engine.config import EngineConfig
from formcast.engine.hub import ModelSource, resolve_model
from formcast.engine.loader import load_checkpoint
from formcast.engine.loading import build_model

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

FILE = "gemma-3-270m-q4_k_m.gguf"
PROMPT = [2, 818, 5279, 529, 7001, 563]  # <bos>The capital of France is
GENERATED = 32


@pytest.fixture(scope="module")
def gemma_gguf() -> Path:
    """The registry's Gemma 3 270M GGUF, fetched and checked on first use."""
    path = Path(resolve_model("gemma3-270m").path)
    assert path.name == FILE
    return path


@pytest.fixture(scope="module")
def reference(gemma_gguf: Path):
    """transformers' Gemma3ForCausalLM from the same GGUF (a few minutes: its
    reader parses the 262k-token vocabulary)."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(gemma_gguf.parent), gguf_file=gemma_gguf.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(gemma_gguf: Path) -> Engine:
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    from formcast.engine.tokenizer import Tokenizer

    ckpt = load_checkpoint(ModelSource(name="gemma3-270m", kind="gguf", path=gemma_gguf))
    model = build_model(ckpt.config, ckpt.weights, device=torch.device("cpu"),
                        dtype=torch.float32)
    vocab = ckpt.config.vocab_size
    ids_only = Tokenizer(Backend(models.WordLevel({f"<{i}>": i for i in range(vocab)},
                                                  unk_token="<0>")),
                         bos_token_id=2, eos_token_id=None)
    return Engine(model, ids_only, config=EngineConfig(spec="none", num_kv_blocks=128))


def _long_prompt() -> list[int]:
    """600 tokens: a random run of ordinary ids, then the short prompt again."""
    gen = torch.Generator().manual_seed(0)
    return [2] + torch.randint(300, 20000, (594,), generator=gen).tolist() + PROMPT[1:]


def test_config_is_gemma3_270m(engine: Engine) -> None:
    config = engine.model.config
    assert (config.architecture, config.num_hidden_layers, config.sliding_window) == \
        ("gemma3", 18, 512)
    assert config.layer_types.count("full_attention") == 3


def test_logits_match_transformers_on_the_same_gguf(engine: Engine, reference) -> None:
    with torch.no_grad():
        want = reference(torch.tensor([PROMPT])).logits[0]
    got = engine.forward_logits(PROMPT)
    assert (got - want).abs().max().item() <= 1e-3


@pytest.mark.parametrize("prompt", [PROMPT, _long_prompt()], ids=["short", "past-window"])
def test_greedy_generation_matches_transformers(engine: Engine, reference, prompt) -> None:
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(
            1, len(prompt), dtype=torch.long), max_new_tokens=GENERATED, do_sample=False,
            eos_token_id=None, pad_token_id=0)
    want = out[0, len(prompt):].tolist()
    got = engine.generate([prompt], SamplingParams(max_tokens=GENERATED, temperature=0.0,
                                                   ignore_eos=True))[0]
    assert list(got.token_ids) == want

"""Fixtures for grammar tests: a tiny synthetic vocabulary and the real SmolLM2 tokenizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from formcast.grammars import GrammarCompiler, Vocabulary

EOS = 0
PAD_SPECIAL = 1
# Multi-byte tokens a real BPE vocabulary would have: JSON punctuation runs, keywords,
# a whole accented character next to its two byte tokens, a special token's text.
_MERGED = ['{"', '":', '",', '"}', '":"', '"]', '["', 'true', 'false', 'null', 'name', '"name"',
           'age', 'ab', 'abab', '12', '123', ' the', 'yes', 'no', 'é', ',"', '},', '[{', '}]',
           '0.', 'e+', '-1', '<|im_start|>', 'ABC', '2024']


def synthetic_tokens() -> list[bytes]:
    """Token 0 is eos, 1 a special token, then all 256 single bytes, then merges."""
    return [b"<eos>", b"<|special|>"] + [bytes([b]) for b in range(256)] + [
        m.encode("utf-8") for m in _MERGED]


@pytest.fixture(scope="session")
def tiny_vocab() -> Vocabulary:
    """About 290 tokens, padded to a logits width of 320 (ids 289.. are padding)."""
    tokens = synthetic_tokens()
    return Vocabulary.from_tokens(tokens, eos_token_ids=[EOS], special_token_ids=[PAD_SPECIAL],
                                  vocab_size=320)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from formcast.engine import load_tokenizer

    return load_tokenizer("smollm2")


@pytest.fixture(scope="session")
def compiler():
    """One compiler for the whole session, so each constraint compiles once."""
    c = GrammarCompiler(timeout_s=60.0)
    yield c
    c.close()


def allowed_ids(bitmask: torch.Tensor, row: int, vocab_size: int) -> np.ndarray:
    """Token ids whose bit is set in ``bitmask[row]``."""
    words = bitmask[row].numpy().view(np.uint8)
    bits = np.unpackbits(words, bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


def bit_set(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token >> 5]) >> (token & 31)) & 1)


def segment_ids(vocab: Vocabulary, text: str) -> list[int]:
    """Token ids that spell ``text`` in ``vocab`` (the text must be spellable)."""
    ids = vocab.segment(text.encode("utf-8"))
    assert ids is not None
    return ids


def matcher_mask(matcher, compiled) -> torch.Tensor:
    """A fresh one-row bitmask filled by ``matcher``."""
    bitmask = compiled.allocate_bitmask(1)
    matcher.fill_bitmask(bitmask, 0)
    return bitmask[0].clone()

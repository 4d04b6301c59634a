"""Random mask-respecting walks, checked by oracles independent of the backends.

Each walk samples uniformly among the tokens the mask allows until a stop token
(or a length cap). Every finished walk must decode as UTF-8 and pass the case's
oracle (``re.fullmatch``, ``jsonschema``, ``lark``); no walk may dead-end unless
part of its schema is checked only at the end (``explain``'s "end" keywords); the
mask never offers special or padded ids.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from .cases import BOTH, CASES, Case
from .conftest import allowed_ids

WALKS = 200
CAP = {"tiny": 160, "smollm2": 64}

PARAMS = [pytest.param(case, backend, id=f"{case.id}-{backend}")
          for case in CASES if case.walk for backend in BOTH if backend in case.backends]


def _walks(case: Case, backend: str, compiled, cap: int) -> dict[str, int]:
    vocab = compiled.vocab
    eos = vocab.eos_token_ids
    forbidden = vocab.special_token_ids - eos
    rng = np.random.default_rng(zlib.crc32(f"{case.id}/{backend}".encode()))
    bitmask = compiled.allocate_bitmask(1)
    counts = {"done": 0, "dead": 0, "capped": 0}
    for _ in range(WALKS):
        m = compiled.matcher()
        parts: list[bytes] = []
        outcome = "capped"
        for _ in range(cap):
            m.fill_bitmask(bitmask, 0)
            ids = allowed_ids(bitmask, 0, vocab.vocab_size)
            if len(ids) == 0:
                outcome = "dead"
                break
            assert ids[-1] < vocab.tokenizer_size, "a padded id is allowed"
            assert not forbidden.intersection(ids.tolist()), "a special token is allowed"
            token = int(rng.choice(ids))
            assert m.accept(token), f"allowed token {token} rejected after {b''.join(parts)!r}"
            if token in eos:
                outcome = "done"
                break
            parts.append(vocab.token_bytes[token])
        counts[outcome] += 1
        if outcome == "done":
            assert m.is_terminated()
            text = b"".join(parts).decode("utf-8")   # raises on a broken UTF-8 sequence
            assert case.oracle(text), f"{case.id}/{backend}: oracle rejects {text!r}"
    if compiled.end_check is None:
        assert counts["dead"] == 0, counts
        assert counts["done"] >= WALKS // 10, f"too few walks finished: {counts}"
    else:
        # Termination is refused until the document validates: dead ends are allowed,
        # invalid outputs are not.
        assert counts["done"] >= 1, f"no walk finished: {counts}"
    return counts


@pytest.mark.parametrize("case,backend", PARAMS)
def test_walks_tiny_vocab(case, backend, compiler, tiny_vocab):
    compiled = compiler.compile(case.constraint, tiny_vocab, backend=backend)
    _walks(case, backend, compiled, CAP["tiny"])


@pytest.mark.parametrize("case,backend", PARAMS)
def test_walks_smollm2(case, backend, compiler, smollm2_tokenizer):
    compiled = compiler.compile(case.constraint, smollm2_tokenizer, backend=backend)
    _walks(case, backend, compiled, CAP["smollm2"])

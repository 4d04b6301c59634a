"""SentencePiece-style vocabularies from GGUF (``tokenizer.ggml.model == "llama"``).

Gemma, Mistral, Llama 2 and Phi-3 files store a SentencePiece BPE vocabulary:
pieces spelled with ``▁`` for a space, one score per piece, ``<0xNN>`` byte pieces
for byte fallback, and a token type per piece (1 normal, 2 unknown, 3 control,
4 user-defined, 6 byte). There are no merges. SentencePiece's BPE joins, at each
step, the adjacent pair whose joined piece scores highest, so the merges are
recovered from the vocabulary: every way of cutting a piece into two pieces
that exist, ranked by the joined piece's score. The Rust BPE then reproduces
SentencePiece's segmentation, with byte fallback for what the vocabulary lacks.

How spaces reach the vocabulary differs by family, and nothing in the file says
which, so the architecture picks it (as transformers does):

- ``gemma*``: every space becomes ``▁``; no space is prepended. Gemma files store
  pieces made only of spaces with real spaces, respelled here with ``▁``, and rank
  merges by the pieces' order in the file.
- ``phi3``: ``▁`` is prepended to every stretch of text between special tokens.
- others (Llama 2, Mistral): ``▁`` is prepended to the first stretch only, unless
  ``tokenizer.ggml.add_space_prefix`` is false.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from formcast.engine.errors import CorruptModelError

SPACE = "\u2581"
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4


def spm_family(architecture: str | None) -> str:
    """``"gemma"``, ``"phi3"`` or ``"llama"``: how a file's architecture handles spaces. Pure."""
    arch = (architecture or "").lower()
    if arch.startswith("gemma"):
        return "gemma"
    return "phi3" if arch == "phi3" else "llama"


def derive_merges(pieces: Sequence[str], rank: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's highest-score-first joining. Pure.

    Parameters
    ----------
    pieces : sequence of str
        The vocabulary, by id; a repeated piece keeps its first id.
    rank : sequence of float
        One per piece: the higher, the earlier a pair joining into it merges.

    Returns
    -------
    list of (str, str)
        Best first. Pairs joining into the same piece are ordered longer left part
        first, then longer right part; equal ranks keep the joined pieces' id order,
        then the parts' ids.
    """
    ids: dict[str, int] = {}
    for i, piece in enumerate(pieces):
        ids.setdefault(piece, i)
    get = ids.get
    found: list[tuple[int, int, int]] = []  # (joined id, left id, right id)
    for piece, i in ids.items():
        for cut in range(1, len(piece)):
            left = get(piece[:cut])
            if left is not None:
                right = get(piece[cut:])
                if right is not None:
                    found.append((i, left, right))
    if not found:
        return []
    joined, left, right = (np.array(column, dtype=np.int64) for column in zip(*found))
    lengths = np.array([len(p) for p in pieces], dtype=np.int64)
    order = np.lexsort((right, left, joined, -lengths[right], -lengths[left],
                        -np.asarray(rank, dtype=np.float64)[joined]))  # last key sorts first
    return [(pieces[left[k]], pieces[right[k]]) for k in order.tolist()]


def spm_backend(meta: Mapping[str, Any], source: str, architecture: str | None) -> _Backend:
    """The Rust tokenizer of a GGUF SentencePiece vocabulary (no bos/eos template yet).

    Parameters
    ----------
    meta : mapping
        The file's ``tokenizer.*`` metadata.
    source : str
        Names the file in error messages.
    architecture : str or None
        ``general.architecture``; picks the space handling (see the module docstring).

    Returns
    -------
    tokenizers.Tokenizer

    Raises
    ------
    CorruptModelError
        Tokens, scores or types missing or of different lengths.
    """
    try:
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    except KeyError as exc:
        raise CorruptModelError(f"{source}: GGUF metadata lacks {exc.args[0]}") from exc
    scores = list(meta.get("tokenizer.ggml.scores") or [])
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(types) != len(tokens) or (scores and len(scores) != len(tokens)):
        raise CorruptModelError(f"{source}: {len(tokens)} tokens, {len(scores)} scores and "
                                f"{len(types)} token types")
    family = spm_family(architecture)
    stored = tokens
    if family == "gemma":
        # all-space pieces are stored with real spaces; text reaches the model as ▁
        tokens = [SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
        rank: Sequence[float] = [-i for i in range(len(tokens))]
    elif scores:
        rank = scores
    else:
        raise CorruptModelError(f"{source}: GGUF metadata lacks tokenizer.ggml.scores")
    vocab: dict[str, int] = {}
    for i, piece in enumerate(tokens):
        vocab.setdefault(piece, i)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    backend = _Backend(models.BPE(vocab=vocab, merges=derive_merges(tokens, rank), unk_token=unk,
                                  fuse_unk=True, byte_fallback=True))
    steps: list[Any] = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if family == "gemma":
        backend.normalizer = normalizers.Replace(" ", SPACE)
    elif family == "phi3":
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE),
                                                   normalizers.Replace(" ", SPACE)])
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    else:
        prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=SPACE, prepend_scheme="first" if prefix else "never", split=False)
        if prefix:
            steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    # the unknown piece is special too: its text in a prompt means the token, as in llama.cpp
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k in (_UNKNOWN, _CONTROL)])
    # a user-defined piece is matched whole in text; one respelled above is not text
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, s, k in zip(tokens, stored, types) if k == _USER_DEFINED and t == s])
    return backend

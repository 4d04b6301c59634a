"""A tokenizer's files: the tokenizer rebuilt from a GGUF's metadata, the HF-folder
copy that caches it next to the file, and loading a tokenizer by name.

From GGUF, a byte-level BPE is rebuilt from ``tokenizer.ggml.tokens`` and
``tokenizer.ggml.merges``, its pre-tokenizer chosen by ``tokenizer.ggml.pre``
(:mod:`.pretokenizers`); a SentencePiece vocabulary from its pieces and scores
(:mod:`.tokenizer_spm`). Control tokens (type 3) become special added tokens and
user-defined ones (type 4) plain added tokens, so both are matched whole in text.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, models
from tokenizers import Tokenizer as _Backend

from formcast.engine.errors import CorruptModelError, ModelNotFoundError, UnsupportedModelError
from formcast.engine.token_spelling import BYTE_TO_CHAR, CHAR_TO_BYTE, set_bos_eos
from formcast.engine.pretokenizers import byte_level_pre_tokenizer
from formcast.engine.tokenizer import Tokenizer
from formcast.engine.tokenizer_spm import spm_backend

_GGUF_CONTROL = 3
_GGUF_USER_DEFINED = 4


def gguf_backend(meta: Mapping[str, Any], source: str) -> tuple[_Backend, dict[str, Any]]:
    """The tokenizer of a GGUF's ``tokenizer.*`` metadata (plus ``general.architecture``),
    and the special token ids (and chat template) :class:`Tokenizer` takes with it.

    ``tokenizer.ggml.model`` picks the kind: ``gpt2`` is byte-level BPE split by
    ``tokenizer.ggml.pre`` (:mod:`.pretokenizers`), ``llama`` a SentencePiece
    vocabulary (:mod:`.tokenizer_spm`). bos is added when ``add_bos_token`` says so;
    a SentencePiece file without the flag adds it, as llama.cpp does.

    Raises
    ------
    CorruptModelError, UnsupportedModelError
        As :meth:`Tokenizer.from_gguf`.
    """
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        backend = _byte_level_backend(meta, source)
    elif kind == "llama":
        backend = spm_backend(meta, source, meta.get("general.architecture"))
    else:
        raise UnsupportedModelError(
            f"{source}: tokenizer.ggml.model={kind!r}; formcast builds byte-level BPE ('gpt2') "
            "and SentencePiece ('llama') tokenizers from GGUF. Load the model's HF folder "
            "(tokenizer.json) instead.")
    size = len(meta["tokenizer.ggml.tokens"])

    def token_id(key: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{key}")
        return int(value) if value is not None and 0 <= int(value) < size else None

    bos, eos = token_id("bos_token_id"), token_id("eos_token_id")
    add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
    set_bos_eos(backend, bos_id=bos if add_bos else None,
                eos_id=eos if meta.get("tokenizer.ggml.add_eos_token") else None)
    extra = [t for t in (token_id("eot_token_id"), token_id("eom_token_id")) if t is not None]
    return backend, {"bos_token_id": bos, "eos_token_id": eos,
                     "pad_token_id": token_id("padding_token_id"),
                     "unk_token_id": token_id("unknown_token_id"), "extra_eos_token_ids": extra,
                     "chat_template": meta.get("tokenizer.chat_template")}


def _byte_level_backend(meta: Mapping[str, Any], source: str) -> _Backend:
    """Byte-level BPE from ``tokenizer.ggml.tokens`` and ``tokenizer.ggml.merges``."""
    pre_tokenizer = byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre", "gpt2"),
                                             source=source)
    try:
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        merge_lines: list[str] = list(meta["tokenizer.ggml.merges"])
    except KeyError as exc:
        raise CorruptModelError(f"{source}: GGUF metadata lacks {exc.args[0]}") from exc
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(types) != len(tokens):
        raise CorruptModelError(f"{source}: {len(tokens)} tokens but {len(types)} token types")

    vocab: dict[str, int] = {}
    for i, (text, ttype) in enumerate(zip(tokens, types)):
        # Ordinary tokens are spelled in the byte alphabet already; an added token keeps
        # its own text so that it maps to its id, never to a fresh one.
        added = ttype in (_GGUF_CONTROL, _GGUF_USER_DEFINED)
        if not added and not set(text) <= CHAR_TO_BYTE.keys():
            text = "".join(BYTE_TO_CHAR[b] for b in text.encode("utf-8"))
        vocab.setdefault(text, i)
    merges = []
    for line in merge_lines:
        cut = line.find(" ", 1)  # a token may begin with a space; the separator cannot
        if cut < 0:
            raise CorruptModelError(f"{source}: malformed merge {line!r}")
        merges.append((line[:cut], line[cut + 1:]))
    backend = _Backend(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k == _GGUF_CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types) if k == _GGUF_USER_DEFINED])
    return backend


def load_tokenizer(name_or_path: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer of a registry model, a GGUF file or an HF folder; loads no weights.

    Parameters
    ----------
    name_or_path : str or path
        As :func:`formcast.engine.hub.resolve_model` takes it; a folder holding only a
        ``tokenizer.json`` also works.

    Returns
    -------
    Tokenizer

    Raises
    ------
    ModelNotFoundError
        Nothing loadable there (or an unknown registry name).
    ModelFetchError
        A registry model had to be fetched and the fetch failed.
    CorruptModelError, UnsupportedModelError
        As :meth:`Tokenizer.from_gguf` / :meth:`Tokenizer.from_hf_dir`.
    """
    from formcast.engine.hub import resolve_model

    path = Path(os.fspath(name_or_path)).expanduser()
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return Tokenizer.from_hf_dir(path)
    source = resolve_model(name_or_path)
    if source.kind == "gguf":
        return cached_gguf_tokenizer(source.path)
    return Tokenizer.from_hf_dir(source.path)


def cached_gguf_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """:meth:`Tokenizer.from_gguf`, served from an HF-folder copy next to the file.

    Parsing a GGUF's vocabulary takes seconds; the copy (``<file>.formcast-tokenizer``,
    stamped with the GGUF's size and mtime) loads in a fraction of that. When the
    folder cannot be written the tokenizer is simply built from the GGUF each time.
    """
    gguf_path = Path(path)
    folder = gguf_path.with_name(gguf_path.name + ".formcast-tokenizer")
    stat = gguf_path.stat()
    stamp = f"{stat.st_size}:{stat.st_mtime_ns}:{_TOKENIZER_CACHE_VERSION}"
    stamp_file = folder / "formcast-stamp"
    if stamp_file.is_file() and stamp_file.read_text() == stamp:
        try:
            return Tokenizer.from_hf_dir(folder)
        except (CorruptModelError, ModelNotFoundError):
            pass  # a damaged copy: rebuild it below
    tokenizer = Tokenizer.from_gguf(gguf_path)
    try:
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        tokenizer.save_pretrained(tmp)
        (tmp / "formcast-stamp").write_text(stamp)
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    except OSError:
        pass
    return tokenizer


_TOKENIZER_CACHE_VERSION = "1"


# ------------------------------------------------------------------ helpers

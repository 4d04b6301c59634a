"""GGUF files carrying one tokenizer family each, written at test time.

- SentencePiece (``tokenizer.ggml.model == "llama"``): a BPE vocabulary trained with
  the ``sentencepiece`` library on Python's own docstrings (byte fallback, a control
  and a user-defined symbol), written as llama.cpp writes one.
- Byte-level BPE (``gpt2``): the first merges of SmolLM2's real vocabulary (a BPE
  vocabulary's prefix is itself a vocabulary: merge k makes token 252 + k there),
  under each ``tokenizer.ggml.pre`` name.
- The real Gemma 3 270M file, and transformers' tokenizer for it saved once in the
  cache (building it from the 262k-piece GGUF costs transformers most of a minute).
"""

from __future__ import annotations

import inspect
import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import gguf

from formcast.engine.gguf_metadata import read_gguf_metadata

# GGUF token types, as llama.cpp writes them.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6
SMOLLM2_FIRST_MERGED_ID = 252


def write_tokenizer_gguf(path: Path, architecture: str, meta: Mapping[str, Any]) -> Path:
    """A GGUF with no tensors: a one-layer shape for ``architecture`` and ``meta``'s keys."""
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(8)
    writer.add_head_count(1)
    for key, value in meta.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif key.endswith("scores"):
            writer.add_array(key, [float(v) for v in value])
        elif key.endswith("token_type"):
            writer.add_array(key, [int(v) for v in value])
        else:
            writer.add_array(key, list(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _training_text() -> list[str]:
    import argparse
    import collections
    import json
    import pathlib
    import re
    import textwrap

    lines: list[str] = []
    for module in (json, re, collections, argparse, pathlib, textwrap, inspect):
        lines += (inspect.getdoc(module) or "").splitlines()
        for obj in vars(module).values():
            doc = inspect.getdoc(obj) if callable(obj) else None
            lines += (doc or "").splitlines()
    return [line for line in lines if line.strip()]


def sentencepiece_model(*, vocab_size: int = 1200) -> Any:
    """A SentencePiece BPE trained here (byte fallback, ``[INST]``/``[/INST]`` control
    symbols, ``<tool_call>`` user-defined), as a ``SentencePieceProcessor``."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_training_text()), model_writer=model, vocab_size=vocab_size,
        model_type="bpe", byte_fallback=True, character_coverage=0.9995, num_threads=1,
        user_defined_symbols=["<tool_call>"], control_symbols=["[INST]", "[/INST]"],
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, split_digits=True,
        remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
        normalization_rule_name="identity", minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def sentencepiece_meta(sp: Any) -> dict[str, Any]:
    """``tokenizer.*`` metadata of :func:`sentencepiece_model`'s model, as llama.cpp
    writes a SentencePiece vocabulary."""
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    types = [UNKNOWN if sp.is_unknown(i) else CONTROL if sp.is_control(i) else
             BYTE if sp.is_byte(i) else USER_DEFINED if p == "<tool_call>" else NORMAL
             for i, p in enumerate(pieces)]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.tokens": pieces,
            "tokenizer.ggml.scores": [sp.get_score(i) for i in range(len(pieces))],
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
            "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": False}


def byte_level_meta(smollm2_gguf: Path, pre: str, *, merges: int = 4000) -> dict[str, Any]:
    """``tokenizer.*`` metadata: SmolLM2's specials, bytes and first ``merges`` merges."""
    meta = read_gguf_metadata(smollm2_gguf, keep=("tokenizer.",))
    size = SMOLLM2_FIRST_MERGED_ID + merges
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": meta["tokenizer.ggml.tokens"][:size],
            "tokenizer.ggml.token_type": meta["tokenizer.ggml.token_type"][:size],
            "tokenizer.ggml.merges": meta["tokenizer.ggml.merges"][:merges],
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.padding_token_id": 2, "tokenizer.ggml.add_bos_token": False}


def hf_from_gguf(path: Path) -> Any:
    """transformers' tokenizer for the GGUF at ``path`` (the oracle)."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def cached_hf_from_gguf(path: Path, cache: Path) -> Any:
    """:func:`hf_from_gguf`, saved by transformers under ``cache`` and reloaded from
    there later (keyed by transformers' version and the file's size)."""
    import transformers

    folder = cache / f"transformers-{transformers.__version__}" / f"{path.name}-{path.stat().st_size}"
    if not (folder / "tokenizer.json").is_file():
        tmp = folder.with_name(folder.name + ".tmp")
        hf_from_gguf(path).save_pretrained(tmp)
        tmp.replace(folder)
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def hf_ids(out: Any) -> list[int]:
    """Token ids from whatever transformers' ``apply_chat_template(tokenize=True)`` returned."""
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def pieces_of(pre_tokenizer: Any, texts: Sequence[str]) -> list[list[str]]:
    """The pieces a ``tokenizers`` pre-tokenizer cuts each text into."""
    return [[piece for piece, _ in pre_tokenizer.pre_tokenize_str(t)] for t in texts]

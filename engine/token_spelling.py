"""How a tokenizer's vocabulary strings spell bytes, and its special-token template.

Byte-level BPE writes each byte as one printable character (GPT-2's alphabet);
SentencePiece writes spaces as U+2581 and unknown bytes as ``<0xNN>``. The
functions here read a ``tokenizer.json`` decoder to tell which.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from tokenizers import Tokenizer as _Backend
from tokenizers import processors


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


BYTE_TO_CHAR: Mapping[int, str] = MappingProxyType(_byte_alphabet())
CHAR_TO_BYTE: Mapping[str, int] = MappingProxyType({c: b for b, c in BYTE_TO_CHAR.items()})


def set_bos_eos(backend: _Backend, *, bos_id: int | None, eos_id: int | None) -> None:
    """Make ``encode(add_special_tokens=True)`` add bos and/or eos (or nothing)."""
    if bos_id is None and eos_id is None:
        backend.post_processor = None
        return
    bos = [f"{backend.id_to_token(bos_id)}"] if bos_id is not None else []
    eos = [f"{backend.id_to_token(eos_id)}"] if eos_id is not None else []
    single = [*bos, "$A", *eos]
    pair = [*single, *(f"{t}:1" for t in bos), "$B:1", *(f"{t}:1" for t in eos)]
    specials = [(backend.id_to_token(i), i) for i in {bos_id, eos_id} if i is not None]
    backend.post_processor = processors.TemplateProcessing(
        single=" ".join(single), pair=" ".join(pair), special_tokens=specials)


def _decoder_steps(decoder: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    if not decoder:
        return []
    if decoder.get("type") == "Sequence":
        return [s for d in decoder.get("decoders", []) for s in _decoder_steps(d)]
    return [decoder]


def decoder_spelling(decoder: Mapping[str, Any] | None) -> Callable[[str], bytes]:
    """A function from a vocabulary string to the bytes the decoder makes of it."""
    types = {step.get("type") for step in _decoder_steps(decoder)}
    if "ByteLevel" in types:
        def byte_level(text: str) -> bytes:
            # A token with any character outside the alphabet decodes as its own UTF-8.
            if set(text) <= CHAR_TO_BYTE.keys():
                return bytes(CHAR_TO_BYTE[c] for c in text)
            return text.encode("utf-8")
        return byte_level
    byte_fallback = "ByteFallback" in types

    def sentencepiece(text: str) -> bytes:
        if byte_fallback and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            return bytes([int(text[3:5], 16)])
        return text.replace("\u2581", " ").encode("utf-8")
    return sentencepiece


def decoder_strips_space(decoder: Mapping[str, Any] | None) -> bool:
    for step in _decoder_steps(decoder):
        if step.get("type") == "Metaspace" and step.get("prepend_scheme", "always") != "never" \
                and step.get("add_prefix_space", True):
            return True
        if step.get("type") == "Strip" and step.get("content") == " " and step.get("start", 0) > 0:
            return True
    return False

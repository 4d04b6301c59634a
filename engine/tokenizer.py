"""The tokenizer: text <-> token ids, chat prompts, and the raw bytes of every token.

One :class:`Tokenizer` wraps a ``tokenizers.Tokenizer`` (the Rust BPE) built either
from a GGUF file's metadata or from an HF folder's ``tokenizer.json``. It loads no
weights and never imports transformers.

From GGUF, a byte-level BPE is rebuilt from ``tokenizer.ggml.tokens`` and
``tokenizer.ggml.merges``, the pre-tokenizer chosen by ``tokenizer.ggml.pre``
following llama.cpp, which is what the model's own ``tokenizer.json`` does; a
SentencePiece vocabulary (``tokenizer.ggml.model == "llama"``: Gemma, Mistral,
Phi-3) from its pieces and scores (:mod:`.tokenizer_spm`). For
``smollm`` (and ``starcoder``) that is ``Digits(individual)`` then ``ByteLevel``: every
numeric character stands alone, so a run of spaces before a digit stays one piece
(``"a  1"`` -> ``a``, ``ĠĠ``, ``1``) and ``" ½"`` is ``Ġ``, ``Â½``. (transformers' GGUF
loader has no ``smollm`` entry and splits those two differently; we follow the model's
own tokenizer and llama.cpp.) The GGUF side lives in :mod:`.tokenizer_files`, the
incremental detokenizer in :mod:`.detokenizer`.

End-of-sequence rule (:attr:`Tokenizer.eos_token_ids`): the tokenizer's eos id, plus
``generation_config.json``'s eos ids (HF folders) or ``tokenizer.ggml.eot_token_id`` /
``eom_token_id`` (GGUF), plus every special token among :data:`TURN_END_TOKENS` whose
text appears in the chat template. For SmolLM2 that is ``{2}``: eos is already
``<|im_end|>``, and ``<|endoftext|>`` is not in its template.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any, Literal, overload

from tokenizers import Tokenizer as _Backend

from formcast.engine.chat_template import ChatTemplate, plain_prompt
from formcast.engine.errors import CorruptModelError, ModelNotFoundError, RequestError
from formcast.engine.token_spelling import decoder_spelling, decoder_strips_space, set_bos_eos

# Special tokens that close a chat turn in common templates. One that is in the vocabulary
# as a special token and written by the chat template also stops generation.
TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>",
                   "<|return|>", "<|END_OF_TURN_TOKEN|>", "<｜end▁of▁sentence｜>")


class Tokenizer:
    """Text <-> token ids for one model. Immutable once built; safe to share.

    Build it with :meth:`from_gguf`, :meth:`from_hf_dir` or :func:`load_tokenizer`.

    Parameters
    ----------
    backend : tokenizers.Tokenizer
        The configured Rust tokenizer (pre-tokenizer, model, decoder, added tokens).
    bos_token_id, eos_token_id, pad_token_id, unk_token_id : int or None
        The named special tokens.
    extra_eos_token_ids : iterable of int
        Further stop ids (see the module docstring for the rule).
    chat_template : str or None
        The jinja chat template source.
    """

    def __init__(self, backend: _Backend, *, bos_token_id: int | None, eos_token_id: int | None,
                 pad_token_id: int | None = None, unk_token_id: int | None = None,
                 extra_eos_token_ids: Sequence[int] = (), chat_template: str | None = None) -> None:
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.chat_template = chat_template
        # Ids, not entries: a vocabulary with a duplicated string has a hole, and ids past
        # the hole must still be in range.
        self._vocab_size = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        added = backend.get_added_tokens_decoder()
        self.special_token_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        eos = {eos_token_id} if eos_token_id is not None else set()
        eos.update(extra_eos_token_ids)
        if chat_template:
            for text in TURN_END_TOKENS:
                tid = backend.token_to_id(text)
                if tid is not None and tid in self.special_token_ids and text in chat_template:
                    eos.add(tid)
        self.eos_token_ids: frozenset[int] = frozenset(eos)

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Build the tokenizer stored in a GGUF file's metadata (no weights are read).

        Parameters
        ----------
        path : str or path
            A ``.gguf`` file.

        Returns
        -------
        Tokenizer

        Raises
        ------
        ModelNotFoundError
            No such file.
        CorruptModelError
            Not a readable GGUF, or its tokenizer metadata is incomplete.
        UnsupportedModelError
            A tokenizer kind or pre-tokenizer formcast does not reproduce.
        """
        from formcast.engine.gguf_metadata import read_gguf_metadata

        meta = read_gguf_metadata(path, keep=("tokenizer.", "general.architecture"))
        return cls.from_gguf_metadata(meta, source=str(path))

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], *, source: str = "GGUF") -> Tokenizer:
        """Build from already-parsed GGUF key/values (``tokenizer.*`` keys are enough).

        Lets a loader that has parsed the file once share that work.

        Parameters
        ----------
        meta : mapping
            GGUF metadata, values as ``GGUFReader``'s ``field.contents()`` returns them:
            the ``tokenizer.*`` keys, and ``general.architecture`` for a SentencePiece
            vocabulary (it picks the family's space handling).
        source : str
            Names the file in error messages.

        Returns
        -------
        Tokenizer

        Raises
        ------
        CorruptModelError, UnsupportedModelError
            As :meth:`from_gguf`.
        """
        from formcast.engine.tokenizer_files import gguf_backend

        backend, ids = gguf_backend(meta, source)
        return cls(backend, **ids)

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Build from an HF folder: ``tokenizer.json`` plus, when present,
        ``tokenizer_config.json``, ``special_tokens_map.json``, ``chat_template.jinja``
        and ``generation_config.json``.

        As in transformers, an explicit ``add_bos_token``/``add_eos_token`` in
        ``tokenizer_config.json`` (or a ``tokenizer.json`` without a post-processor)
        decides whether :meth:`encode` adds bos/eos.

        Parameters
        ----------
        path : str or path
            The folder.

        Returns
        -------
        Tokenizer

        Raises
        ------
        ModelNotFoundError
            No such folder, or it has no ``tokenizer.json``.
        CorruptModelError
            A JSON file there does not parse.
        """
        folder = Path(path)
        if not (folder / "tokenizer.json").is_file():
            raise ModelNotFoundError(
                f"no tokenizer.json in {folder}; formcast needs the fast-tokenizer file "
                "(save one with transformers' tokenizer.save_pretrained)")
        try:
            backend = _Backend.from_file(str(folder / "tokenizer.json"))
        except Exception as exc:  # the Rust side raises plain Exception
            raise CorruptModelError(f"{folder / 'tokenizer.json'} does not load: {exc}") from exc
        config = _read_json(folder / "tokenizer_config.json")
        names = {**_read_json(folder / "special_tokens_map.json"), **config}

        def named(key: str) -> int | None:
            value = names.get(key)
            text = value.get("content") if isinstance(value, Mapping) else value
            return backend.token_to_id(text) if isinstance(text, str) else None

        bos, eos = named("bos_token"), named("eos_token")
        explicit = "add_bos_token" in config or "add_eos_token" in config
        if explicit or backend.post_processor is None:
            set_bos_eos(backend, bos_id=bos if config.get("add_bos_token") else None,
                         eos_id=eos if config.get("add_eos_token") else None)
        template_file = folder / "chat_template.jinja"
        template = template_file.read_text(encoding="utf-8") if template_file.is_file() \
            else config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            by_name = {t.get("name"): t.get("template") for t in template}
            template = by_name.get("default", next(iter(by_name.values()), None))
        gen_eos = _read_json(folder / "generation_config.json").get("eos_token_id")
        extra = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        return cls(backend, bos_token_id=bos, eos_token_id=eos, pad_token_id=named("pad_token"),
                   unk_token_id=named("unk_token"), extra_eos_token_ids=extra,
                   chat_template=template)

    # ---------------------------------------------------------------- encoding

    @property
    def vocab_size(self) -> int:
        """Number of token ids (highest id + 1), added tokens included."""
        return self._vocab_size

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Does not change state.

        Special tokens written in the text (``"<|im_start|>"``) map to their ids, as in
        transformers. ``add_special_tokens`` adds bos/eos only where the model asks for
        it (SmolLM2 does not).

        Parameters
        ----------
        text : str
        add_special_tokens : bool

        Returns
        -------
        list of int
        """
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], *, add_special_tokens: bool = True
                     ) -> list[list[int]]:
        """:meth:`encode` of each of ``texts``, in parallel on the tokenizer's own
        threads (256 chat prompts: several times faster than one by one). Does not
        change state."""
        texts = list(texts)
        batch = getattr(self._backend, "encode_batch_fast", None) or self._backend.encode_batch
        return [e.ids for e in batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; bytes that are not valid UTF-8 become U+FFFD. Does not change state.

        Parameters
        ----------
        ids : sequence of int
        skip_special_tokens : bool
            Leave out special tokens (``<|im_end|>``...).

        Returns
        -------
        str

        Raises
        ------
        RequestError
            An id is outside ``[0, vocab_size)``.
        """
        ids = list(ids)
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise RequestError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of ``token_id`` (byte-alphabet spelling), or None if unknown."""
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """The id of the vocabulary string ``token``, or None if it is not one."""
        return self._backend.token_to_id(token)

    # ------------------------------------------------------------------- chat

    @cached_property
    def _compiled_template(self) -> ChatTemplate | None:
        return ChatTemplate(self.chat_template) if self.chat_template else None

    @overload
    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                            add_generation_prompt: bool = ..., tokenize: Literal[False] = ...,
                            **template_kwargs: Any) -> str: ...

    @overload
    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                            add_generation_prompt: bool = ..., tokenize: Literal[True],
                            **template_kwargs: Any) -> list[int]: ...

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                            add_generation_prompt: bool = True, tokenize: bool = False,
                            **template_kwargs: Any) -> str | list[int]:
        """Render a conversation with the model's chat template. Does not change state.

        Renders exactly as transformers' ``apply_chat_template`` (the template sees
        ``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``,
        ``unk_token``, ``pad_token``, ``tools``, ``documents`` and ``template_kwargs``).
        A model without a chat template (a base model, such as Gemma 3 270M) is
        prompted completion style: the messages' texts joined by blank lines, after
        the bos token when the model adds one (:func:`plain_prompt`), so a one-message
        conversation encodes as ``encode(text)`` does.

        Parameters
        ----------
        messages : sequence of dict
            ``{"role": ..., "content": ...}`` messages.
        add_generation_prompt : bool
            End with the header of an assistant turn, ready for generation.
        tokenize : bool
            Return token ids (encoded without adding bos/eos: the template writes them).
        **template_kwargs
            Extra template variables; they override the special-token names.

        Returns
        -------
        str or list of int

        Raises
        ------
        RequestError
            The template rejected the conversation, or a message has no text.
        CorruptModelError
            The template is not valid jinja.
        """
        names = {"bos_token": self.bos_token_id, "eos_token": self.eos_token_id,
                 "unk_token": self.unk_token_id, "pad_token": self.pad_token_id}
        variables = {k: self._backend.id_to_token(v) for k, v in names.items() if v is not None}
        template = self._compiled_template
        if template is None:
            text = plain_prompt(messages, bos_token=variables.get("bos_token")
                                if self.adds_bos else None)
        else:
            text = template.render(messages, add_generation_prompt=add_generation_prompt,
                                   **{**variables, **template_kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text

    @cached_property
    def adds_bos(self) -> bool:
        """Whether :meth:`encode` puts the bos token first (with ``add_special_tokens``)."""
        if self.bos_token_id is None:
            return False
        probe = self._backend.encode("a", add_special_tokens=True).ids
        return probe[:1] == [self.bos_token_id] and \
            self._backend.encode("a", add_special_tokens=False).ids[:1] != [self.bos_token_id]

    # ---------------------------------------------------------- token bytes

    @cached_property
    def _token_bytes(self) -> tuple[bytes, ...]:
        added = self._backend.get_added_tokens_decoder()
        spelled = decoder_spelling(self._decoder_json)
        out = []
        for i in range(self.vocab_size):
            text = self._backend.id_to_token(i)
            if text is None:
                out.append(b"")
            elif i in added:
                out.append(added[i].content.encode("utf-8"))
            else:
                out.append(spelled(text))
        return tuple(out)

    @cached_property
    def _text_bytes(self) -> tuple[bytes, ...]:
        # (the bytes of each token in text without special tokens: theirs are empty)
        special = self.special_token_ids
        return tuple(b"" if i in special else b for i, b in enumerate(self._token_bytes))

    def token_bytes(self) -> list[bytes]:
        """The raw bytes each token id stands for, indexed by id. Does not change state.

        Byte-level tokens are mapped back through GPT-2's byte alphabet (so one token
        may hold part of a UTF-8 character); added and special tokens give their text
        in UTF-8. Sentencepiece-style vocabularies map ``▁`` to a space and
        ``<0xNN>`` to that byte.

        Returns
        -------
        list of bytes
            ``vocab_size`` entries; a fresh list on each call.
        """
        return list(self._token_bytes)

    @cached_property
    def strips_leading_space(self) -> bool:
        """Whether decoding drops the first word's leading space (as streamed text must)."""
        return decoder_strips_space(self._decoder_json)

    @cached_property
    def _decoder_json(self) -> Any:
        # the decoder's own state is its JSON: a thousandth of the whole
        # tokenizer's (a cost the first request would pay)
        decoder = self._backend.decoder
        state = decoder.__getstate__() if decoder is not None else None
        if isinstance(state, (bytes, str)):
            return json.loads(state)
        return json.loads(self._backend.to_str()).get("decoder")

    def save_pretrained(self, folder: str | os.PathLike[str]) -> Path:
        """Write this tokenizer as an HF folder that :meth:`from_hf_dir` reads back.

        Writes ``tokenizer.json``, ``tokenizer_config.json`` (named tokens, chat
        template, whether bos/eos are added) and ``generation_config.json`` (eos ids).
        Does not change the tokenizer.

        Parameters
        ----------
        folder : str or path
            Created if missing.

        Returns
        -------
        Path
            The folder.
        """
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(out / "tokenizer.json"))
        probe = self._backend.encode("a", add_special_tokens=True).ids
        plain = self._backend.encode("a", add_special_tokens=False).ids

        def text(token_id: int | None) -> str | None:
            return None if token_id is None else self._backend.id_to_token(token_id)

        config = {
            "bos_token": text(self.bos_token_id),
            "eos_token": text(self.eos_token_id),
            "pad_token": text(self.pad_token_id),
            "unk_token": text(self.unk_token_id),
            "add_bos_token": self.bos_token_id is not None and probe[:1] == [self.bos_token_id]
            and plain[:1] != [self.bos_token_id],
            "add_eos_token": self.eos_token_id is not None and probe[-1:] == [self.eos_token_id]
            and plain[-1:] != [self.eos_token_id],
        }
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
        (out / "generation_config.json").write_text(
            json.dumps({"eos_token_id": sorted(self.eos_token_ids)}), encoding="utf-8")
        return out

    def fingerprint(self) -> str:
        """A stable sha256 hex digest of the vocabulary, merges, added tokens and eos ids.

        Equal digests mean the same id -> token mapping, merges, special tokens and stop
        ids, which is what a compiled grammar depends on, so it keys grammar caches. The
        pre-tokenizer is not covered: tokenizers sharing a digest may still split some
        text differently.

        Returns
        -------
        str
        """
        return self._fingerprint

    @cached_property
    def _fingerprint(self) -> str:
        model = json.loads(self._backend.to_str())["model"]
        merges = [m.split(" ", 1) if isinstance(m, str) else list(m)
                  for m in model.get("merges", [])]
        added = self._backend.get_added_tokens_decoder()
        payload = {
            "version": 1,
            "model": model.get("type"),
            "vocab": [self._backend.id_to_token(i) for i in range(self.vocab_size)],
            "merges": merges,
            "added": [[i, t.content, t.special] for i, t in sorted(added.items())],
            "eos": sorted(self.eos_token_ids),
        }
        blob = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        return hashlib.sha256(blob).hexdigest()

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
                f"eos={sorted(self.eos_token_ids)}, "
                f"chat_template={self.chat_template is not None})")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptModelError(f"{path} is not valid JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}

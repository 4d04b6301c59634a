"""Rendering a model's jinja chat template, the way transformers renders it.

Chat templates ship inside model files, so they are untrusted code: they run in an
immutable jinja sandbox. The environment matches transformers' (``trim_blocks``,
``lstrip_blocks``, loop controls, ``raise_exception``, ``strftime_now`` and a
``tojson`` that neither escapes HTML nor forces ASCII), so a prompt renders to the
same text here as in transformers and the model sees what it was tuned on.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from formcast.engine.errors import CorruptModelError, RequestError


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore names, closing a route to CPython internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja's Namespace
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates may not set underscore attributes on a namespace ({name!r})")


def _plain(value: Any) -> Any:
    """A copy of ``value`` made of plain JSON-like types only.

    The sandbox trusts the methods of plain types; anything richer (a pydantic model,
    a dataclass) is flattened first, and unknown objects become an inert placeholder.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


class ChatTemplate:
    """A compiled chat template.

    Parameters
    ----------
    source : str
        The jinja source, as found in the model's metadata.

    Raises
    ------
    CorruptModelError
        The template is not valid jinja.
    """

    def __init__(self, source: str) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.globals["namespace"] = _Namespace
        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise CorruptModelError(
                f"the model's chat template is not valid jinja (line {exc.lineno}: {exc.message}); "
                "format prompts yourself or load a model with a working template") from exc
        self.source = source

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool,
               **variables: Any) -> str:
        """Render a conversation to prompt text. Does not change any state.

        Parameters
        ----------
        messages : sequence of mappings
            Chat messages, each with at least ``role`` and ``content``. Keys whose value
            is ``None`` are dropped first, as transformers does (templates test for a
            missing key, not for ``None``).
        add_generation_prompt : bool
            Append the header that opens the assistant's turn.
        **variables
            Further template variables: ``bos_token``, ``eos_token``, ``tools``, ...

        Returns
        -------
        str

        Raises
        ------
        RequestError
            A message is not a mapping, or the template rejected the conversation
            (``raise_exception``) or failed while rendering it.
        """
        chat = []
        for message in messages:
            if not isinstance(message, Mapping):
                raise RequestError(f"chat messages must be dicts with 'role' and 'content', "
                                   f"got {message!r}")
            chat.append({k: v for k, v in _plain(message).items() if v is not None})
        context = {"tools": None, "documents": None, **_plain(variables)}
        try:
            return self._template.render(messages=chat, add_generation_prompt=add_generation_prompt,
                                         **context)
        except jinja2.exceptions.TemplateError as exc:
            raise RequestError(f"the chat template rejected this conversation: {exc}") from exc
        except (TypeError, KeyError, IndexError, AttributeError, ValueError) as exc:
            raise RequestError(
                f"the chat template failed on this conversation ({type(exc).__name__}: {exc}); "
                "check that every message has the keys the template reads") from exc


def plain_prompt(messages: Sequence[Mapping[str, Any]], *, bos_token: str | None) -> str:
    """A conversation as a base model's prompt: its texts joined by blank lines. Pure.

    A base model continues text rather than chat turns, so roles are dropped and
    each message's text (a string, or the ``text`` of its parts) is written as is.

    Parameters
    ----------
    messages : sequence of mappings
    bos_token : str or None
        Written first (the model adds it to a plain prompt too).

    Returns
    -------
    str

    Raises
    ------
    RequestError
        A message is not a mapping or has neither string content nor text parts.
    """
    texts = []
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list):
            content = "".join(p["text"] for p in content
                              if isinstance(p, Mapping) and isinstance(p.get("text"), str))
        if not isinstance(content, str):
            raise RequestError(f"chat messages must be dicts with 'role' and text 'content', "
                               f"got {message!r}")
        texts.append(content)
    return (bos_token or "") + "\n\n".join(texts)

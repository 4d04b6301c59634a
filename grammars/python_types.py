"""Python types -> JSON Schema constraints, through one dispatch function.

Supported: ``None``, ``bool``, ``int``, ``float``, ``str``, ``Any``, ``Literal``,
``Enum`` subclasses, ``list[X]``/``Sequence[X]``, ``tuple[X, ...]``/``tuple[X, Y]``,
``dict[str, X]``, ``Optional``/``Union``/``X | Y``, dataclasses, ``TypedDict``,
pydantic models (their own ``model_json_schema``, so field constraints are kept) and
``Annotated`` types pydantic understands. Dataclasses and TypedDicts become
``$defs`` entries, so recursive and mutually recursive types work.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from collections import abc
from typing import Any

from formcast.grammars.constraints import JsonSchema, Whitespace
from formcast.grammars.errors import UnsupportedTypeError

_REF = "#/$defs/{model}"
_SCALARS: dict[Any, dict] = {bool: {"type": "boolean"}, int: {"type": "integer"},
                             float: {"type": "number"}, str: {"type": "string"},
                             type(None): {"type": "null"}}
_SEQUENCES = (list, abc.Sequence, abc.MutableSequence, typing.List)
_MAPPINGS = (dict, abc.Mapping, abc.MutableMapping, typing.Dict)


def from_type(tp: Any, *, whitespace: Whitespace = "compact",
              max_whitespace: int | None = None) -> JsonSchema:
    """Build the :class:`JsonSchema` constraint whose documents are values of ``tp``.

    Parameters
    ----------
    tp : type
        A Python type (see the module docstring for what is supported).
    whitespace, max_whitespace
        As for :class:`JsonSchema`.

    Returns
    -------
    JsonSchema

    Raises
    ------
    UnsupportedTypeError
        If ``tp`` (or a type inside it) cannot be expressed; the message names it.
    """
    return JsonSchema(type_schema(tp), whitespace=whitespace, max_whitespace=max_whitespace)


def type_schema(tp: Any) -> dict:
    """The JSON Schema (a dict, with ``$defs`` if needed) of the values of ``tp``."""
    builder = _Builder()
    schema = builder.schema(tp)
    if builder.defs:
        schema = {**schema, "$defs": builder.defs}
    return schema


class _Builder:
    def __init__(self) -> None:
        self.defs: dict[str, dict] = {}
        self._names: dict[Any, str] = {}          # class -> its $defs name

    def schema(self, tp: Any) -> dict:
        """The one dispatch: a Python type to a JSON Schema fragment."""
        if tp is None or tp is type(None):
            return {"type": "null"}
        if tp is Any:
            return {}
        if tp in _SCALARS:
            return dict(_SCALARS[tp])
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin is typing.Annotated:
            return self._pydantic(tp, name=None)
        if origin is typing.Literal:
            return self._literal(tp, args)
        if origin in (typing.Union, types.UnionType):
            return {"anyOf": [self.schema(a) for a in args]}
        if origin in _SEQUENCES or tp in _SEQUENCES:
            return {"type": "array", "items": self.schema(args[0])} if args else {"type": "array"}
        if origin is tuple:
            return self._tuple(tp, args)
        if origin in _MAPPINGS or tp in _MAPPINGS:
            return self._mapping(tp, args)
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            return self._enum(tp)
        if isinstance(tp, type) and _is_pydantic_model(tp):
            return self._pydantic(tp, name=tp.__name__)
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            return self._record(tp, *_dataclass_fields(tp))
        if typing.is_typeddict(tp):
            return self._record(tp, *_typeddict_fields(tp))
        raise UnsupportedTypeError(f"from_type cannot express {_name(tp)} as JSON; supported are None, bool, "
                        "int, float, str, Any, Literal, Enum, list, tuple, dict[str, ...], Union, "
                        "dataclasses, TypedDict and pydantic models")

    def _literal(self, tp: Any, values: tuple) -> dict:
        for v in values:
            if not isinstance(v, (str, int, bool, type(None))) or isinstance(v, enum.Enum):
                raise UnsupportedTypeError(f"from_type cannot express {_name(tp)}: literal {v!r} is not "
                                "a str, int, bool or None")
        return {"const": values[0]} if len(values) == 1 else {"enum": list(values)}

    def _tuple(self, tp: Any, args: tuple) -> dict:
        if not args:
            return {"type": "array"}
        if len(args) == 2 and args[1] is Ellipsis:
            return {"type": "array", "items": self.schema(args[0])}
        if args == ((),):
            return {"type": "array", "maxItems": 0}
        return {"type": "array", "prefixItems": [self.schema(a) for a in args],
                "items": False, "minItems": len(args), "maxItems": len(args)}

    def _mapping(self, tp: Any, args: tuple) -> dict:
        if not args:
            return {"type": "object"}
        key, value = args
        if key is not str:
            raise UnsupportedTypeError(f"from_type cannot express {_name(tp)}: JSON object keys are "
                            f"strings, not {_name(key)}")
        return {"type": "object", "additionalProperties": self.schema(value)}

    def _enum(self, tp: type[enum.Enum]) -> dict:
        values = [m.value for m in tp]
        try:
            json.dumps(values)
        except (TypeError, ValueError):
            raise UnsupportedTypeError(f"from_type cannot express {_name(tp)}: its values are not "
                            "JSON") from None
        return {"enum": values}

    def _ref(self, tp: Any) -> tuple[str, bool]:
        """$defs name of a class, and whether it is already (being) built."""
        if tp in self._names:
            return self._names[tp], True
        name = tp.__name__
        taken = set(self._names.values()) | set(self.defs)
        n = 2
        while name in taken:
            name, n = f"{tp.__name__}{n}", n + 1
        self._names[tp] = name
        return name, False

    def _record(self, tp: type, fields: dict[str, Any], required: list[str]) -> dict:
        name, seen = self._ref(tp)
        if not seen:
            self.defs[name] = {}     # placeholder: recursive fields refer to it
            props = {}
            for field_name, field_type in fields.items():
                try:
                    props[field_name] = self.schema(field_type)
                except TypeError as exc:
                    raise UnsupportedTypeError(f"{_name(tp)}.{field_name}: {exc}") from None
            body: dict = {"type": "object", "title": tp.__name__, "properties": props,
                          "additionalProperties": False}
            if required:
                body["required"] = required
            self.defs[name] = body
        return {"$ref": _REF.format(model=name)}

    def _pydantic(self, tp: Any, name: str | None) -> dict:
        import pydantic

        if name is not None:
            name, seen = self._ref(tp)
            if seen:
                return {"$ref": _REF.format(model=name)}
        try:
            schema = pydantic.TypeAdapter(tp).json_schema(ref_template=_REF)
        except pydantic.PydanticUserError as exc:
            raise UnsupportedTypeError(f"from_type cannot express {_name(tp)}: {exc}") from None
        except Exception as exc:  # pydantic's errors for types it cannot make a schema of
            raise UnsupportedTypeError(f"from_type cannot express {_name(tp)}: "
                            f"{type(exc).__name__}: {exc}") from None
        for def_name, body in schema.pop("$defs", {}).items():
            if self.defs.get(def_name, body) != body:
                raise UnsupportedTypeError(f"from_type: two different types are both named {def_name!r}")
            self.defs[def_name] = body
        if name is None or "$ref" in schema:
            return schema
        self.defs[name] = schema
        return {"$ref": _REF.format(model=name)}


def _is_pydantic_model(tp: type) -> bool:
    try:
        import pydantic
    except ImportError:
        return False
    return issubclass(tp, pydantic.BaseModel)


def _dataclass_fields(tp: type) -> tuple[dict[str, Any], list[str]]:
    hints = _hints(tp)
    fields, required = {}, []
    for f in dataclasses.fields(tp):
        if not f.init:
            continue
        fields[f.name] = hints[f.name]
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.append(f.name)
    return fields, required


def _typeddict_fields(tp: type) -> tuple[dict[str, Any], list[str]]:
    hints = _hints(tp)
    fields, required = {}, []
    for name, hint in hints.items():
        marker = typing.get_origin(hint)
        # Under `from __future__ import annotations` __required_keys__ misses the markers.
        if marker is typing.Required or (marker is not typing.NotRequired
                                         and name in tp.__required_keys__):
            required.append(name)
        fields[name] = _strip_required(hint)
    return fields, required


def _strip_required(tp: Any) -> Any:
    while typing.get_origin(tp) in (typing.Required, typing.NotRequired):
        tp = typing.get_args(tp)[0]
    return tp


def _hints(tp: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(tp, include_extras=True)
    except (NameError, TypeError) as exc:
        raise UnsupportedTypeError(f"from_type cannot resolve the annotations of {_name(tp)}: {exc}") from None


def _name(tp: Any) -> str:
    return tp.__qualname__ if isinstance(tp, type) else repr(tp)

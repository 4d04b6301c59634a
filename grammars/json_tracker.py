"""A byte-level JSON tracker: where in the document the next byte goes.

:class:`JsonTracker` follows the bytes a grammar matcher accepted and knows, at any
point, the path of the value being written and whether that value is grounded (see
:mod:`formcast.grammars.grounding`). While it follows a grounded value it checks it
against a :class:`~formcast.grammars.grounding_text.GroundingText`: a string's
content must stay a substring of the source text, a number a prefix of one of its
numbers; with ``distinct`` a ``,`` that would end an array item equal to an earlier
sibling is refused. The grammar matcher it runs beside keeps the JSON valid, so the
tracker is lenient about bytes JSON would refuse.

Its state is a handful of immutable values (:meth:`snapshot`), so a matcher keeps one
per step and rolls back by restoring one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from formcast.grammars.grounding import PlanNode
    from formcast.grammars.grounding_text import GroundingText

# modes: what the next byte continues
STRUCT, STRING, KEY, NUMBER, LITERAL = range(5)
# lexical states of a container frame
OPENED, KEY_NEXT, COLON, VALUE, AFTER = range(5)
OBJECT, ARRAY = 0, 1
# value kinds
PLAIN, GROUNDED_STRING, GROUNDED_NUMBER = 0, 1, 2

_WS = frozenset(b" \t\n\r")
_NUMBER_BYTES = frozenset(b"0123456789.eE+-")
_NUMBER_START = frozenset(b"0123456789-")


@dataclass(frozen=True, slots=True)
class Repeat:
    """An array that ended on an item equal to an earlier sibling.

    Attributes
    ----------
    pointer : str
        JSON pointer of the repeated (last) item, e.g. ``"/tags/3"``.
    value : str
        The item as compact JSON.
    """

    pointer: str
    value: str


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why the tracker refused bytes.

    Attributes
    ----------
    kind : str
        ``"ungrounded"`` (a grounded value left the text) or ``"repeat"`` (a ``,``
        after an item equal to an earlier sibling).
    pointer : str
        JSON pointer of the value.
    value : str
        The offending value as written so far (``"repeat"``: the item as compact JSON).
    """

    kind: str
    pointer: str
    value: str


def _frame(kind: int, node: PlanNode | None) -> tuple:
    # (kind, plan node, lexical state, key or index, item start, earlier items)
    return (kind, node, OPENED, None if kind == OBJECT else 0, -1, frozenset())


def _number(text: str) -> int | float:
    value = float(text)
    return int(value) if value.is_integer() else value


def _canonical(raw: bytes) -> str:
    # (numbers by value, as uniqueItems compares them: 1299, 1299.0 and 1299.00 are one)
    try:
        return json.dumps(json.loads(raw, parse_float=_number), separators=(",", ":"),
                          ensure_ascii=False)
    except ValueError:
        return raw.strip().decode("utf-8", "replace")


class JsonTracker:
    """Follows a JSON document byte by byte (see the module docstring).

    Parameters
    ----------
    root : PlanNode or None
        The grounding plan's node of the document itself (None: nothing grounded).
    distinct : bool
        Refuse a ``,`` that ends an array item equal to an earlier sibling.
    """

    __slots__ = ("root", "distinct", "stack", "mode", "esc", "buf", "vkind", "integer", "doc",
                 "done", "repeats")

    def __init__(self, root: PlanNode | None, distinct: bool) -> None:
        self.root = root
        self.distinct = distinct
        self.stack: tuple = ()          # container frames, innermost last
        self.mode = STRUCT
        self.esc = 0                    # 0; 1 after a backslash; 2..5: \u hex digits left + 1
        self.buf = b""                  # string content / key / number written so far
        self.vkind = PLAIN              # how the value being written is checked
        self.integer = False            # a grounded number: whether it is an integer
        self.doc = bytearray()          # every byte taken (array items are compared from it)
        self.done = False
        self.repeats: tuple[Repeat, ...] = ()

    # -- state --------------------------------------------------------------------

    def snapshot(self) -> tuple:
        """The state as immutable values (for :meth:`restore`)."""
        return (self.stack, self.mode, self.esc, self.buf, self.vkind, self.integer,
                len(self.doc), self.done, self.repeats)

    def restore(self, snap: tuple) -> None:
        """Go back to a :meth:`snapshot` of this tracker (taken no later than now)."""
        (self.stack, self.mode, self.esc, self.buf, self.vkind, self.integer, size, self.done,
         self.repeats) = snap
        del self.doc[size:]

    def copy(self) -> JsonTracker:
        """An independent tracker in the same state."""
        other = JsonTracker(self.root, self.distinct)
        other.restore(self.snapshot())
        other.doc = bytearray(self.doc)
        return other

    def in_grounded_value(self) -> bool:
        """Whether the next byte continues a grounded string or number."""
        return self.vkind != PLAIN and self.mode in (STRING, NUMBER)

    def value_node(self) -> PlanNode | None:
        """Plan node of the value the next byte may start (None: no value may start
        here, or nothing under it is grounded)."""
        if self.mode != STRUCT or self.done:
            return None
        if not self.stack:
            return self.root
        lex = self.stack[-1][2]
        if lex == VALUE or (lex == OPENED and self.stack[-1][0] == ARRAY):
            return self._child()
        return None

    def in_array(self) -> bool:
        """Whether an array is open (a "," may end one of its items)."""
        return any(frame[0] == ARRAY for frame in self.stack)

    def release_value(self) -> None:
        """Stop checking the value being written (after a fallback step)."""
        if self.mode in (STRING, NUMBER):
            self.vkind = PLAIN

    def pointer(self) -> str:
        """JSON pointer of the value being written (or of the container expecting one)."""
        parts = []
        for frame in self.stack:
            step = frame[3]
            if step is not None:
                parts.append(str(step).replace("~", "~0").replace("/", "~1"))
        return "".join("/" + p for p in parts)

    # -- feeding --------------------------------------------------------------------

    def _child(self) -> PlanNode | None:
        """Plan node of the value starting now in the innermost container."""
        if not self.stack:
            return self.root
        kind, node, _, step, _, _ = self.stack[-1]
        if node is None:
            return None
        return node.children.get("*" if kind == ARRAY else step)

    def _start_value(self, at: int) -> PlanNode | None:
        """Note the value starting at doc offset ``at``; its plan node."""
        stack = self.stack
        if stack and stack[-1][0] == ARRAY:
            kind, node, _, index, _, seen = stack[-1]
            self.stack = stack[:-1] + ((kind, node, VALUE, index, at, seen),)
        return self._child()

    def _end_value(self) -> None:
        """The value just written is complete."""
        stack = self.stack
        if not stack:
            self.done = True
            return
        top = stack[-1]
        self.stack = stack[:-1] + ((top[0], top[1], AFTER, top[3], top[4], top[5]),)

    def _item_repeat(self, end: int) -> str | None:
        """The current array item as compact JSON if it equals an earlier sibling."""
        top = self.stack[-1]
        if top[4] < 0:
            return None
        value = _canonical(bytes(self.doc[top[4]:end]))
        return value if value in top[5] else None

    def feed(self, data: bytes, text: GroundingText | None) -> Refusal | None:
        """Take ``data``; with ``text``, check grounded values and distinct items.

        Returns the refusal (the state is then partly advanced: restore a snapshot),
        or None.
        """
        base = len(self.doc)
        self.doc += data
        i, n = 0, len(data)
        while i < n:
            mode = self.mode
            if mode == STRING or mode == KEY:
                if self.esc == 0:
                    j = i
                    while j < n and data[j] != 34 and data[j] != 92:   # '"', '\\'
                        j += 1
                    if j > i:
                        self.buf += data[i:j]
                        i = j
                        continue
                    c = data[i]
                    i += 1
                    if c == 92:
                        self.buf += b"\\"
                        self.esc = 1
                        continue
                    # closing quote
                    if mode == KEY:
                        key = self.buf.decode("utf-8", "replace")
                        if b"\\" in self.buf:
                            try:
                                key = json.loads(b'"' + self.buf + b'"')
                            except ValueError:
                                pass
                        top = self.stack[-1]
                        self.stack = self.stack[:-1] + ((top[0], top[1], COLON, key, top[4],
                                                         top[5]),)
                        self.mode = STRUCT
                    else:
                        if text is not None and self.vkind == GROUNDED_STRING \
                                and not text.has_string(self.buf):
                            return Refusal("ungrounded", self.pointer(),
                                           self.buf.decode("utf-8", "replace"))
                        self.mode = STRUCT
                        self._end_value()
                    self.buf = b""
                    continue
                c = data[i]
                i += 1
                self.buf += bytes((c,))
                esc = self.esc
                if esc == 1:
                    self.esc = 5 if c == 117 else 0          # 'u': four hex digits follow
                else:
                    self.esc = 0 if esc == 2 else esc - 1
                continue
            c = data[i]
            if mode == NUMBER:
                if c in _NUMBER_BYTES:
                    self.buf += bytes((c,))
                    i += 1
                    continue
                if text is not None and self.vkind == GROUNDED_NUMBER \
                        and not text.has_number(self.buf, self.integer):
                    return Refusal("ungrounded", self.pointer(), self.buf.decode())
                self.mode, self.buf = STRUCT, b""
                self._end_value()
                continue                                  # the byte is structure
            if mode == LITERAL:
                if 97 <= c <= 122:
                    i += 1
                    continue
                self.mode = STRUCT
                self._end_value()
                continue
            # structure
            i += 1
            if c in _WS:
                continue
            stack = self.stack
            lex = stack[-1][2] if stack else (AFTER if self.done else VALUE)
            if lex == VALUE or (lex == OPENED and stack[-1][0] == ARRAY and c != 93):
                node = self._start_value(base + i - 1)
                if c == 123 or c == 91:                    # '{' '['
                    self.stack += (_frame(OBJECT if c == 123 else ARRAY, node),)
                elif c == 34:
                    self.mode, self.buf, self.esc = STRING, b"", 0
                    self.vkind = GROUNDED_STRING if node is not None and node.string else PLAIN
                elif c in _NUMBER_START:
                    self.mode, self.buf = NUMBER, bytes((c,))
                    self.vkind = GROUNDED_NUMBER if node is not None and node.number else PLAIN
                    self.integer = node is not None and node.integer
                else:
                    self.mode = LITERAL
                continue
            if not stack:
                continue
            kind = stack[-1][0]
            if lex == OPENED or lex == KEY_NEXT:
                if c == 34 and kind == OBJECT:
                    self.mode, self.buf, self.esc = KEY, b"", 0
                elif c == 125 or c == 93:
                    self.stack = stack[:-1]
                    self._end_value()
            elif lex == COLON:
                if c == 58:
                    top = stack[-1]
                    self.stack = stack[:-1] + ((top[0], top[1], VALUE, top[3], top[4], top[5]),)
            elif lex == AFTER:
                if c == 44:                                # ','
                    top = stack[-1]
                    if kind == ARRAY:
                        seen = top[5]
                        if self.distinct and top[4] >= 0:
                            value = _canonical(bytes(self.doc[top[4]:base + i - 1]))
                            if text is not None and value in seen:
                                return Refusal("repeat", self.pointer(), value)
                            seen = seen | {value}
                        self.stack = stack[:-1] + ((ARRAY, top[1], VALUE, top[3] + 1, -1,
                                                    seen),)
                    else:
                        self.stack = stack[:-1] + ((OBJECT, top[1], KEY_NEXT, top[3], -1,
                                                    top[5]),)
                elif c == 125 or c == 93:
                    if kind == ARRAY and self.distinct:
                        value = self._item_repeat(base + i - 1)
                        if value is not None:
                            self.repeats += (Repeat(self.pointer(), value),)
                    self.stack = stack[:-1]
                    self._end_value()
        if text is not None:
            return self._check_open(text)
        return None

    def _check_open(self, text: GroundingText) -> Refusal | None:
        """Check the value left open at the end of a feed."""
        if self.mode == STRING and self.vkind == GROUNDED_STRING:
            if not text.has_string_prefix(self.buf):
                return Refusal("ungrounded", self.pointer(), self.buf.decode("utf-8", "replace"))
        elif self.mode == NUMBER and self.vkind == GROUNDED_NUMBER:
            if not text.has_number_prefix(self.buf, self.integer):
                return Refusal("ungrounded", self.pointer(), self.buf.decode())
        return None

    def finish(self, text: GroundingText | None) -> Refusal | None:
        """The document ends here (a stop token): a grounded number left open must be whole."""
        if text is not None and self.mode == NUMBER and self.vkind == GROUNDED_NUMBER \
                and not text.has_number(self.buf, self.integer):
            return Refusal("ungrounded", self.pointer(), self.buf.decode())
        return None

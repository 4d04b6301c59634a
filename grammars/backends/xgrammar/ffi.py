"""What the installed xgrammar and tvm-ffi offer beyond xgrammar's public API.

Each probe runs once, at import: its answer is a fact of the installed
libraries (None where the function is missing or answers in another form, and
the callers then take xgrammar's public way).
"""

from __future__ import annotations

import array
import json
import re
from collections.abc import Callable
from functools import partial
from typing import Any

import xgrammar as xgr

from formcast.grammars.backends.xgrammar import native

# xgrammar prefixes C++ errors with "[hh:mm:ss] /path/file.cc:123: ".
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")
_DIGITS = bytes.maketrans(b"01", b"\x00\x01")
C_INT_IS_32 = array.array("i").itemsize == 4


def library_message(exc: BaseException) -> str:
    """xgrammar's error text without its log prefix."""
    return _LOG_PREFIX.sub("", str(exc)).strip()


def _native_batch_accept() -> Callable | None:
    """xgrammar's native batch accept, if this xgrammar has the one we know.

    The public ``BatchGrammarMatcher.batch_accept_token`` turns the native result
    into a list one ``__getitem__`` at a time, which costs as much as the native
    accept itself; a slice of the native array takes one plain call a row."""
    core = getattr(getattr(xgr, "matcher", None), "_core", None)
    fn = getattr(getattr(core, "BatchGrammarMatcher", None), "batch_accept_token", None)
    if fn is None:
        return None
    try:
        if list(fn([], [], False)[:]) != []:
            return None
    except Exception:
        return None
    return fn


def _quiet_global(name: str) -> Callable | None:
    """tvm-ffi's global function ``name`` as a private copy that keeps the
    interpreter lock through the call, or None when absent.

    tvm-ffi lets go of the lock around every call by default; for a call of a
    microsecond, getting it back can wait a whole switch interval for another
    thread. A copy's setting is its own: the shared function keeps tvm-ffi's."""
    try:
        import tvm_ffi

        fn = tvm_ffi.get_global_func(name)  # (a new object each time)
        fn.release_gil = False
        return fn
    except Exception:
        return None


BATCH_ACCEPT = _native_batch_accept()
STRINGIFY = _quiet_global("ffi.json.Stringify")  # (see native_verdicts)
CONTAINS = _quiet_global("ffi.ArrayContains")
TO_ARRAY = _quiet_global("ffi.Array")


def _native_matcher_methods() -> dict[str, Any] | None:
    """Private copies of xgrammar's native matcher methods ``fill_next_token_bitmask``,
    ``accept_token`` and ``is_completed`` (tvm-ffi functions that take the native
    matcher first), where this xgrammar has them with the parameters we pass
    (read from tvm-ffi's reflection of the type); None otherwise.

    A copy (read back through a tvm-ffi array: a new object, its setting its
    own) is called without the Python wrapper tvm-ffi puts around a method, and
    those of the two short calls keep the interpreter lock (see
    :func:`_quiet_global`); a fill, which may take long, lets go of it."""
    known = {"fill_next_token_bitmask": ["Any", "int", "bool"], "accept_token": ["int", "bool"],
             "is_completed": []}
    try:
        native_type = xgr.tvm_ffi_binding._ffi_api.GrammarMatcher
        found, funcs = {}, {}
        for method in native_type.__tvm_ffi_type_info__.methods:
            if method.name in known and not method.is_static:
                schema = json.loads(method.metadata["type_schema"])
                found[method.name] = [p["type"] for p in schema["named_args"]["params"][1:]]
                funcs[method.name] = method.func
        if found != known:
            return None
        if TO_ARRAY is None:
            return funcs
        copies = {name: TO_ARRAY(fn)[0] for name, fn in funcs.items()}
        if any(copy is funcs[name] for name, copy in copies.items()):
            return funcs   # (not a copy: the shared function's setting is left alone)
        copies["accept_token"].release_gil = False
        copies["is_completed"].release_gil = False
        return copies
    except Exception:
        return None


NATIVE_METHODS = _native_matcher_methods()
NATIVE_MATCHER_CALLS = NATIVE_METHODS is not None


def matcher_calls(matcher: xgr.GrammarMatcher) -> tuple[Callable, Callable, Callable]:
    """The per-token calls of ``matcher``: ``fill(bitmask, row, debug)``,
    ``accept(token, debug)`` and ``is_completed()``.

    They are xgrammar's native methods bound to its native object where this
    xgrammar has the ones we know (see :func:`_native_matcher_methods`): its
    Python methods only forward to them, and on a matcher's path, a call or
    two a token, that step is a sizeable part of the cost. Otherwise they call
    the public methods."""
    methods = NATIVE_METHODS
    if NATIVE_MATCHER_CALLS and methods is not None:
        handle = matcher._handle
        return (partial(methods["fill_next_token_bitmask"], handle),
                partial(methods["accept_token"], handle), partial(methods["is_completed"], handle))
    public_fill, public_accept = matcher.fill_next_token_bitmask, matcher.accept_token
    return (lambda bitmask, row, debug: public_fill(bitmask, row, debug_print=debug),
            lambda token, debug: public_accept(token, debug_print=debug),
            matcher.is_completed)


def native_verdicts(handles: Any, tokens: list[int]) -> list[int]:
    """xgrammar's native batch accept of ``tokens`` by the matchers whose handles
    are ``handles`` (a list, or a tvm-ffi array of them): each row's verdict (1
    taken, 0 refused), in order. Changes the matchers' states.

    A batch is one call (the engine overlaps it with other work rather than
    splitting it over threads, which gains little). Its answer is a tvm-ffi
    array, slow to read element by element: one containment test tells the
    usual batch, every row taken, and a batch with refusals is read through
    tvm-ffi's JSON writer ("[1,0,...]", in C), both calls keeping the lock."""
    got = BATCH_ACCEPT(handles, tokens, False)
    n = len(tokens)
    if not (CONTAINS(got, 0) if CONTAINS is not None else 0 in got):
        return [1] * n
    if STRINGIFY is not None:
        text = STRINGIFY(got, None)
        if len(text) == 2 * n + 1:
            digits = text[1::2].encode().translate(_DIGITS)
            if max(digits) <= 1:
                return list(digits)
    return [int(v) for v in got[:]]


def handle_array(handles: list[Any]) -> Any:
    """The native batch accept's argument for these matcher handles: a tvm-ffi
    array when this tvm-ffi makes one (else the list)."""
    return TO_ARRAY(*handles) if TO_ARRAY is not None else handles


def release_later(obj: Any) -> None:
    """Let the native worker drop a reference to the tvm-ffi object ``obj`` (a
    matcher's handle, an array of them), called by its Python holder as it
    goes: the destructors of a finished batch's matchers then run off the
    engine's thread. Called from ``__del__`` (which binds it: at interpreter
    exit the module's names may be gone first), so it never raises."""
    try:
        if obj is None or not hasattr(obj, "__chandle__"):
            return
        worker = native.started()  # (a matcher let go never builds or starts it)
        if worker is not None:
            worker.defer_release(obj)
    except Exception:
        pass

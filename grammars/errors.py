"""The grammar layer's error: one type for every problem with a constraint."""

from __future__ import annotations

from formcast.engine.errors import FormcastError


class ConstraintError(FormcastError, ValueError):
    """A constraint (schema, regex, grammar, choices) is invalid, unsatisfiable or too costly.

    Bad Python arguments for a constraint raise it too; it is a ``ValueError`` so
    that ``except ValueError`` code keeps working.
    """



class UnsupportedTypeError(ConstraintError, TypeError):
    """A Python type (or object) that cannot be expressed as a constraint.

    A ``TypeError`` too, as Python's conventions would have it for a wrong type.
    """


__all__ = ["ConstraintError", "UnsupportedTypeError"]

"""The launchers' check of a count argument (splits, steps, pages, slots): an ``int`` that is not a ``bool``, within
its bounds, else ``ValueError`` naming the argument and what it must be."""
from __future__ import annotations


def check_count(value, name: str, minimum: int, maximum: int | None = None, unit: str | None = None) -> int:
    """``value`` must be an ``int`` (not a ``bool``) ``>= minimum`` and, when given, ``<= maximum``; returns it.
    ``unit`` (e.g. ``"blocks"``) is named in the error."""
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= minimum
            and (maximum is None or value <= maximum)):
        if maximum is not None:
            expected = f"an int in [{minimum}, {maximum}]"
        elif minimum == 1:
            expected = "a positive int"
        else:
            expected = f"an int >= {minimum}"
        raise ValueError(f"{name} must be {expected}{f' ({unit})' if unit else ''}, got {value!r}")
    return value

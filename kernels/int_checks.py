"""The launchers' check of a count argument (splits, steps, pages, slots): an ``int`` that is not a ``bool``, within
its bounds, else ``ValueError`` naming the argument and what it must be; and what a real-valued argument (a threshold,
a scale) must be before its range is checked."""
from __future__ import annotations

import math
import numbers


def is_finite_real(value) -> bool:
    """Whether ``value`` is a finite real number: an ``int``, ``float`` or NumPy scalar, not a ``bool`` (nor a tensor,
    a string or NaN / inf)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


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


def check_flags(**flags) -> None:
    """Each keyword's value must be a ``bool``: a string such as ``"no"`` would read as true.  ``TypeError`` naming
    the first that is not."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")


def check_cache_dims(batch, num_q_heads, num_kv_heads, seqlen, head_dim) -> None:
    """The sizes of a cache to build (synthetic caches, benchmark inputs): each a positive ``int``, and the query
    heads in whole groups of the KV heads; else ``ValueError`` naming the argument."""
    for name, value in (("batch", batch), ("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads),
                        ("seqlen", seqlen), ("head_dim", head_dim)):
        check_count(value, name, 1)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads % num_kv_heads must be 0, got {num_q_heads} and {num_kv_heads}")


def check_choice(value, name: str, choices: tuple[int, ...]) -> int:
    """``value`` must be an ``int`` (not a ``bool`` nor a float equal to one) among ``choices``; returns it."""
    if isinstance(value, bool) or not isinstance(value, int) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value

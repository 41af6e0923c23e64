"""Argument checks shared by the modules, so that one kind of bad value gets one kind of error."""

from __future__ import annotations

import numbers

__all__ = ["positive_int"]


def positive_int(value: object, what: str, expected: str = "a positive integer") -> int:
    """``value`` as an ``int`` if it is an integer >= 1 (NumPy integers too, ``bool`` not);
    otherwise ``ValueError("{what} must be {expected}, got {value!r}")``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{what} must be {expected}, got {value!r}")
    return int(value)

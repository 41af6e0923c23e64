"""Argument checks shared by the modules, so that one kind of bad value gets one kind of error."""

from __future__ import annotations

import numbers

__all__: list[str] = []  # building blocks of the package's own modules


def is_integer(value: object) -> bool:
    """An integer, NumPy's included; not ``bool``, not a float or a string that looks like one."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def positive_int(value: object, what: str, expected: str = "a positive integer") -> int:
    """``value`` as an ``int`` if it is an integer >= 1 (NumPy integers too, ``bool`` not);
    otherwise ``ValueError("{what} must be {expected}, got {value!r}")``."""
    if not is_integer(value) or value < 1:
        raise ValueError(f"{what} must be {expected}, got {value!r}")
    return int(value)


class MissingExtraError(ImportError):
    """A feature needs a package that a ``jaxdist[extra]`` installs, and it is missing."""

    exit_code = 1


def pyplot(what: str):
    """``matplotlib.pyplot`` drawing to files (the Agg backend), or one line naming the
    extra that installs it."""
    try:
        import matplotlib
    except ImportError as err:
        raise MissingExtraError(
            f"{what} draws with matplotlib, which is not installed: pip install 'jaxdist[plot]'"
        ) from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt

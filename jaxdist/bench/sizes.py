"""Message sizes as the benchmarks and the command line write them: ``4K``, ``64M``, ranges
``4K:64M`` and lists ``4K,1M,16M`` (binary units)."""

from __future__ import annotations

import re

__all__ = ["format_size", "parse_size", "parse_sizes"]

_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "M": 2**20, "MB": 2**20, "G": 2**30, "GB": 2**30}


def parse_size(text: str) -> int:
    """``"4K" -> 4096``, ``"64M" -> 67108864``, ``"100" -> 100`` (binary units)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?B?)\s*", text.upper())
    if not match:
        raise ValueError(f"bad size {text!r}: expected a number with an optional K, M or G suffix")
    return int(match.group(1)) * _UNITS[match.group(2)]


def parse_sizes(text: str, factor: int = 4) -> list[int]:
    """``"4K:64M"`` (geometric, times ``factor``) or ``"4K,1M,16M"`` (a list)."""
    if ":" in text:
        lo, hi = (parse_size(part) for part in text.split(":", 1))
        if lo < 1 or hi < lo or factor < 2:
            raise ValueError(
                f"bad size range {text!r} with factor {factor}: need 1 <= lo <= hi, factor >= 2"
            )
        sizes = [lo]
        while sizes[-1] * factor <= hi:
            sizes.append(sizes[-1] * factor)
        return sizes
    return [parse_size(part) for part in text.split(",")]


def format_size(nbytes: float) -> str:
    """``4096 -> "4K"``: the largest binary unit that divides ``nbytes``."""
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{int(nbytes // scale)}{unit}"
    return f"{int(nbytes)}"

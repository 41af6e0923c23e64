"""The link of an emulated cluster: how ``jaxdist cluster`` writes its rate and delay, and how
the cost model reads them back.

``jaxdist cluster`` caps every emulated host's link with tc and tells the processes it starts
what it set, in :data:`RATE_VARIABLE` (whole bits per second) and :data:`LATENCY_VARIABLE`
(tc's delay text). The benchmarks report results against that link, and ``allreduce="auto"``
prices its schedules on it when no other links are given.
"""

from __future__ import annotations

import os
import re

from jaxdist.comm import cost_model

__all__ = [
    "link_from_environment",
    "link_rate_from_environment",
]

RATE_VARIABLE = "JAXDIST_LINK_BITS_PER_S"
LATENCY_VARIABLE = "JAXDIST_LINK_LATENCY"

_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def rate_bits(text: str) -> int:
    """A link rate for tc, in whole bits per second, read as the cost model reads rates
    (:func:`jaxdist.comm.cost_model.parse_rate`: ``1gbit``, ``100mbit``, ``12.5GB/s``, ...)."""
    return round(8 * cost_model.parse_rate(text))


def parse_latency(text: str) -> float:
    """tc-style delay (``"100us"``, ``"2ms"``, ``"0"``) in seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(us|ms|s)?\s*", text.lower())
    if not m or (m.group(2) is None and float(m.group(1)) != 0):
        raise ValueError(f"latency must look like 100us or 2ms (or 0), got {text!r}")
    return float(m.group(1)) * _TIME_UNITS[m.group(2) or "s"]


def link_rate_from_environment() -> float | None:
    """The link rate ``jaxdist cluster`` capped every host's link at, in bytes per second;
    None outside an emulated cluster."""
    bits = os.environ.get(RATE_VARIABLE, "")
    if not bits:
        return None
    if not bits.isdigit() or int(bits) == 0:
        raise ValueError(
            f"{RATE_VARIABLE} must be a positive whole number of bits per second, got {bits!r}"
        )
    return int(bits) / 8


def link_from_environment() -> cost_model.Link | None:
    """The emulated cluster's link (its delay and rate) for the cost model; None outside one."""
    rate = link_rate_from_environment()
    if rate is None:
        return None
    return cost_model.Link(parse_latency(os.environ.get(LATENCY_VARIABLE) or "0"), 1 / rate)

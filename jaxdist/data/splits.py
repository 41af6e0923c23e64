"""Split strings, as TFDS and Hugging Face ``datasets`` write them, for every source.

``data.train_split`` and ``data.eval_split`` name what to read::

    train                     the whole train split
    train[:90%]               its first 90% (big_vision's ``train[:99%]`` minival style)
    train[90%:]               the rest: disjoint from train[:90%]
    train[1000:2000]          records 1000 to 1999
    train[-10%:]              the last 10%
    train+validation          both, one after the other
    test                      any split the dataset has (a dataset with only train and test)

A bound in percent is rounded to the closest record (``round(pct * n / 100)``), as TFDS and
``datasets`` round it. TFDS and Hugging Face datasets are sliced in their stored order (TFDS
shuffles records when it prepares them). A folder, and its ArrayRecord conversion, stores
its records by class: it is sliced in a fixed shuffle of its records (:data:`SLICE_SEED`), so
that ``train[:90%]`` holds about 90% of every class rather than the first 90% of the classes;
the records selected keep the stored order. Either way a split is deterministic, the same
for every process, and resumes exactly. ``val`` means the dataset's held-out split by its
usual name (``validation``, ``val`` or ``valid``).
"""

from __future__ import annotations

import bisect
import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxdist.data.sources import DatasetError, ImageSource

__all__ = ["SplitPart", "SplitSource", "open_split", "overlap", "parse_split"]

_BOUND = r"-?\d+(?:\.\d+)?%|-?\d+"  # a percent (may be fractional) or a record count
_PART = re.compile(
    rf"\s*(?P<name>[A-Za-z0-9_.-]+)\s*"
    rf"(?:\[\s*(?P<start>{_BOUND})?\s*:\s*(?P<stop>{_BOUND})?\s*\])?\s*"
)
FORMAT = "NAME or NAME[START:STOP] (records or percent), joined by '+', e.g. 'train[:90%]'"
SLICE_SEED = 0  # the fixed shuffle a split stored by class is sliced in


@dataclasses.dataclass(frozen=True)
class SplitPart:
    """One ``name[start:stop]`` of a split string; a bound is a record count or ``"12.5%"``."""

    name: str
    start: str | None = None
    stop: str | None = None

    def records(self, size: int) -> range:
        """The record indices this part selects from a split of ``size`` records."""
        return range(*slice(_bound(self.start, size), _bound(self.stop, size)).indices(size))

    def __str__(self) -> str:
        if self.start is None and self.stop is None:
            return self.name
        return f"{self.name}[{self.start or ''}:{self.stop or ''}]"


def _bound(text: str | None, size: int) -> int | None:
    if text is None:
        return None
    if text.endswith("%"):
        return round(float(text[:-1]) * size / 100)
    return int(text)


def parse_split(text: str, field: str = "split") -> list[SplitPart]:
    """``"train[:90%]+validation"`` -> its parts; anything else is one line naming ``field``."""
    parts = []
    for piece in str(text).split("+"):
        found = _PART.fullmatch(piece)
        bounds = (found["start"], found["stop"]) if found else ()
        if not found or any(b and b.endswith("%") and abs(float(b[:-1])) > 100 for b in bounds):
            raise DatasetError(f"{field}: expected {FORMAT}; got {text!r}")
        parts.append(SplitPart(found["name"], found["start"], found["stop"]))
    return parts


class SplitSource:
    """The records a split string selects, from the sources of its named splits, in order."""

    def __init__(self, pieces: list[tuple[ImageSource, Sequence[int]]], text: str) -> None:
        first = pieces[0][0]
        for source, _ in pieces[1:]:
            if tuple(source.classes) != tuple(first.classes):
                raise DatasetError(
                    f"split {text!r} joins splits with different classes ({len(first.classes)} "
                    f"and {len(source.classes)}); join splits of one dataset"
                )
        self.text = text
        self.pieces = pieces
        self.encoded = first.encoded
        self.classes = first.classes
        self.mean, self.std = first.mean, first.std
        self._starts = []
        total = 0
        for _, records in pieces:
            self._starts.append(total)
            total += len(records)
        self._len = total

    def __len__(self) -> int:
        return self._len

    def locate(self, index: int) -> tuple[ImageSource, int]:
        """The source record ``index`` comes from, and its index there."""
        if not 0 <= index < self._len:
            raise IndexError(f"record {index} of split {self.text!r} ({self._len} records)")
        k = bisect.bisect_right(self._starts, index) - 1
        source, records = self.pieces[k]
        return source, int(records[index - self._starts[k]])

    def __getitem__(self, index: int) -> dict[str, Any]:
        source, inner = self.locate(index)
        return source[inner]

    def __repr__(self) -> str:
        return f"SplitSource({self.text!r}, {self._len} records, {len(self.classes)} classes)"


def open_split(text: str, open_named: Callable[[str], ImageSource], field: str) -> ImageSource:
    """The source of split string ``text``; ``open_named(name)`` opens one named split (each
    once). A whole single split is that split's own source."""
    parts = parse_split(text, field)
    opened: dict[str, ImageSource] = {}
    for part in parts:
        if part.name not in opened:
            opened[part.name] = open_named(part.name)
    if len(parts) == 1 and parts[0].start is None and parts[0].stop is None:
        return opened[parts[0].name]
    pieces = [(opened[p.name], selected(opened[p.name], p)) for p in parts]
    empty = [str(p) for p, (_, r) in zip(parts, pieces, strict=True) if not len(r)]
    if empty:
        sizes = ", ".join(f"{name} has {len(s)}" for name, s in opened.items())
        raise DatasetError(f"{field} {text!r}: {' and '.join(empty)} selects no records ({sizes})")
    return SplitSource(pieces, text)


def selected(source: ImageSource, part: SplitPart) -> Sequence[int]:
    """The indices of ``source`` that ``part`` selects: a range of the stored order, or for
    a source stored by class (``stored_by_class``) a slice of its fixed shuffle, sorted."""
    records = part.records(len(source))
    if not getattr(source, "stored_by_class", False):
        return records
    order = np.random.default_rng(SLICE_SEED).permutation(len(source))
    return np.sort(order[records.start : records.stop])


def overlap(train: str, held_out: str, sizes: dict[str, int]) -> str:
    """How the records of split strings ``train`` and ``held_out`` overlap (``""`` if they do
    not), given the sizes of the named splits."""
    for a in parse_split(train):
        for b in parse_split(held_out):
            if a.name != b.name or a.name not in sizes:
                continue
            both = set(a.records(sizes[a.name])) & set(b.records(sizes[b.name]))
            if both:
                return f"{len(both)} records of {a.name!r}"
    return ""

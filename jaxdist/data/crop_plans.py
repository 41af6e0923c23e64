"""Planned records: each sample's crop window and flip, worked out before any decode.

A loader that decodes elsewhere (DALI, on a GPU) is handed plans instead of images: the
encoded bytes, the crop window in stored pixels, the size the grain loader's reduced-scale
decode would give the window, the flip, the label. The plans come from the grain loader's
own planning code (:meth:`~jaxdist.data.transforms.DecodeTrain.plan`) with the same
position-keyed RNG, so both loaders cut the same window of every sample.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import grain.python as grain
import numpy as np
import simplejpeg

from jaxdist.data.transforms import DecodeEval, DecodeTrain, decode_scale

__all__ = ["PlanEval", "PlanPadding", "PlanTrain", "PlannedBatch", "planned_record"]


class PlannedBatch:
    """A batch of planned records as grain collates them: the encoded bytes, each crop
    window in stored pixels (rounded to whole pixels), the reduced size the grain loader
    would decode it at, the flips, labels and (eval) masks."""

    def __init__(self, records: Sequence[Mapping[str, Any]]) -> None:
        self.jpegs = [np.frombuffer(r["jpeg"], np.uint8) for r in records]
        self.anchors = np.array([r["window"][:2] for r in records], np.int32)
        self.shapes = np.array([r["window"][2:] for r in records], np.int32)
        self.reduced = np.array([r["reduced"] for r in records], np.float32)
        self.reduce = np.any(self.reduced != self.shapes, axis=1)
        self.flips = np.array([r["flip"] for r in records], np.int32)
        self.labels = np.array([r["label"] for r in records], np.int32)
        self.masks = np.array([r.get("mask", True) for r in records], np.bool_)

    def __len__(self) -> int:
        return len(self.labels)

    def rows(self, start: int, stop: int) -> dict[str, list[np.ndarray]]:
        """The DALI inputs of rows ``[start, stop)``, one array per sample."""
        return {
            "jpegs": self.jpegs[start:stop],
            "anchors": list(self.anchors[start:stop]),
            "shapes": list(self.shapes[start:stop]),
            "reduced": list(self.reduced[start:stop]),
            "reduce": list(self.reduce[start:stop]),
            "flips": list(self.flips[start:stop]),
        }


def planned_record(
    stored: tuple[int, int], box: tuple, flip: bool, record: Mapping, size: int
) -> dict[str, Any]:
    """One record's plan: the window rounded to whole stored pixels (at least one), and the
    window's size at the grain loader's decode scale."""
    height, width = stored
    top, left, crop_h, crop_w = box
    y0, x0 = round(top), round(left)
    y1 = min(height, max(round(top + crop_h), y0 + 1))
    x1 = min(width, max(round(left + crop_w), x0 + 1))
    scale = decode_scale(box, size)
    reduced = (math.ceil((y1 - y0) * scale), math.ceil((x1 - x0) * scale))
    return {
        "jpeg": record["jpeg"],
        "window": (y0, x0, y1 - y0, x1 - x0),
        "reduced": reduced,
        "flip": flip,
        "label": record["label"],
    }


class PlanTrain(grain.RandomMapTransform):
    """Record -> its plan under :class:`~jaxdist.data.transforms.DecodeTrain`'s crop and
    flip, drawn from the same RNG: the grain loader's window for the same sample."""

    def __init__(self, image_size: int) -> None:
        self.decode = DecodeTrain(image_size)

    def random_map(self, record: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        stored, box, flip = self.decode.plan(record, rng)
        return planned_record(stored, box, flip, record, self.decode.image_size)


class PlanEval(grain.MapTransform):
    """Record -> its plan under the eval centre crop, marked real (``mask``)."""

    def __init__(self, image_size: int) -> None:
        self.decode = DecodeEval(image_size)

    def map(self, record: dict[str, Any]) -> dict[str, Any]:
        stored, box = self.decode.plan(record)
        planned = planned_record(stored, box, False, record, self.decode.image_size)
        return {**planned, "mask": True}


BLANK_JPEG = simplejpeg.encode_jpeg(np.zeros((8, 8, 3), np.uint8), quality=90)


class PlanPadding(grain.MapTransform):
    """A padding record (``mask=False``): an 8x8 black JPEG, its image zeroed after decode."""

    def map(self, _: Any) -> dict[str, Any]:
        return {
            "jpeg": BLANK_JPEG,
            "window": (0, 0, 8, 8),
            "reduced": (8, 8),
            "flip": False,
            "label": 0,
            "mask": False,
        }

"""Image transforms: JPEG decode, Inception-style crops, flips and normalisation.

Crops are chosen in the coordinates of the *stored* image, from its JPEG header alone. The
JPEG is then decoded at the smallest of the scales 1/8, 1/4, 1/2 and 1 that still leaves the
crop at least as large as the output (the IDCT's own downscale, a box filter, and the scales
libjpeg-turbo decodes with SIMD; its 3/8 .. 7/8 scales decode slower than a full decode), so
what remains is at most a 2x downscale, which one bilinear resize of the crop window does
(OpenCV's, as TensorFlow's reference ImageNet pipelines resize, without antialiasing). A flip
is the resized image's columns reversed in place of a copy.

Per 500x375 photograph (quality 90) on one core, the work is the entropy decode (about 1.2
ms, whatever the scale), the IDCT and colour conversion (about 0.5 ms at full scale), and
the resize (about 0.2 ms); ``benchmarks/input_pipeline.py`` measures it.

The grain transforms at the bottom are module-level classes holding only plain attributes, so
they pickle into grain's worker processes (``worker_count > 0``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import cv2
import grain.python as grain
import numpy as np
import simplejpeg
from PIL import Image

from jaxdist.data.sources import DatasetError

__all__ = [
    "DecodeEval",
    "DecodeTrain",
    "decode",
    "decode_crop_resize",
    "normalize",
]

AREA_RANGE = (0.08, 1.0)
ASPECT_RANGE = (3 / 4, 4 / 3)
EVAL_CROP_FRACTION = 0.875  # 224 of 256: resize the short side to size/0.875, crop the centre
DECODE_SCALES = (1 / 8, 1 / 4, 1 / 2, 1.0)

Box = tuple[float, float, float, float]  # (top, left, height, width) in stored-image pixels


def stored_size(data: bytes, name: str = "<bytes>") -> tuple[int, int]:
    """``(height, width)`` of an encoded image: from a JPEG's header, or from Pillow's decode of
    any other format (PNG, ImageNet's few CMYK JPEGs)."""
    try:
        height, width, _, _ = simplejpeg.decode_jpeg_header(data)
        return int(height), int(width)
    except ValueError:
        return _pil_decode(data, name).shape[:2]


def decode(
    data: bytes, name: str = "<bytes>", min_height: int = 0, min_width: int = 0
) -> np.ndarray:
    """Decode to RGB uint8 ``[H, W, 3]``, possibly reduced in size but at least ``min_height``
    x ``min_width``. CMYK and non-JPEG files (ImageNet has a few) go through PIL instead.

    Raises :class:`DatasetError` naming ``name`` if neither can decode the bytes.
    """
    try:
        return simplejpeg.decode_jpeg(
            data, colorspace="RGB", min_height=min_height, min_width=min_width
        )
    except ValueError:
        return _pil_decode(data, name)


def _pil_decode(data: bytes, name: str) -> np.ndarray:
    import io

    try:
        with Image.open(io.BytesIO(data)) as img:
            return np.asarray(img.convert("RGB"))
    except Exception as err:  # PIL raises many types for broken files
        reason = "empty file" if not data else f"not a JPEG or other image ({type(err).__name__})"
        raise DatasetError(
            f"cannot decode image {name}: {reason}; `jaxdist data inspect DATASET --verify` "
            "lists every such file"
        ) from err


def random_resized_crop_box(
    height: int,
    width: int,
    rng: np.random.Generator,
    area_range: tuple[float, float] = AREA_RANGE,
    aspect_range: tuple[float, float] = ASPECT_RANGE,
    attempts: int = 10,
) -> Box:
    """Inception-style crop: area a fraction of the image drawn from ``area_range``, aspect
    ratio log-uniform in ``aspect_range``; after ``attempts`` misses, the largest centred crop
    whose aspect ratio lies in the range."""
    area = height * width
    log_lo, log_hi = math.log(aspect_range[0]), math.log(aspect_range[1])
    for _ in range(attempts):
        target = area * rng.uniform(*area_range)
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        crop_w = round(math.sqrt(target * aspect))
        crop_h = round(math.sqrt(target / aspect))
        if 0 < crop_w <= width and 0 < crop_h <= height:
            top = int(rng.integers(0, height - crop_h + 1))
            left = int(rng.integers(0, width - crop_w + 1))
            return float(top), float(left), float(crop_h), float(crop_w)
    ratio = width / height
    if ratio < aspect_range[0]:
        crop_w, crop_h = width, round(width / aspect_range[0])
    elif ratio > aspect_range[1]:
        crop_h, crop_w = height, round(height * aspect_range[1])
    else:
        crop_h, crop_w = height, width
    return (height - crop_h) / 2, (width - crop_w) / 2, float(crop_h), float(crop_w)


def center_crop_box(height: int, width: int, crop_fraction: float = EVAL_CROP_FRACTION) -> Box:
    """Centred square of side ``crop_fraction * min(height, width)``: the same pixels as
    resizing the short side to ``size / crop_fraction`` and cutting out the centre ``size``."""
    side = crop_fraction * min(height, width)
    return (height - side) / 2, (width - side) / 2, side, side


def decode_scale(box: Box, size: int) -> float:
    """The smallest of 1/8, 1/4, 1/2 and 1 at which ``box`` still covers ``size x size``."""
    _, _, crop_h, crop_w = box
    need = max(size / crop_h, size / crop_w)
    return next((s for s in DECODE_SCALES if s >= need), 1.0)


def decode_crop_resize(
    data: bytes,
    box: Box,
    size: int,
    name: str = "<bytes>",
    stored: tuple[int, int] | None = None,
    flip: bool = False,
) -> np.ndarray:
    """Decode ``data`` (at a reduced scale where the crop allows), cut ``box`` out, resize it
    to ``size x size`` bilinearly and mirror it left-right if ``flip``. Returns uint8
    ``[size, size, 3]``.

    ``stored`` is ``stored_size(data)`` when the caller already has it."""
    height, width = stored or stored_size(data, name)
    scale = decode_scale(box, size)
    min_h, min_w = math.ceil(height * scale), math.ceil(width * scale)
    image = decode(data, name, min_height=min_h, min_width=min_w)
    # The decoded size is what the decoder chose (PIL's fall-back decodes at full size).
    scale_y, scale_x = image.shape[0] / height, image.shape[1] / width
    top, left, crop_h, crop_w = box
    y0, x0 = round(top * scale_y), round(left * scale_x)
    y1 = max(round((top + crop_h) * scale_y), y0 + 1)
    x1 = max(round((left + crop_w) * scale_x), x0 + 1)
    resized = cv2.resize(image[y0:y1, x0:x1], (size, size), interpolation=cv2.INTER_LINEAR)
    if flip:
        resized = cv2.flip(resized, 1)
    return resized


def normalize(images: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """``(images - mean) / std`` in float32, as ``images * (1/std) + (-mean/std)``; mean and
    std are per channel in 0-255 units.

    Works on numpy and jax arrays alike, so a uint8 pipeline can normalise on the device."""
    scale, offset = _scale_offset(mean, std)
    return images.astype(np.float32) * scale + offset


def _scale_offset(mean: Sequence[float], std: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    std = np.asarray(std, dtype=np.float64)
    scale = (1.0 / std).astype(np.float32)
    offset = (-np.asarray(mean, dtype=np.float64) / std).astype(np.float32)
    return scale, offset


# --------------------------------------------------------------------------- grain transforms


class DecodeTrain(grain.RandomMapTransform):
    """Encoded record -> random-resized-crop + random horizontal flip, uint8 ``[S, S, 3]``.

    The ``rng`` comes from grain, seeded by the pipeline seed and the record's position in the
    global sample stream, so the augmentation of every sample is reproducible."""

    def __init__(
        self,
        image_size: int,
        area_range: tuple[float, float] = AREA_RANGE,
        aspect_range: tuple[float, float] = ASPECT_RANGE,
        flip: bool = True,
    ) -> None:
        self.image_size = image_size
        self.area_range = tuple(area_range)
        self.aspect_range = tuple(aspect_range)
        self.flip = flip

    def random_map(self, record: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        stored, box, flip = self.plan(record, rng)
        jpeg, name = record["jpeg"], record["name"]
        image = decode_crop_resize(jpeg, box, self.image_size, name, stored, flip)
        return {"image": image, "label": record["label"]}

    def plan(
        self, record: dict[str, Any], rng: np.random.Generator
    ) -> tuple[tuple[int, int], Box, bool]:
        """The stored size, the crop box and the flip of ``record``: two loaders that plan
        with the same ``rng`` cut the same window."""
        height, width = stored_size(record["jpeg"], record["name"])
        box = random_resized_crop_box(height, width, rng, self.area_range, self.aspect_range)
        flip = bool(self.flip and rng.random() < 0.5)
        return (height, width), box, flip


class DecodeEval(grain.MapTransform):
    """Encoded record -> resize + centre crop, uint8 ``[S, S, 3]``."""

    def __init__(self, image_size: int, crop_fraction: float = EVAL_CROP_FRACTION) -> None:
        self.image_size = image_size
        self.crop_fraction = crop_fraction

    def map(self, record: dict[str, Any]) -> dict[str, Any]:
        stored, box = self.plan(record)
        image = decode_crop_resize(record["jpeg"], box, self.image_size, record["name"], stored)
        return {"image": image, "label": record["label"]}

    def plan(self, record: dict[str, Any]) -> tuple[tuple[int, int], Box]:
        """The stored size and the centre crop box of ``record``."""
        height, width = stored_size(record["jpeg"], record["name"])
        return (height, width), center_crop_box(height, width, self.crop_fraction)


class ToOutput(grain.MapTransform):
    """Final element: ``image`` as uint8 or normalised float32, ``label`` as int32, and
    ``mask`` (True for real samples) when ``with_mask``."""

    def __init__(
        self,
        dtype: str,
        mean: Sequence[float],
        std: Sequence[float],
        with_mask: bool = False,
    ) -> None:
        if dtype not in ("uint8", "float32"):
            raise ValueError(f"output dtype must be 'uint8' or 'float32', got {dtype!r}")
        self.dtype = dtype
        self.mean = tuple(mean)
        self.std = tuple(std)
        self.with_mask = with_mask
        self._scale, self._offset = _scale_offset(self.mean, self.std)

    def map(self, record: dict[str, Any]) -> dict[str, Any]:
        image = np.ascontiguousarray(record["image"])
        if self.dtype == "float32":
            image = self._normalized(image)
        out = {"image": image, "label": np.int32(record["label"])}
        if self.with_mask:
            out["mask"] = np.bool_(True)
        return out

    def _normalized(self, image: np.ndarray) -> np.ndarray:
        """normalize()'s arithmetic into one float32 buffer, a row of pixels at a time: with
        the per-channel factors tiled along the row, numpy's inner loops run a whole row
        rather than 3 channels (5x faster at 224x224 than broadcasting over channels)."""
        rows = image.reshape(image.shape[0], -1)
        reps = rows.shape[1] // len(self._scale)
        out = np.multiply(rows, np.tile(self._scale, reps), dtype=np.float32)
        out += np.tile(self._offset, reps)
        return out.reshape(image.shape)


class Padding(grain.MapTransform):
    """An all-zero element with ``mask=False``: fills the last eval batch so every process
    runs the same number of same-shaped steps."""

    def __init__(self, image_shape: tuple[int, ...], dtype: str) -> None:
        self.image_shape = tuple(image_shape)
        self.dtype = dtype

    def map(self, _: Any) -> dict[str, Any]:
        return {
            "image": np.zeros(self.image_shape, dtype=self.dtype),
            "label": np.int32(0),
            "mask": np.bool_(False),
        }

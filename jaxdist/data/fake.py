"""Write a small ImageNet-format folder of real JPEGs: for tests, smoke runs and benchmarks."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import simplejpeg
from PIL import Image

__all__ = ["STYLES", "photo_like", "write_image_folder"]

STYLES = ("smooth", "photo")


def smooth_field(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """Upsampled 6x6 colour noise: tiny files, quick to write and decode (tests)."""
    coarse = rng.integers(0, 256, size=(6, 6, 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC))


def photo_like(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """Colour noise with a photograph's spectrum (power falling as 1/f^2, channels mostly
    correlated): at quality 90 a 500x375 image is about 115 KB, as ImageNet's photographs
    are, so it costs the decoder what a photograph costs (benchmarks)."""
    fy = np.fft.fftfreq(height)[:, None]
    fx = np.fft.rfftfreq(width)[None, :]
    falloff = np.hypot(fy, fx)
    falloff[0, 0] = 1.0

    def noise() -> np.ndarray:
        return rng.normal(size=falloff.shape) + 1j * rng.normal(size=falloff.shape)

    shared = noise()
    channels = []
    for _ in range(3):
        plane = np.fft.irfft2((0.8 * shared + 0.2 * noise()) / falloff, s=(height, width))
        channels.append((plane - plane.mean()) / plane.std())
    image = np.stack(channels, -1) * 50 + rng.uniform(80, 170, size=3)
    return np.clip(image, 0, 255).astype(np.uint8)


def write_image_folder(
    root: str | os.PathLike,
    num_classes: int = 3,
    train_per_class: int = 6,
    val_per_class: int = 2,
    size_range: tuple[int, int] = (48, 160),
    seed: int = 0,
    style: str = "smooth",
) -> Path:
    """Create ``ROOT/{train,val}/class_XX/img_YYYY.JPEG`` (quality 90, 4:2:0) with images of
    sides drawn from ``size_range``. ``style="smooth"``: smooth colour fields with a per-class
    tint (small files); ``"photo"``: :func:`photo_like` images. Returns ``root``."""
    if style not in STYLES:
        raise ValueError(f"image style must be one of {STYLES}, got {style!r}")
    root = Path(root)
    rng = np.random.default_rng(seed)
    for split, per_class in (("train", train_per_class), ("val", val_per_class)):
        for label in range(num_classes):
            folder = root / split / f"class_{label:02d}"
            folder.mkdir(parents=True, exist_ok=True)
            tint = rng.integers(0, 256, size=3)
            for i in range(per_class):
                height, width = (int(x) for x in rng.integers(*size_range, endpoint=True, size=2))
                if style == "photo":
                    image = photo_like(rng, height, width)
                else:
                    field = smooth_field(rng, height, width)
                    image = ((field.astype(np.uint16) + tint) // 2).astype(np.uint8)
                data = simplejpeg.encode_jpeg(
                    np.ascontiguousarray(image), quality=90, colorsubsampling="420"
                )
                (folder / f"img_{i:04d}.JPEG").write_bytes(data)
    return root

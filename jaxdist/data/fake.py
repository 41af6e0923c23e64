"""Write a small ImageNet-format folder of real JPEGs: for tests, smoke runs and benchmarks."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import simplejpeg
from PIL import Image

__all__ = ["write_image_folder"]


def write_image_folder(
    root: str | os.PathLike,
    num_classes: int = 3,
    train_per_class: int = 6,
    val_per_class: int = 2,
    size_range: tuple[int, int] = (48, 160),
    seed: int = 0,
) -> Path:
    """Create ``ROOT/{train,val}/class_XX/img_YYYY.JPEG`` with images of varied sizes.

    Images are smooth colour fields (upsampled noise with a per-class tint), which compress
    like photos rather than like white noise. Returns ``root``.
    """
    root = Path(root)
    rng = np.random.default_rng(seed)
    for split, per_class in (("train", train_per_class), ("val", val_per_class)):
        for label in range(num_classes):
            folder = root / split / f"class_{label:02d}"
            folder.mkdir(parents=True, exist_ok=True)
            tint = rng.integers(0, 256, size=3)
            for i in range(per_class):
                height, width = rng.integers(size_range[0], size_range[1] + 1, size=2)
                coarse = rng.integers(0, 256, size=(6, 6, 3), dtype=np.uint8)
                field = np.asarray(
                    Image.fromarray(coarse).resize(
                        (int(width), int(height)), Image.Resampling.BICUBIC
                    )
                )
                image = ((field.astype(np.uint16) + tint) // 2).astype(np.uint8)
                data = simplejpeg.encode_jpeg(
                    np.ascontiguousarray(image), quality=90, colorsubsampling="420"
                )
                (folder / f"img_{i:04d}.JPEG").write_bytes(data)
    return root

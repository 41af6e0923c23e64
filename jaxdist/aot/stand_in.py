"""What a plan trains on in place of a dataset it cannot read: nothing is read when planning,
so a recipe that reads images from disk is planned on synthetic images of the same size and
ImageNet's count (1,281,167 images, 1000 classes)."""

from __future__ import annotations

import copy

import ml_collections

from jaxdist.data.config import ENCODED_SOURCES, SYNTHETIC_CLASSES

__all__ = ["stand_in_data"]


def stand_in_data(config: ml_collections.ConfigDict) -> tuple[ml_collections.ConfigDict, str]:
    """The config with a synthetic source in place of one read from disk."""
    source = config.data.get("source")
    if source is None:
        return config, "the task's own data"
    if source not in ENCODED_SOURCES:
        return config, f"the recipe's {source!r} data"
    config = copy.deepcopy(config)
    config.data.source = "synthetic"
    config.data.root = None
    size = config.data.image_size
    note = (
        f"synthetic stand-in for the recipe's {source} data: "
        f"{config.data.synthetic_train_examples:,} images {size}x{size}x3, "
        f"{config.data.num_classes or SYNTHETIC_CLASSES} classes (nothing is read)"
    )
    return config, note

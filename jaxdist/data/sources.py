"""Random-access data sources: an ImageNet-style image folder, synthetic images, in-memory arrays.

A source is what grain calls a ``RandomAccessDataSource``: ``len(source)`` and
``source[i] -> record``. Records come in two kinds, told apart by ``source.encoded``:

* encoded: ``{"jpeg": bytes, "label": int, "name": str}`` -- the bytes of a JPEG, PNG or any
  image Pillow reads (the key keeps its name: JPEG is what a fast decode is for); ``name`` is
  the file the bytes came from, so a decode error can say which file is broken;
* decoded: ``{"image": uint8[H, W, C], "label": int}``.

Sources know nothing about shuffling, sharding or batching; :mod:`jaxdist.data.pipeline` does
that with grain. The ArrayRecord source lives in :mod:`jaxdist.data.arrayrecord`, the TFDS and
Hugging Face sources in :mod:`jaxdist.data.tfds_source` and :mod:`jaxdist.data.hf_source`; the
helpers at the end of this module are what those two share.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "ArraySource",
    "DatasetError",
    "ImageFolderSource",
    "ImageSource",
    "SyntheticSource",
]

# ImageNet channel statistics in 0-255 units (the usual torchvision / flax values).
IMAGENET_MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)

JPEG_SUFFIXES = (".jpeg", ".jpg")
# What the folder source lists: JPEG (decoded at reduced scale) and what else Pillow reads.
IMAGE_SUFFIXES = (*JPEG_SUFFIXES, ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm")
SPLITS = ("train", "val")


def folder_layout(root: str | os.PathLike) -> str:
    """The expected folder layout and what is there instead, for error messages: a root one
    level too deep (a split folder) or too high (a folder holding the dataset) is named."""
    expected = f"expected {root}/train/<class>/*.JPEG and {root}/val/<class>/*.JPEG"
    return expected + found_under(Path(root))


def found_under(root: Path) -> str:
    """``"; <what root holds>"``: the hint that ends a "not found" message."""
    if not root.is_dir():
        parent = root.parent
        names = _folders(parent) if parent.is_dir() else []
        return f"; {parent} has {names[:8]}" if names else ""
    names = _folders(root)
    if not names:
        return f"; {root} holds no folders"
    if any(_holds_images(root / name) for name in names[:3]):
        return f"; {root} looks like one split (its folders hold images): give its parent {root.parent}"
    holding = [name for name in names if (root / name / "train").is_dir()]
    if holding:
        return f"; {root / holding[0]} has a train folder: give that as the root"
    return f"; {root} has {names[:8]}{' ...' if len(names) > 8 else ''}"


def _folders(path: Path) -> list[str]:
    return sorted(e.name for e in os.scandir(path) if e.is_dir() and not e.name.startswith("."))


def _holds_images(path: Path) -> bool:
    for count, entry in enumerate(os.scandir(path)):
        if entry.is_file() and os.path.splitext(entry.name)[1].lower() in IMAGE_SUFFIXES:
            return True
        if count > 20:
            break
    return False


class DatasetError(ValueError):
    """A dataset is missing or malformed; the message names the path and the expected layout."""

    exit_code = 1  # what is on disk is wrong, not the command


@runtime_checkable
class ImageSource(Protocol):
    """What the pipeline needs from a source."""

    encoded: bool  # records hold JPEG bytes (True) or decoded uint8 images (False)
    classes: tuple[str, ...]
    mean: tuple[float, ...]  # per-channel, 0-255 units, used for normalisation
    std: tuple[float, ...]

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> dict[str, Any]: ...


def list_image_folder(
    root: str | os.PathLike, split: str, classes: Sequence[str] | None = None
) -> tuple[tuple[str, ...], list[str], np.ndarray]:
    """List ``ROOT/<split>/<class>/*.JPEG``.

    Args:
      root: dataset root.
      split: ``"train"`` or ``"val"``.
      classes: the label space; ``None`` means the sorted class folders of ``ROOT/train``, so
        that train and val agree on label ids.

    Returns:
      ``(classes, files, labels)``: files are paths relative to ``root``, sorted by class then
      file name; ``labels[i]`` is the class index of ``files[i]``.
    """
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(
            f"dataset root {root} does not exist or is not a folder; {folder_layout(root)}"
        )
    if classes is None:
        classes = _class_folders(root, "train")
    split_dir = root / split
    if not split_dir.is_dir():
        raise DatasetError(f"no split folder {split_dir}; {folder_layout(root)}")
    present = _class_folders(root, split) if split != "train" else tuple(classes)
    unknown = sorted(set(present) - set(classes))
    if unknown:
        raise DatasetError(
            f"{split_dir} has class folders that {root}/train lacks: {unknown[:5]}"
            f"{' ...' if len(unknown) > 5 else ''}; every split must use the train classes"
        )
    files: list[str] = []
    labels: list[int] = []
    for label, name in enumerate(classes):
        class_dir = split_dir / name
        if not class_dir.is_dir():
            continue  # a val split may lack a class; train folders were listed from disk
        names = sorted(
            e.name
            for e in os.scandir(class_dir)
            if e.is_file() and os.path.splitext(e.name)[1].lower() in IMAGE_SUFFIXES
        )
        if not names:
            raise DatasetError(
                f"class folder {class_dir} has no image files (*.JPEG, *.jpg, *.png, ...); "
                f"{folder_layout(root)}"
            )
        files.extend(f"{split}/{name}/{n}" for n in names)
        labels.extend([label] * len(names))
    return tuple(classes), files, np.asarray(labels, dtype=np.int32)


def _class_folders(root: Path, split: str) -> tuple[str, ...]:
    split_dir = root / split
    if not split_dir.is_dir():
        raise DatasetError(f"no split folder {split_dir}; {folder_layout(root)}")
    names = sorted(e.name for e in os.scandir(split_dir) if e.is_dir())
    if not names:
        raise DatasetError(
            f"no class folders under {split_dir}; expected {split_dir}/<class>/*.JPEG"
        )
    return tuple(names)


class ImageFolderSource:
    """JPEG files laid out as ``ROOT/<split>/<class>/*.JPEG`` (classes = sorted folder names).

    The listing happens once, at construction; records read the file on access, so the
    source is cheap to pickle into grain worker processes.
    """

    encoded = True
    stored_by_class = True  # split strings slice it in a fixed shuffle (jaxdist.data.splits)
    mean = IMAGENET_MEAN
    std = IMAGENET_STD

    def __init__(
        self, root: str | os.PathLike, split: str, classes: Sequence[str] | None = None
    ) -> None:
        self.root = Path(root)
        self.split = split
        self.classes, self.files, self.labels = list_image_folder(root, split, classes)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> dict[str, Any]:
        path = self.root / self.files[index]
        try:
            data = path.read_bytes()
        except OSError as err:
            raise DatasetError(f"cannot read {path}: {err}") from err
        return {"jpeg": data, "label": int(self.labels[index]), "name": str(path)}

    def __repr__(self) -> str:
        return f"ImageFolderSource({str(self.root)!r}, {self.split!r}, {len(self)} images, {len(self.classes)} classes)"


class SyntheticSource:
    """Random uint8 images and labels, a pure function of ``(seed, index)``.

    For throughput runs: no files, no decode, so it measures the rest of the pipeline and the
    train step. Images are generated on access, so a source of ImageNet's size costs nothing.
    """

    encoded = False
    mean = IMAGENET_MEAN
    std = IMAGENET_STD

    def __init__(
        self,
        num_records: int,
        image_shape: tuple[int, int, int] = (224, 224, 3),
        num_classes: int = 1000,
        seed: int = 0,
    ) -> None:
        if num_records < 1 or num_classes < 1 or len(image_shape) != 3 or min(image_shape) < 1:
            raise ValueError(
                f"synthetic source needs num_records >= 1, num_classes >= 1 and an (H, W, C) "
                f"image_shape; got {num_records}, {num_classes}, {image_shape}"
            )
        self.num_records = num_records
        self.image_shape = tuple(image_shape)
        self.classes = tuple(str(i) for i in range(num_classes))
        self.seed = seed

    def __len__(self) -> int:
        return self.num_records

    def __getitem__(self, index: int) -> dict[str, Any]:
        rng = np.random.default_rng((self.seed, int(index)))
        image = rng.integers(0, 256, size=self.image_shape, dtype=np.uint8)
        return {"image": image, "label": int(rng.integers(len(self.classes)))}

    def __repr__(self) -> str:
        return f"SyntheticSource({self.num_records}, {self.image_shape}, {len(self.classes)} classes, seed={self.seed})"


class ArraySource:
    """Decoded images held in memory: ``images`` uint8 ``[N, H, W, C]``, ``labels`` ``[N]``."""

    encoded = False

    def __init__(
        self,
        images: np.ndarray,
        labels: np.ndarray,
        classes: Sequence[str],
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        name: str = "arrays",
    ) -> None:
        images = np.asarray(images)
        labels = np.asarray(labels)
        if images.dtype != np.uint8 or images.ndim != 4:
            raise ValueError(
                f"{name}: images must be uint8 [N, H, W, C], got {images.dtype} {images.shape}"
            )
        if labels.shape != (images.shape[0],):
            raise ValueError(
                f"{name}: labels must have shape ({images.shape[0]},), got {labels.shape}"
            )
        if len(images) == 0:
            raise DatasetError(f"{name}: no images")
        self.images = images
        self.labels = labels.astype(np.int32)
        self.classes = tuple(classes)
        channels = images.shape[-1]
        # Statistics of these very images unless given (e.g. a held-out split passes train's).
        self.mean = (
            tuple(mean)
            if mean is not None
            else tuple(images.reshape(-1, channels).mean(0).tolist())
        )
        self.std = (
            tuple(std) if std is not None else tuple(images.reshape(-1, channels).std(0).tolist())
        )
        self.name = name

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"image": self.images[index], "label": int(self.labels[index])}

    def __repr__(self) -> str:
        return f"ArraySource({self.name!r}, {self.images.shape}, {len(self.classes)} classes)"


# Names the recipes' held-out split goes by in published datasets, in the order tried.
EVAL_SPLIT_NAMES = ("validation", "val", "valid")


def import_extra(module: str, extra: str, what: str) -> Any:
    """Import ``module``, or raise :class:`DatasetError` naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise DatasetError(
            f"{what} needs {module}, which is not installed ({err}): pip install 'jaxdist[{extra}]'"
        ) from err


def first_line(err: BaseException) -> str:
    """``Type: first line of the message``: what a catalog library's error says, in one line."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


# The names published datasets give their image and label columns, in the order tried
# (Hugging Face's cifar10 calls them img and label, cifar100 img and fine_label).
IMAGE_KEYS = ("image", "img", "jpg", "jpeg")
LABEL_KEYS = ("label", "labels", "fine_label", "class", "target")


def image_and_label(
    names: Sequence[str], where: str, noun: str, image_key: str = "", label_key: str = ""
) -> tuple[str, str]:
    """The ``noun``s (features, columns) of a dataset that hold its images and labels: the
    ones given (``data.image_key``, ``data.label_key``), else the first of the common names
    the dataset has; a name that is not there is refused in one line naming what is."""
    chosen = []
    for given, common, kind, field in (
        (image_key, IMAGE_KEYS, "image", "data.image_key"),
        (label_key, LABEL_KEYS, "label", "data.label_key"),
    ):
        if given:
            if given not in names:
                raise DatasetError(
                    f"{where} has no {given!r} {noun} ({field}); it has {sorted(names)}"
                )
            chosen.append(given)
            continue
        found = [name for name in common if name in names]
        if not found:
            raise DatasetError(
                f"{where} has no {kind} {noun} by a common name ({', '.join(common)}); it has "
                f"{sorted(names)}: set {field}"
            )
        chosen.append(found[0])
    return chosen[0], chosen[1]


def dataset_split(available: Sequence[str], split: str, dataset: str) -> str:
    """The dataset's name for the split named ``split``: ``val`` is the first of
    :data:`EVAL_SPLIT_NAMES` the dataset has; any other name is itself."""
    wanted = EVAL_SPLIT_NAMES if split == "val" else (split,)
    for name in wanted:
        if name in available:
            return name
    raise DatasetError(
        f"{dataset} has no {' or '.join(repr(w) for w in wanted)} split; it has {sorted(available)}"
    )


def encoded_image(data: Any, where: str) -> bytes:
    """``data`` if it is an encoded image (JPEG, PNG or any format Pillow reads); otherwise one
    line saying what the record holds. Whether the bytes decode is checked when they are."""
    if not isinstance(data, bytes):
        raise DatasetError(
            f"{where}: the image is {type(data).__name__}, not encoded bytes; jaxdist reads "
            f"encoded images (JPEG, PNG, ...) and decodes them itself"
        )
    if not data:
        raise DatasetError(f"{where}: the image is empty (0 bytes)")
    return data


def checked_label(label: Any, num_classes: int, where: str) -> int:
    """``label`` as an int in ``[0, num_classes)``, or one line naming the record."""
    value = int(label)
    if not 0 <= value < num_classes:
        raise DatasetError(
            f"{where}: label {value} is outside 0..{num_classes - 1} ({num_classes} classes)"
        )
    return value

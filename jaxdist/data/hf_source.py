"""A Hugging Face dataset, such as ``ILSVRC/imagenet-1k``, as a random-access source.

The dataset is read with the ``datasets`` library: parquet files of JPEG bytes become a
memory-mapped Arrow table in the cache once, after which any record is read by index, so
shuffling, exact resume and batch-size ramps work as with the other sources. The image column
is cast to ``Image(decode=False)``: records keep the JPEG bytes the dataset stores, and
jaxdist's reduced-scale decode and crops apply to them.

``dataset`` is a Hub name (read through the cache, so ``HF_HUB_OFFLINE=1`` works once it is
there), a local folder of the Hub layout (``data/train-*.parquet``,
``data/validation-*.parquet``) or a folder written by ``DatasetDict.save_to_disk``. The
recipe's ``val`` split is the dataset's ``validation`` (or ``val``); the image and label
columns are ``image_key`` and ``label_key``, or the first common names the dataset has
(:func:`~jaxdist.data.sources.image_and_label`); class names are the label column's
``ClassLabel`` names. Needs
the ``hf`` extra: ``pip install 'jaxdist[hf]'``.

``datasets`` draws progress bars while it prepares the cache ("Generating train split");
they stay out of a training run's output (``show_progress=True``, as ``jaxdist data inspect``
passes, keeps them).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from jaxdist.data.sources import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    DatasetError,
    checked_label,
    dataset_split,
    encoded_image,
    first_line,
    image_and_label,
    import_extra,
)
from jaxdist.data.transforms import stored_size

__all__ = ["HuggingFaceSource"]


class HuggingFaceSource:
    """Split ``split`` (``train`` or ``val``) of the Hugging Face dataset ``dataset``, with
    ``cache_dir`` as the ``datasets`` cache (``None``: its default, ``$HF_DATASETS_CACHE``)."""

    encoded = True
    mean = IMAGENET_MEAN
    std = IMAGENET_STD

    def __init__(
        self,
        dataset: str,
        split: str,
        cache_dir: str | None = None,
        show_progress: bool = False,
        image_key: str = "",
        label_key: str = "",
    ) -> None:
        datasets = import_extra("datasets", "hf", "the hf data source")
        self.dataset = dataset
        self._keys = (image_key, label_key)
        with _progress_bars(datasets, show_progress):
            self.split, table = _open_split(datasets, dataset, split, cache_dir)
            self._open_table(datasets, table, split)

    def _open_table(self, datasets: Any, table: Any, split: str) -> None:
        """Check the split's columns and labels and keep it, its images as stored bytes
        (``split``: the split asked for)."""
        where = f"hf dataset {self.dataset}"
        image, label_name = image_and_label(list(table.features), where, "column", *self._keys)
        label = table.features[label_name]
        if not isinstance(label, datasets.ClassLabel):
            raise DatasetError(f"{where}: {label_name!r} is {label!r}, not a ClassLabel with names")
        if not isinstance(table.features[image], datasets.Image):
            raise DatasetError(f"{where}: {image!r} is {table.features[image]!r}, not an Image")
        self.classes = tuple(label.names)
        # Only the two columns, under the names the records use (a dataset may have another
        # column called label beside the one chosen).
        table = table.select_columns([image, label_name])
        table = table.rename_columns({image: "image", label_name: "label"})
        self._table = table.cast_column("image", datasets.Image(decode=False))
        if len(self._table) == 0:
            raise _empty_split(where, self.split, split)
        self._check_labels()
        first = self[0]  # the first record's image is checked before any training
        stored_size(first["jpeg"], first["name"])  # decodes, whatever the format

    def _check_labels(self) -> None:
        """Every label in range, read from the label column alone (no image is touched)."""
        import pyarrow.compute as pc

        column = self._table.data.column("label")
        low, high = (v.as_py() for v in pc.min_max(column).values())
        if low is None:
            raise DatasetError(f"hf dataset {self.dataset}/{self.split}: labels are missing")
        for value in (low, high):
            if not 0 <= value < len(self.classes):
                index = pc.index(column, value).as_py()
                checked_label(value, len(self.classes), self._where(index))

    def labels(self) -> np.ndarray:
        """Every record's label, read from the label column alone."""
        return self._table.data.column("label").to_numpy().astype(np.int32)

    def _where(self, index: int) -> str:
        return f"hf:{self.dataset}/{self.split}[{index}]"

    def __len__(self) -> int:
        return len(self._table)

    def __getitem__(self, index: int) -> dict[str, Any]:
        record = self._table[int(index)]
        image = record["image"] or {}
        where = image.get("path") or self._where(index)
        data = image.get("bytes")
        if data is None and image.get("path"):  # a dataset built from local files keeps paths
            try:
                data = Path(image["path"]).read_bytes()
            except OSError as err:
                raise DatasetError(f"cannot read {image['path']}: {err}") from err
        return {
            "jpeg": encoded_image(data, where),
            "label": checked_label(record["label"], len(self.classes), where),
            "name": where,
        }

    def __repr__(self) -> str:
        return (
            f"HuggingFaceSource({self.dataset!r}, {self.split!r}, {len(self)} images, "
            f"{len(self.classes)} classes)"
        )


@contextlib.contextmanager
def _progress_bars(datasets: Any, show: bool) -> Iterator[None]:
    """``datasets``' progress bars on (``show``) or off inside the block, as they were after."""
    were_disabled = datasets.are_progress_bars_disabled()
    if show:
        datasets.enable_progress_bars()
    else:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if were_disabled:
            datasets.disable_progress_bars()
        else:
            datasets.enable_progress_bars()


def _open_split(datasets: Any, dataset: str, split: str, cache_dir: str | None) -> tuple[str, Any]:
    """``(the dataset's split name, its Dataset)``, or one line on what is wrong."""
    where = f"hf dataset {dataset}"
    if (Path(dataset) / "dataset_dict.json").is_file():  # written by DatasetDict.save_to_disk
        return _open_saved_split(datasets, Path(dataset), split, where)
    try:
        builder = datasets.load_dataset_builder(dataset, cache_dir=cache_dir)
    except Exception as err:  # not on the Hub, not cached offline, or not a dataset folder
        raise DatasetError(f"{where} cannot be opened: {first_line(err)}") from err
    available = list(builder.config.data_files or builder.info.splits or ())
    name = dataset_split(available, split, where)
    try:
        builder.download_and_prepare()
        return name, builder.as_dataset(split=name)
    except Exception as err:  # unreadable parquet, a full disk, a failed download
        raise DatasetError(f"{where}: split {name!r} cannot be read: {first_line(err)}") from err


def _open_saved_split(datasets: Any, root: Path, split: str, where: str) -> tuple[str, Any]:
    """``(the split's name, its Dataset)`` of a ``DatasetDict.save_to_disk`` folder; only that
    split is read, so an empty or damaged other split does not stop it."""
    saved = f"{where} (a save_to_disk folder)"
    try:
        available = list(json.loads((root / "dataset_dict.json").read_text())["splits"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DatasetError(f"{saved} cannot be read: dataset_dict.json: {first_line(err)}") from err
    name = dataset_split(available, split, where)
    if _saved_without_records(root / name):
        raise _empty_split(where, name, split)
    try:
        return name, datasets.load_from_disk(str(root / name))
    except Exception as err:  # a split folder with a missing or damaged .arrow file, ...
        raise DatasetError(f"{saved} cannot be read: {first_line(err)}") from err


def _saved_without_records(folder: Path) -> bool:
    """Whether a saved split lists no data files, as ``save_to_disk`` writes a split of no
    records (reading one fails deep inside ``datasets``)."""
    try:
        return json.loads((folder / "state.json").read_text())["_data_files"] == []
    except (OSError, ValueError, KeyError, TypeError):
        return False  # reading it says what is wrong


def _empty_split(where: str, name: str, split: str) -> DatasetError:
    """One line: the dataset's split ``name`` (asked for as ``split``) holds no records, and
    how to read others."""
    if split == "train":
        fix = "train on another split with data.train_split"
    else:
        fix = (
            "evaluate on another split with data.eval_split, or hold out part of train: "
            "--set data.train_split='train[:90%]' --set data.eval_split='train[90%:]'"
        )
    return DatasetError(f"{where}: split {name!r} is empty (0 records); {fix}")

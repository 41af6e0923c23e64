"""A prepared TensorFlow Datasets dataset, such as ``imagenet2012``, as a random-access source.

Any record is read by index without TensorFlow, so shuffling, exact resume and batch-size
ramps work as they do with the folder and ArrayRecord sources: a dataset prepared in
ArrayRecord format through TFDS's own data source, one prepared in TFRecord format (``tfds
build``'s default, and the flax ImageNet example's) through :mod:`jaxdist.data.tfrecord`,
which indexes the files once. Images are read with decoding skipped, as the encoded bytes the
dataset stores (JPEG, PNG, ...), so jaxdist's reduced-scale JPEG decode and crops apply to
them as to a folder of images.

A prepared dataset, e.g. by ``tfds build imagenet2012 --manual_dir ~/imagenet-tars
--data_dir /data/tfds``, is ``DataConfig(source="tfds", dataset="imagenet2012",
root="/data/tfds")``. The recipe's ``val`` split is the dataset's ``validation`` (or ``val``);
any split string names others (``test``, ``train[:99%]``). The image and label features are
``image_key`` and ``label_key``, or the first common names the dataset has
(:func:`~jaxdist.data.sources.image_and_label`); class names are the label's names. Needs the
``tfds`` extra: ``pip install 'jaxdist[tfds]'``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from jaxdist.data.sources import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    DatasetError,
    checked_label,
    dataset_split,
    encoded_image,
    first_line,
    found_under,
    image_and_label,
    import_extra,
)
from jaxdist.data.tfrecord import TfRecords
from jaxdist.data.transforms import stored_size

__all__ = ["TfdsSource"]

PREPARE = "tfds build {name} --data_dir {data_dir} [--manual_dir DIR]"


class TfdsSource:
    """Split ``split`` (``train`` or ``val``) of the prepared TFDS dataset ``name`` under
    ``data_dir`` (``None``: TFDS's default, ``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``)."""

    encoded = True
    mean = IMAGENET_MEAN
    std = IMAGENET_STD

    def __init__(
        self,
        name: str,
        split: str,
        data_dir: str | None = None,
        image_key: str = "",
        label_key: str = "",
    ) -> None:
        tfds = import_extra("tensorflow_datasets", "tfds", "the tfds data source")
        self.name = name
        builder = _prepared_builder(tfds, name, data_dir)
        self.data_dir = str(builder.data_dir)
        features = builder.info.features
        image, label = image_and_label(
            list(features), f"tfds dataset {name}", "feature", image_key, label_key
        )
        self._image_key, self._label_key = image, label
        names = getattr(features[label], "names", None)
        if not names:
            raise DatasetError(
                f"tfds dataset {name}: {label!r} is {type(features[label]).__name__}, "
                f"not a ClassLabel with class names"
            )
        self.classes = tuple(names)
        self.split = dataset_split(list(builder.info.splits), split, f"tfds dataset {name}")
        decoders = {image: tfds.decode.SkipDecoding()}
        if _file_format(builder) == "tfrecord":
            self._records = _TfRecordExamples(builder, self.split, decoders)
        else:
            self._records = builder.as_data_source(split=self.split, decoders=decoders)
        if len(self._records) == 0:
            raise DatasetError(f"tfds dataset {name}: split {self.split!r} has no records")
        first = self[0]  # the first record's image and label are checked before any training
        stored_size(first["jpeg"], first["name"])  # decodes, whatever the format

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index: int) -> dict[str, Any]:
        where = f"tfds:{self.name}/{self.split}[{index}]"
        record = self._records[index]
        return {
            "jpeg": encoded_image(record[self._image_key], where),
            "label": checked_label(record[self._label_key], len(self.classes), where),
            "name": where,
        }

    def verify_record(self, index: int) -> bool:
        """Whether record ``index``'s stored bytes match their checksum (TFRecord files carry
        one per record; ArrayRecord's reader checks its own as it reads)."""
        check = getattr(self._records, "verify", None)
        return True if check is None else check(index)

    def __repr__(self) -> str:
        return (
            f"TfdsSource({self.name!r}, {self.split!r}, {len(self)} images, "
            f"{len(self.classes)} classes)"
        )


def _prepared_builder(tfds: Any, name: str, data_dir: str | None) -> Any:
    """TFDS's builder of ``name`` read from its prepared files, or one line on what is wrong."""
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except tfds.core.registered.DatasetNotFoundError as err:
        raise DatasetError(
            f"tfds dataset {name!r} does not exist: it is neither a TFDS catalog name nor "
            f"prepared under {data_dir or 'the TFDS data dir'}"
            f"{_found(name, data_dir) or found_under(_data_root(data_dir))}"
        ) from err
    except Exception as err:  # a malformed name or unreadable metadata
        raise DatasetError(f"tfds dataset {name!r} cannot be opened: {first_line(err)}") from err
    if not builder.info.splits:
        found = _found(name, data_dir)
        prepare = PREPARE.format(name=name, data_dir=data_dir or "~/tensorflow_datasets")
        raise DatasetError(
            f"tfds dataset {name!r} is not prepared in {builder.data_dir}"
            + (found or f"; prepare it with `{prepare}`")
        )
    file_format = _file_format(builder)
    if file_format not in ("array_record", "tfrecord"):
        raise DatasetError(
            f"tfds dataset {name!r} in {builder.data_dir} is stored as {file_format}; jaxdist "
            f"reads array_record and tfrecord: prepare it again with "
            f"`{PREPARE.format(name=name, data_dir=data_dir or '~/tensorflow_datasets')}`"
        )
    return builder


def _data_root(data_dir: str | None) -> Path:
    return Path(data_dir or os.environ.get("TFDS_DATA_DIR", "~/tensorflow_datasets")).expanduser()


def _found(name: str, data_dir: str | None) -> str:
    """What is prepared near where ``name`` was looked for: its other versions, or the
    data dir one level off; ``""`` if nothing of it."""
    root = _data_root(data_dir)
    base = name.split(":")[0].split("/")[0]
    if not root.is_dir():
        return ""
    versions = _versions(root / base)
    if versions:
        return (
            f"; {root / base} holds version(s) {', '.join(versions)}: name one, e.g. "
            f"dataset='{base}:{versions[-1]}'"
        )
    if root.name == base or _versions(root):
        return f"; {root} is a dataset's own folder: give its parent {root.parent} as the root"
    for sub in sorted(p for p in root.iterdir() if p.is_dir()):
        if _versions(sub / base):
            return f"; {sub / base} is there: give {sub} as the root"
    return ""


def _versions(folder: Path) -> list[str]:
    """The prepared versions (``X.Y.Z`` folders with dataset info) in ``folder``, at any
    config depth."""
    if not folder.is_dir():
        return []
    infos = folder.glob("**/dataset_info.json")
    names = {p.parent.name for p in infos if re.fullmatch(r"\d+\.\d+\.\d+", p.parent.name)}
    return sorted(names, key=lambda v: tuple(map(int, v.split("."))))


def _file_format(builder: Any) -> str:
    return str(getattr(builder.info.file_format, "value", builder.info.file_format))


class _TfRecordExamples:
    """A split of a TFRecord-prepared dataset by index: the records' serialized examples
    (:class:`~jaxdist.data.tfrecord.TfRecords`) parsed as TFDS parses them, without
    TensorFlow."""

    def __init__(self, builder: Any, split: str, decoders: dict) -> None:
        info = builder.info.splits[split]
        where = f"tfds dataset {builder.name}/{split}"
        self._where = f"tfds:{builder.name}/{split}"

        def progress(done: int, total: int, seconds: float) -> None:
            if done == 1:
                print(f"{where}: indexing {total} TFRecord file(s) once ...", flush=True)
            if done == total:
                print(f"{where}: indexed in {seconds:.1f} s", flush=True)

        self._records = TfRecords(info.filepaths, expected=info.shard_lengths, progress=progress)
        self._features = builder.info.features
        self._decoders = decoders

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index: int) -> dict[str, Any]:
        try:
            return self._features.deserialize_example_np(
                self._records[index], decoders=self._decoders
            )
        except Exception as err:  # protobuf's DecodeError and what a damaged record makes
            raise DatasetError(
                f"{self._where}[{index}]: the record cannot be parsed ({first_line(err)}); "
                "`jaxdist data inspect --verify` checks every record's checksum"
            ) from err

    def verify(self, index: int) -> bool:
        """Whether record ``index``'s bytes match their TFRecord checksum."""
        return self._records.verify(index)

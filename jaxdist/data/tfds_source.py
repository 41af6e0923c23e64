"""A prepared TensorFlow Datasets dataset, such as ``imagenet2012``, as a random-access source.

TFDS's ArrayRecord data source reads any record by index without TensorFlow, so shuffling,
exact resume and batch-size ramps work as they do with the folder and ArrayRecord sources.
Images are read with decoding skipped, as the JPEG bytes the dataset stores, so jaxdist's
reduced-scale decode and crops apply to them as to a folder of JPEGs.

The dataset must be prepared in ArrayRecord format::

    tfds build imagenet2012 --manual_dir ~/imagenet-tars --file_format=array_record \\
        --data_dir /data/tfds

and is then ``DataConfig(source="tfds", dataset="imagenet2012", root="/data/tfds")``. The
recipe's ``val`` split is the dataset's ``validation`` (or ``val``); the image and label
features are ``image_key`` and ``label_key``, or the first common names the dataset has
(:func:`~jaxdist.data.sources.image_and_label`); class names are the label's names. Needs
the ``tfds``
extra: ``pip install 'jaxdist[tfds]'``.
"""

from __future__ import annotations

from typing import Any

from jaxdist.data.sources import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    DatasetError,
    checked_label,
    dataset_split,
    first_line,
    image_and_label,
    import_extra,
    require_jpeg,
)

__all__ = ["TfdsSource"]

PREPARE = "tfds build {name} --file_format=array_record --data_dir {data_dir} [--manual_dir DIR]"


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
        image, label = image_and_label(list(features), f"tfds dataset {name}", "feature",
                                       image_key, label_key)  # fmt: skip
        self._image_key, self._label_key = image, label
        names = getattr(features[label], "names", None)
        if not names:
            raise DatasetError(
                f"tfds dataset {name}: {label!r} is {type(features[label]).__name__}, "
                f"not a ClassLabel with class names"
            )
        self.classes = tuple(names)
        self.split = dataset_split(list(builder.info.splits), split, f"tfds dataset {name}")
        skip = tfds.decode.SkipDecoding()
        self._records = builder.as_data_source(split=self.split, decoders={image: skip})
        if len(self._records) == 0:
            raise DatasetError(f"tfds dataset {name}: split {self.split!r} has no records")
        self[0]  # the first record's image and label are checked before any training

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index: int) -> dict[str, Any]:
        where = f"tfds:{self.name}/{self.split}[{index}]"
        record = self._records[index]
        return {
            "jpeg": require_jpeg(record[self._image_key], where),
            "label": checked_label(record[self._label_key], len(self.classes), where),
            "name": where,
        }

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
        ) from err
    except Exception as err:  # a malformed name or unreadable metadata
        raise DatasetError(f"tfds dataset {name!r} cannot be opened: {first_line(err)}") from err
    if not builder.info.splits:
        raise DatasetError(
            f"tfds dataset {name!r} is not prepared in {builder.data_dir}; prepare it with "
            f"`{PREPARE.format(name=name, data_dir=data_dir or '~/tensorflow_datasets')}`"
        )
    file_format = str(getattr(builder.info.file_format, "value", builder.info.file_format))
    if file_format != "array_record":
        raise DatasetError(
            f"tfds dataset {name!r} in {builder.data_dir} is stored as {file_format}, which is "
            f"not random access; prepare it again with "
            f"`{PREPARE.format(name=name, data_dir=data_dir or '~/tensorflow_datasets')}`"
        )
    return builder

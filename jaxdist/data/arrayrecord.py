"""ArrayRecord shards: the folder dataset packed into a few large random-access files.

Layout written by :func:`convert_folder` (``jaxdist data convert``)::

    OUT/metadata.json                       classes, record counts, shard file names
    OUT/train-00000-of-00016.array_record   records in the folder's order (class, file name)
    OUT/val-00000-of-00001.array_record

Each record is a msgpack map ``{"jpeg": bytes, "label": int, "name": str}`` (``name`` is the
original path relative to the folder root, so decode errors still name the file). Record
``i`` of the shards taken in order is record ``i`` of :class:`ImageFolderSource`, so both
sources give the same samples for the same seed. Shards are written with ``group_size:1``,
which grain's ArrayRecord reader needs for fast random access.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grain.python as grain
import msgpack
import simplejpeg
from array_record.python.array_record_module import ArrayRecordWriter

from jaxdist.data.sources import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    SPLITS,
    DatasetError,
    list_image_folder,
)
from jaxdist.data.transforms import decode

__all__ = [
    "ArrayRecordSource",
    "convert_folder",
]

FORMAT = "jaxdist-arrayrecord-v1"
METADATA = "metadata.json"


def encode_record(jpeg: bytes, label: int, name: str) -> bytes:
    """Serialise one sample."""
    return msgpack.packb({"jpeg": jpeg, "label": int(label), "name": name}, use_bin_type=True)


def decode_record(raw: bytes) -> dict[str, Any]:
    """Inverse of :func:`encode_record`."""
    return msgpack.unpackb(raw, raw=False)


def shard_names(split: str, shards: int) -> list[str]:
    return [f"{split}-{i:05d}-of-{shards:05d}.array_record" for i in range(shards)]


def _check_jpeg(data: bytes, path: Path, verify: bool) -> bytes:
    """Return JPEG bytes simplejpeg can read: valid JPEGs unchanged; CMYK or non-JPEG images
    (ImageNet train has a few) re-encoded as RGB JPEG; anything else is an error naming it.
    Only the header is checked unless ``verify`` (a full decode, ~1 ms per photo)."""
    try:
        if simplejpeg.decode_jpeg_header(data)[2] != "CMYK":
            if verify:
                simplejpeg.decode_jpeg(data, colorspace="RGB")
            return data
    except ValueError:
        pass
    return simplejpeg.encode_jpeg(decode(data, str(path)), quality=95)


ProgressFn = Callable[[str, int, int, float], None]


def convert_folder(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    shards: int,
    val_shards: int | None = None,
    splits: Sequence[str] = SPLITS,
    progress: ProgressFn | None = None,
    verify: bool = False,
) -> dict[str, Any]:
    """Pack ``SRC/<split>/<class>/*.JPEG`` into ArrayRecord shards under ``DST``.

    Args:
      src: folder dataset root.
      dst: output folder (created; must not already hold a converted dataset).
      shards: number of train shards.
      val_shards: number of shards for the other splits; default in proportion to their size.
      splits: splits to convert; a missing ``val`` folder is skipped, a missing ``train`` is an
        error.
      progress: called as ``progress(split, done, total, seconds)`` now and then.
      verify: fully decode every image, so a corrupt file fails here and not in training.

    Returns:
      The metadata written to ``DST/metadata.json``.
    """
    src, dst = Path(src), Path(dst)
    if shards < 1:
        raise ValueError(f"--shards must be >= 1, got {shards}")
    if (dst / METADATA).exists():
        raise DatasetError(
            f"{dst} already holds a converted dataset ({dst / METADATA}); remove it first"
        )
    classes, train_files, _ = list_image_folder(src, "train")
    listings = {}
    for split in splits:
        if split != "train" and not (src / split).is_dir():
            continue
        listings[split] = list_image_folder(src, split, classes)[1:]
    dst.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = {
        "format": FORMAT,
        "source": str(src),
        "classes": list(classes),
        "splits": {},
    }
    for split, (files, labels) in listings.items():
        if split == "train":
            count = shards
        elif val_shards is not None:
            count = val_shards
        else:
            count = max(1, round(shards * len(files) / len(train_files)))
        count = max(1, min(count, len(files)))
        names = shard_names(split, count)
        _write_shards(src, dst, split, names, files, labels, progress, verify)
        meta["splits"][split] = {"num_records": len(files), "shards": names}
    (dst / METADATA).write_text(json.dumps(meta, indent=1))
    return meta


def _write_shards(
    src: Path,
    dst: Path,
    split: str,
    names: list[str],
    files: Sequence[str],
    labels: Sequence[int],
    progress: ProgressFn | None,
    verify: bool,
) -> None:
    """``files`` of one split, in order, into the shards ``names`` (equal parts)."""
    per_shard = math.ceil(len(files) / len(names))
    start = time.perf_counter()
    for shard, name in enumerate(names):
        # Write under a temporary name: a crash never leaves a valid-looking shard.
        tmp = dst / f".{name}.tmp"
        writer = ArrayRecordWriter(str(tmp), "group_size:1")
        try:
            for i in range(shard * per_shard, min(len(files), (shard + 1) * per_shard)):
                path = src / files[i]
                data = _check_jpeg(path.read_bytes(), path, verify)
                writer.write(encode_record(data, labels[i], files[i]))
                if progress and (i + 1) % 500 == 0:
                    progress(split, i + 1, len(files), time.perf_counter() - start)
        finally:
            writer.close()
        tmp.rename(dst / name)
    if progress:
        progress(split, len(files), len(files), time.perf_counter() - start)


def read_metadata(root: str | os.PathLike) -> dict[str, Any]:
    """Parse ``ROOT/metadata.json``, with errors that say what to run."""
    root = Path(root)
    path = root / METADATA
    hint = f"expected {root}/{METADATA} and {root}/<split>-NNNNN-of-NNNNN.array_record, written by `jaxdist data convert --src FOLDER --dst {root}`"
    if not root.is_dir():
        raise DatasetError(f"ArrayRecord dataset {root} does not exist; {hint}")
    if not path.is_file():
        raise DatasetError(f"no {METADATA} in {root}; {hint}")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise DatasetError(f"{path} is not valid JSON ({err}); {hint}") from err
    if meta.get("format") != FORMAT:
        raise DatasetError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}; {hint}")
    return meta


class ArrayRecordSource:
    """Records of one split of a converted dataset (see :func:`convert_folder`)."""

    encoded = True
    mean = IMAGENET_MEAN
    std = IMAGENET_STD

    stored_by_class = True  # as the folder it was converted from (jaxdist.data.splits)

    def __init__(self, root: str | os.PathLike, split: str) -> None:
        self.root = Path(root)
        self.split = split
        meta = read_metadata(root)
        if split not in meta["splits"]:
            raise DatasetError(f"{self.root}: no split {split!r} (has {sorted(meta['splits'])})")
        info = meta["splits"][split]
        paths = [self.root / name for name in info["shards"]]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise DatasetError(
                f"{self.root}: missing shard file(s) {missing[:3]} listed in {METADATA}"
            )
        self.classes = tuple(meta["classes"])
        self._records = grain.ArrayRecordDataSource([str(p) for p in paths])
        if len(self._records) != info["num_records"]:
            raise DatasetError(
                f"{self.root}: shards of split {split!r} hold {len(self._records)} records, "
                f"{METADATA} says {info['num_records']}"
            )

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index: int) -> dict[str, Any]:
        record = decode_record(self._records[index])
        record["name"] = f"{self.root}:{record['name']}"
        return record

    def __repr__(self) -> str:
        return f"ArrayRecordSource({str(self.root)!r}, {self.split!r}, {len(self)} records)"

"""TFRecord files read by record index, without TensorFlow.

A TFRecord file is a sequence of records, each ``uint64 length``, ``uint32`` masked CRC-32C of
the length, the bytes, ``uint32`` masked CRC-32C of the bytes. There is no index in the file,
so the first reader scans the files once (12 bytes read per record, the length's CRC checked)
and keeps the record offsets in an index file next to the data (or, where the data folder is
read-only, under ``~/.cache/jaxdist/tfrecord-index``); later readers load it. An index whose
files have changed size or time since is rebuilt. Then any record is one ``pread``: shuffling,
exact resume and batch-size ramps work as with ArrayRecord.

This is how the ``tfds`` source reads datasets that ``tfds build`` prepared in its default
TFRecord format (the format of the flax ImageNet example's preparation).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import struct
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from jaxdist.data.sources import DatasetError, import_extra

__all__ = ["TfRecords", "masked_crc", "scan", "write_tfrecord"]

HEADER = 12  # uint64 length + uint32 masked CRC of the length
FOOTER = 4  # uint32 masked CRC of the data
CACHE = Path("~/.cache/jaxdist/tfrecord-index").expanduser()


def masked_crc(data: bytes) -> int:
    """TFRecord's checksum: CRC-32C, rotated right by 15 bits, plus a constant."""
    crc32c = import_extra("google_crc32c", "tfds", "checking TFRecord files")
    crc = crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def scan(path: str | os.PathLike) -> np.ndarray:
    """The byte offset of every record in the TFRecord file ``path``; a damaged or truncated
    file is one line naming the byte where it breaks."""
    offsets = []
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        position = 0
        while position < size:
            f.seek(position)
            header = f.read(HEADER)
            if len(header) < HEADER:
                raise DatasetError(f"{path}: truncated at byte {position} (a record header)")
            (length,) = struct.unpack("<Q", header[:8])
            if struct.unpack("<I", header[8:])[0] != masked_crc(header[:8]):
                raise DatasetError(
                    f"{path}: not a TFRecord file, or damaged at byte {position} (the record "
                    f"length's checksum does not match)"
                )
            offsets.append(position)
            position += HEADER + length + FOOTER
        if position != size:
            raise DatasetError(f"{path}: truncated in the record at byte {offsets[-1]}")
    return np.asarray(offsets, np.int64)


def write_tfrecord(path: str | os.PathLike, records: Sequence[bytes]) -> None:
    """Write ``records`` as a TFRecord file (what TensorFlow's ``TFRecordWriter`` writes)."""
    with open(path, "wb") as f:
        for data in records:
            length = struct.pack("<Q", len(data))
            f.write(length + struct.pack("<I", masked_crc(length)))
            f.write(data + struct.pack("<I", masked_crc(data)))


def _stamp(path: str) -> list:
    stat = os.stat(path)
    return [stat.st_size, stat.st_mtime_ns]


class TfRecords:
    """The records of TFRecord ``paths`` (in order) by global index, as bytes.

    ``progress(done_files, total_files, seconds)`` is called while an index is built.
    ``expected`` (records per file, e.g. TFDS's shard lengths) is checked against the files.
    """

    def __init__(
        self,
        paths: Sequence[str | os.PathLike],
        *,
        expected: Sequence[int] | None = None,
        progress: Callable[[int, int, float], None] | None = None,
    ) -> None:
        self.paths = [str(p) for p in paths]
        if not self.paths:
            raise DatasetError("no TFRecord files to read")
        offsets = self._load_or_build_index(progress)
        if expected is not None and [len(o) for o in offsets] != list(expected):
            found = [len(o) for o in offsets]
            raise DatasetError(
                f"{Path(self.paths[0]).parent}: the TFRecord files hold {sum(found)} records, "
                f"the dataset's metadata says {sum(expected)}; the files were changed after "
                "they were prepared: prepare the dataset again"
            )
        self._offsets = offsets
        self._starts = np.cumsum([0] + [len(o) for o in offsets]).tolist()
        self._fds: dict[int, int] = {}

    def _index_path(self) -> Path:
        folder = Path(self.paths[0]).parent
        name = "jaxdist-index-" + hashlib.sha1("\n".join(self.paths).encode()).hexdigest()[:16]
        local = folder / f".{name}.npz"
        if local.exists() or os.access(folder, os.W_OK):
            return local
        return CACHE / hashlib.sha1(str(folder.resolve()).encode()).hexdigest()[:16] / f"{name}.npz"

    def _load_or_build_index(self, progress: Callable | None) -> list[np.ndarray]:
        path = self._index_path()
        stamps = [_stamp(p) for p in self.paths]
        if path.exists():
            try:
                with np.load(path) as saved:
                    if json.loads(str(saved["stamps"])) == stamps:
                        return [saved[f"offsets_{i}"] for i in range(len(self.paths))]
            except (OSError, ValueError, KeyError):
                pass  # an unreadable or stale index is rebuilt
        start = time.perf_counter()
        offsets = []
        for i, file in enumerate(self.paths):
            offsets.append(scan(file))
            if progress is not None:
                progress(i + 1, len(self.paths), time.perf_counter() - start)
        arrays = {f"offsets_{i}": o for i, o in enumerate(offsets)}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp.npz")
            np.savez(tmp, stamps=json.dumps(stamps), **arrays)
            tmp.replace(path)
        except OSError:
            pass  # no place to keep it: the next reader scans again
        return offsets

    def __len__(self) -> int:
        return self._starts[-1]

    def _locate(self, index: int) -> tuple[int, int]:
        if not 0 <= index < len(self):
            raise IndexError(f"record {index} of {len(self)}")
        file = bisect.bisect_right(self._starts, index) - 1
        return file, int(self._offsets[file][index - self._starts[file]])

    def _fd(self, file: int) -> int:
        if file not in self._fds:
            self._fds[file] = os.open(self.paths[file], os.O_RDONLY)
        return self._fds[file]

    def __getitem__(self, index: int) -> bytes:
        file, offset = self._locate(index)
        fd = self._fd(file)
        (length,) = struct.unpack("<Q", os.pread(fd, 8, offset))
        return os.pread(fd, length, offset + HEADER)

    def verify(self, index: int) -> bool:
        """Whether record ``index``'s bytes match their checksum."""
        file, offset = self._locate(index)
        data = self[index]
        footer = os.pread(self._fd(file), FOOTER, offset + HEADER + len(data))
        return struct.unpack("<I", footer)[0] == masked_crc(data)

    def __getstate__(self) -> dict:  # open files stay with their process
        return {**self.__dict__, "_fds": {}}

    def __del__(self) -> None:
        for fd in getattr(self, "_fds", {}).values():
            os.close(fd)

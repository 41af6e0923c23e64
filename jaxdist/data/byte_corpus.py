"""A byte-level text corpus that is on every machine: the Python standard library's own
``.py`` sources (or any folder of text files), cut into fixed-length windows of bytes.

Files are read in sorted order of their path under the root; a file is held out when the
CRC-32 of its relative path is divisible by ``held_out_every``, so the split is fixed by the
file names alone and the same on every machine with the same files. Each split is the
concatenation of its files (each followed by a newline), cut into non-overlapping windows of
``seq_len + 1`` bytes: a model reads the first ``seq_len`` and predicts the last ``seq_len``.

:func:`unigram_bits_per_byte` is the baseline a language model must beat: the held-out
cross-entropy of the training split's byte frequencies.
"""

from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path

import numpy as np

from jaxdist.data.records import ArrayRecords
from jaxdist.data.sources import DatasetError

__all__ = ["ByteCorpus", "stdlib_root", "unigram_bits_per_byte"]


def stdlib_root() -> Path:
    """The running Python's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def _files(root: Path, pattern: str) -> list[Path]:
    """Files matching ``pattern`` under ``root`` in sorted order of their relative path,
    installed packages left out."""
    if not root.is_dir():
        raise DatasetError(f"corpus root {root} is not a folder")
    files = sorted(
        p
        for p in root.rglob(pattern)
        if p.is_file() and "site-packages" not in p.relative_to(root).parts
    )
    if not files:
        raise DatasetError(f"no files matching {pattern!r} under {root}")
    return files


class ByteCorpus:
    """Train and held-out windows of a folder of text files (default: the standard library).

    Args:
      root: the folder (``None``: :func:`stdlib_root`).
      pattern: the files to read, as a glob under ``root``.
      seq_len: bytes a model reads per window (windows hold ``seq_len + 1``).
      held_out_every: one file in this many (by path checksum) is held out.
      max_train_bytes, max_eval_bytes: read at most this much of each split, from its first
        files (0: all).
    """

    def __init__(
        self,
        root: str | Path | None = None,
        *,
        pattern: str = "*.py",
        seq_len: int = 128,
        held_out_every: int = 20,
        max_train_bytes: int = 0,
        max_eval_bytes: int = 0,
    ) -> None:
        if seq_len < 1 or held_out_every < 2:
            raise ValueError(
                f"seq_len must be >= 1 and held_out_every >= 2, got {seq_len} and {held_out_every}"
            )
        self.root = Path(root) if root else stdlib_root()
        self.seq_len = seq_len
        train, held_out = [], []
        for path in _files(self.root, pattern):
            relative = path.relative_to(self.root).as_posix()
            is_held_out = zlib.crc32(relative.encode()) % held_out_every == 0
            (held_out if is_held_out else train).append(path)
        if not held_out or not train:
            raise DatasetError(
                f"{self.root}: {len(train)} train and {len(held_out)} held-out files; each split "
                f"needs one (held_out_every={held_out_every})"
            )
        self.train_bytes = self._read(train, max_train_bytes, "train")
        self.eval_bytes = self._read(held_out, max_eval_bytes, "held-out")

    def _read(self, files: list[Path], limit: int, split: str) -> np.ndarray:
        chunks, total = [], 0
        for path in files:
            chunks.append(path.read_bytes() + b"\n")
            total += len(chunks[-1])
            if limit and total >= limit:
                break
        data = np.frombuffer(b"".join(chunks), np.uint8)
        data = data[:limit] if limit else data
        if len(data) < self.seq_len + 1:
            raise DatasetError(
                f"{self.root}: the {split} files hold {len(data)} bytes, fewer "
                f"than one window of {self.seq_len + 1}"
            )
        return data

    def windows(self, data: np.ndarray) -> np.ndarray:
        """``data`` cut into ``[n, seq_len + 1]`` non-overlapping windows (the tail dropped)."""
        width = self.seq_len + 1
        count = len(data) // width
        return data[: count * width].reshape(count, width)

    def records(self, split: str) -> ArrayRecords:
        """The ``train`` or ``eval`` windows as records ``{"tokens": [seq_len + 1] uint8}``."""
        data = self.train_bytes if split == "train" else self.eval_bytes
        return ArrayRecords({"tokens": self.windows(data)}, name=f"{self.root} {split}")


def unigram_bits_per_byte(train: np.ndarray, held_out_targets: np.ndarray) -> float:
    """Bits per byte of ``held_out_targets`` under the byte frequencies of ``train``
    (add-one smoothed): what a model that ignores context achieves."""
    counts = np.bincount(train, minlength=256).astype(np.float64) + 1.0
    log2p = np.log2(counts / counts.sum())
    return float(-log2p[held_out_targets].mean())

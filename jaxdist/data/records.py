"""Data for any task: records that are dicts of arrays, through the same global sample stream
as images (:mod:`jaxdist.data.pipeline`): shuffled per epoch from the seed, cut into
per-process batches, resumable at any sample, padded with masked records for evaluation.

::

    data = RecordData(ArrayRecords({"x": x_train, "y": y_train}),
                      ArrayRecords({"x": x_val, "y": y_val}), seed=0)
    it = data.train_iterator(global_batch_size=64)     # {"x": [64/P, ...], "y": [64/P]}
    with data.eval_iterator(64) as batches:            # plus "mask", False on the padding
        ...
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import grain.python as grain
import numpy as np

from jaxdist.data.pipeline import (
    BatchIterator,
    Plan,
    check_batch,
    padded_to_batches,
    process_of,
    seeds_of,
)
from jaxdist.data.sources import DatasetError

__all__ = ["ArrayRecords", "RecordData"]


class ArrayRecords:
    """Records from equal-length arrays: record ``i`` is ``{name: array[i]}``."""

    def __init__(self, arrays: Mapping[str, Any], name: str = "arrays") -> None:
        self.arrays = {k: np.asarray(v) for k, v in arrays.items()}
        lengths = {k: len(v) for k, v in self.arrays.items()}
        if not lengths or len(set(lengths.values())) != 1:
            raise DatasetError(f"{name}: expected arrays of one length, got lengths {lengths}")
        self._length = next(iter(lengths.values()))
        self.name = name

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {k: v[index] for k, v in self.arrays.items()}

    def __repr__(self) -> str:
        return f"ArrayRecords({self.name}, {self._length} records)"


class _WithMask(grain.MapTransform):
    """A real record: marked ``mask=True``."""

    def map(self, record: dict[str, Any]) -> dict[str, Any]:
        return {**record, "mask": np.bool_(True)}


class _Blank(grain.MapTransform):
    """Padding: zeros shaped like a real record, ``mask=False``."""

    def __init__(self, example: Mapping[str, Any]) -> None:
        self.example = {k: np.zeros_like(v) for k, v in example.items()}

    def map(self, _: Any) -> dict[str, Any]:
        return {**self.example, "mask": np.bool_(False)}


class RecordData:
    """A task's :class:`~jaxdist.tasks.Data` from two random-access record sources (anything
    with ``len`` and ``source[i] -> dict of numpy arrays``).

    Args:
      train, eval: the training and held-out records.
      seed: the shuffle of every epoch.
      process_index, process_count: this process's share (default: the run's
        :func:`~jaxdist.data.pipeline.reading_share`, else JAX's process index and count).
      read_threads, prefetch_batches: as for :func:`~jaxdist.data.build_train_iterator`.
    """

    def __init__(
        self,
        train: Sequence[dict[str, Any]],
        eval: Sequence[dict[str, Any]],
        *,
        seed: int = 0,
        process_index: int | None = None,
        process_count: int | None = None,
        read_threads: int = 2,
        prefetch_batches: int = 2,
    ) -> None:
        for split, source in (("train", train), ("eval", eval)):
            if len(source) == 0:
                raise DatasetError(f"the {split} records {source!r} are empty")
        self.train, self.eval = train, eval
        self.seed = seed
        self._process = (process_index, process_count)
        self._options = dict(
            worker_count=0, read_threads=read_threads, prefetch_batches=prefetch_batches
        )

    @property
    def num_train_examples(self) -> int:
        return len(self.train)

    @property
    def num_eval_examples(self) -> int:
        return len(self.eval)

    def _plan(
        self,
        stream: grain.MapDataset,
        global_batch_size: int,
        length: int | None,
        num_records: int,
        seed: int,
    ) -> Plan:
        index, count = process_of(*self._process)
        check_batch(self.train, global_batch_size, count)
        return Plan(
            stream=stream,
            stream_length=length,
            num_records=num_records,
            seed=seed,
            global_batch_size=global_batch_size,
            process_index=index,
            process_count=count,
            drop_remainder=True,
            **self._options,
        )

    def train_iterator(self, global_batch_size: int, start_sample: int = 0) -> BatchIterator:
        """Training batches for this process, from global sample ``start_sample`` on,
        reshuffled every epoch, forever."""
        shuffle_seed, _ = seeds_of(self.seed)
        stream = grain.MapDataset.source(self.train).shuffle(seed=shuffle_seed).repeat(None)
        plan = self._plan(stream, global_batch_size, None, len(self.train), self.seed)
        return BatchIterator(plan, start_sample)

    def eval_iterator(self, global_batch_size: int) -> BatchIterator:
        """One pass over the held-out records in stored order, padded with ``mask=False``
        records to a multiple of ``global_batch_size``; a context manager."""
        stream = grain.MapDataset.source(self.eval).map(_WithMask())
        stream = padded_to_batches(stream, global_batch_size, _Blank(self.eval[0]))
        plan = self._plan(stream, global_batch_size, len(stream), len(self.eval), 0)
        return BatchIterator(plan, 0)

"""The input pipeline: one global sample stream, cut into per-process batches with grain.

Design. For a given source and seed there is one *global sample stream*: epoch ``e`` is the
source shuffled with a permutation drawn from ``(seed, e)``, epochs follow each other, and the
sample at stream position ``i`` gets its augmentation from an RNG keyed by ``(seed, i)``.
Global batch ``k`` of size ``B`` is stream positions ``[start + kB, start + (k+1)B)``; process
``p`` of ``P`` takes positions ``start + p, start + p + P, ...`` of it (``B/P`` of them), so it
reads and decodes only its own share. Consequences:

* the same seed gives the same batches, on any number of processes and any number of grain
  worker processes;
* the position in the stream is one integer, ``next_sample`` (global samples consumed);
* changing the batch size (batch-size ramping) is rebuilding the iterator with
  ``start_sample = next_sample``: the stream goes on exactly where it was, the remainder of the
  epoch is not dropped or repeated.

All of this is grain ``MapDataset`` index arithmetic (``shuffle``, ``repeat``, ``random_map``,
slicing, ``batch``); the iterator is grain's, and its state is saved alongside
``next_sample`` by :meth:`BatchIterator.get_state`.

Evaluation reads the split once in stored order and pads it with masked zero images to a
multiple of the global batch, so every process runs the same number of same-shaped steps and
the metric can be exact: weight each sample by ``batch["mask"]``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import grain.python as grain
import numpy as np

from jaxdist.data.sources import DatasetError, ImageSource
from jaxdist.data.transforms import DecodeEval, DecodeTrain, Padding, ToOutput

__all__ = [
    "BatchIterator",
    "build_eval_iterator",
    "build_train_iterator",
    "reading_share",
]

Batch = dict[str, np.ndarray]


def seeds_of(seed: int) -> tuple[int, int]:
    """Independent 32-bit seeds for the shuffle and the augmentation."""
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}")
    shuffle_seed, augment_seed = np.random.SeedSequence(seed).generate_state(2)
    return int(shuffle_seed), int(augment_seed)


# The part of every global batch this process reads, where a run says so (reading_share).
_SHARE: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "jaxdist_data_share", default=None
)


@contextlib.contextmanager
def reading_share(share: int, shares: int) -> Iterator[None]:
    """Inside: iterators built without an explicit ``process_index``/``process_count`` read
    part ``share`` of ``shares`` of every global batch, instead of this process's own part.
    A run whose processes hold the same data-parallel replicas (a tensor axis or pipeline
    stages across processes) makes them read the same part
    (:func:`jaxdist.training.batches.data_share`)."""
    token = _SHARE.set(process_of(share, shares))
    try:
        yield
    finally:
        _SHARE.reset(token)


def process_of(process_index: int | None, process_count: int | None) -> tuple[int, int]:
    """``(index, count)``: the part of every global batch an iterator reads, given or (None)
    the run's :func:`reading_share`, else this process's of all processes."""
    if process_index is None or process_count is None:
        import jax

        share = _SHARE.get()
        default_index, default_count = share or (jax.process_index(), jax.process_count())
        process_index = default_index if process_index is None else process_index
        process_count = default_count if process_count is None else process_count
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index must be in [0, {process_count}), got {process_index}")
    return process_index, process_count


def image_shape(source: ImageSource, image_size: int) -> tuple[int, int, int]:
    """Shape of one output image: ``image_size`` squared for JPEG sources, else stored shape."""
    if source.encoded:
        return (image_size, image_size, 3)
    return tuple(np.shape(source[0]["image"]))


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything needed to (re)build the per-process grain iterator from a stream position."""

    stream: grain.MapDataset  # global sample stream, one element per sample
    stream_length: int | None  # None: infinite
    num_records: int
    seed: int
    global_batch_size: int
    process_index: int
    process_count: int
    drop_remainder: bool
    worker_count: int
    read_threads: int
    prefetch_batches: int
    batch_fn: Callable[[Sequence[Any]], Any] | None = None  # None: grain stacks the elements


class BatchIterator(Iterator[Batch]):
    """Per-process batches ``{"image": [b, H, W, C], "label": [b], ("mask": [b])}``, where
    ``b = global_batch_size / process_count``. Checkpointable with ``get_state``/``set_state``."""

    def __init__(self, plan: Plan, start_sample: int) -> None:
        self._plan = plan
        self._it: grain.DatasetIterator | None = None
        self._open(start_sample)

    # ------------------------------------------------------------------ building
    def _open(self, start_sample: int) -> None:
        plan = self._plan
        if start_sample < 0:
            raise ValueError(f"start_sample must be >= 0, got {start_sample}")
        self.close()
        self._start = start_sample
        self._next_sample = start_sample
        if plan.stream_length is None:
            window = plan.stream[start_sample:]
        else:
            count = max(0, plan.stream_length - start_sample)
            if plan.drop_remainder:
                count -= count % plan.global_batch_size
            window = plan.stream[start_sample : start_sample + count]
        self._stop = None if plan.stream_length is None else start_sample + len(window)
        local = window[plan.process_index :: plan.process_count]
        batches = local.batch(
            plan.global_batch_size // plan.process_count,
            drop_remainder=plan.drop_remainder,
            batch_fn=plan.batch_fn,
        )
        # Elements are whole batches; threads work on different batches at once.
        read = grain.ReadOptions(
            num_threads=plan.read_threads, prefetch_buffer_size=plan.prefetch_batches
        )
        dataset = batches.to_iter_dataset(read)
        if plan.worker_count > 0:
            _allow_grain_workers()
            dataset = dataset.mp_prefetch(
                grain.MultiprocessingOptions(
                    num_workers=plan.worker_count, per_worker_buffer_size=plan.prefetch_batches
                )
            )
        self._it = iter(dataset)

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> Batch:
        if self._it is None:
            raise StopIteration
        batch = next(self._it)
        step = self._plan.global_batch_size
        if self._stop is not None:
            step = min(step, self._stop - self._next_sample)
        self._next_sample += step
        return batch

    @property
    def next_sample(self) -> int:
        """Global samples consumed so far (over all processes and epochs, from stream start)."""
        return self._next_sample

    @property
    def epoch(self) -> float:
        """Epochs consumed so far: ``next_sample / num_records``."""
        return self._next_sample / self._plan.num_records

    @property
    def global_batch_size(self) -> int:
        return self._plan.global_batch_size

    @property
    def process_count(self) -> int:
        return self._plan.process_count

    @property
    def num_records(self) -> int:
        return self._plan.num_records

    # ------------------------------------------------------------------ checkpointing
    def get_state(self) -> dict[str, Any]:
        """JSON-serialisable position: ``next_sample`` plus grain's own iterator state."""
        grain_state = self._it.get_state() if self._it is not None else None
        return {**self.position_state(), "grain": grain_state}

    def position_state(self) -> dict[str, Any]:
        """:meth:`get_state` without grain's iterator state, which a failed read leaves
        unreliable: restoring it reopens the stream at ``next_sample``."""
        plan = self._plan
        return {
            "next_sample": self._next_sample,
            "start_sample": self._start,
            "global_batch_size": plan.global_batch_size,
            "process_count": plan.process_count,
            "seed": plan.seed,
            "num_records": plan.num_records,
            "grain": None,
        }

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved :meth:`get_state`.

        A state saved by an iterator built the same way restores grain's iterator state. One
        saved under another global batch size or process count (the previous stage of a
        batch-size ramp, a resized job) restarts this iterator at ``state["next_sample"]``; the
        stream is the same either way.
        """
        plan = self._plan
        for key in ("seed", "num_records"):
            if state[key] != getattr(plan, key):
                raise ValueError(
                    f"iterator state was saved with {key}={state[key]}, but this iterator has "
                    f"{key}={getattr(plan, key)}; it belongs to another dataset or seed"
                )
        same_build = (
            state["global_batch_size"] == plan.global_batch_size
            and state["process_count"] == plan.process_count
            and state["start_sample"] == self._start
            and state["grain"] is not None
            and self._it is not None
        )
        if same_build:
            self._it.set_state(state["grain"])
            self._next_sample = int(state["next_sample"])
        else:
            self._open(int(state["next_sample"]))

    def close(self) -> None:
        """Stop grain's threads and worker processes, if any."""
        if self._it is not None:
            close = getattr(self._it, "close", None)
            if close is not None:
                close()
            self._it = None

    def __enter__(self) -> BatchIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _allow_grain_workers() -> None:
    # grain's worker processes read absl flags; a program that never called absl's app.run
    # must mark them parsed first or the workers fail with UnparsedFlagAccessError.
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def check_batch(source: ImageSource, global_batch_size: int, process_count: int) -> None:
    if global_batch_size < 1 or global_batch_size % process_count:
        raise ValueError(
            f"global_batch_size must be a positive multiple of process_count={process_count}, "
            f"got {global_batch_size}"
        )
    if len(source) == 0:
        raise DatasetError(f"{source!r} has no records")


def build_train_iterator(
    source: ImageSource,
    global_batch_size: int,
    *,
    seed: int,
    start_sample: int = 0,
    process_index: int | None = None,
    process_count: int | None = None,
    image_size: int = 224,
    dtype: str = "float32",
    num_epochs: int | None = None,
    shuffle: bool = True,
    augment: bool = True,
    drop_remainder: bool = True,
    worker_count: int = 0,
    read_threads: int = 2,
    prefetch_batches: int = 2,
) -> BatchIterator:
    """Training batches for this process.

    Args:
      source: records (see :mod:`jaxdist.data.sources`).
      global_batch_size: batch over all processes; must divide by ``process_count``.
      seed: shuffle and augmentation seed.
      start_sample: global stream position to start at (resume, or a batch-size stage that
        begins after ``start_sample`` samples).
      process_index, process_count: this process's shard; default the run's
        :func:`reading_share`, else ``jax.process_index()`` and ``jax.process_count()``.
      image_size: output side for JPEG sources (random-resized-crop); array sources keep
        their size.
      dtype: ``"float32"`` (normalised by the source's mean/std) or ``"uint8"`` (normalise on
        the device with :func:`jaxdist.data.transforms.normalize`: 4x less host traffic).
      num_epochs: ``None`` repeats forever.
      shuffle: reshuffle every epoch; ``False`` keeps stored order.
      augment: random-resized-crop + flip for JPEG sources; ``False`` uses the eval crop.
      drop_remainder: with finite ``num_epochs``, drop a last partial global batch.
      worker_count: grain worker processes (0: decode in this process's threads).
      read_threads: threads per process, each preparing one batch.
      prefetch_batches: batches buffered ahead per process or worker.
    """
    process_index, process_count = process_of(process_index, process_count)
    check_batch(source, global_batch_size, process_count)
    stream = _train_stream(source, seed, image_size, dtype, num_epochs, shuffle, augment)
    plan = Plan(
        stream=stream,
        stream_length=None if num_epochs is None else len(stream),
        num_records=len(source),
        seed=seed,
        global_batch_size=global_batch_size,
        process_index=process_index,
        process_count=process_count,
        drop_remainder=drop_remainder,
        worker_count=worker_count,
        read_threads=read_threads,
        prefetch_batches=prefetch_batches,
    )
    return BatchIterator(plan, start_sample)


def shuffled_records(
    source: ImageSource, seed: int, num_epochs: int | None, shuffle: bool
) -> grain.MapDataset:
    """The global sample stream's records: the source shuffled per epoch, epochs repeated."""
    stream = grain.MapDataset.source(source)
    if shuffle:
        stream = stream.shuffle(seed=seeds_of(seed)[0])
    return stream.repeat(num_epochs)


def _train_stream(
    source: ImageSource,
    seed: int,
    image_size: int,
    dtype: str,
    num_epochs: int | None,
    shuffle: bool,
    augment: bool,
) -> grain.MapDataset:
    """The records shuffled, repeated, decoded (augmented) and converted to outputs."""
    stream = shuffled_records(source, seed, num_epochs, shuffle)
    if source.encoded:
        if augment:
            stream = stream.random_map(DecodeTrain(image_size), seed=seeds_of(seed)[1])
        else:
            stream = stream.map(DecodeEval(image_size))
    return stream.map(ToOutput(dtype, source.mean, source.std))


def padded_to_batches(
    stream: grain.MapDataset, global_batch_size: int, blank: grain.MapTransform
) -> grain.MapDataset:
    """``stream`` followed by ``blank`` records (``mask=False``) up to a multiple of
    ``global_batch_size``, so every process runs the same number of full eval batches."""
    padding = -len(stream) % global_batch_size
    if not padding:
        return stream
    return grain.MapDataset.concatenate([stream, grain.MapDataset.range(padding).map(blank)])


def build_eval_iterator(
    source: ImageSource,
    global_batch_size: int,
    *,
    process_index: int | None = None,
    process_count: int | None = None,
    image_size: int = 224,
    dtype: str = "float32",
    worker_count: int = 0,
    read_threads: int = 2,
    prefetch_batches: int = 2,
) -> BatchIterator:
    """One pass over ``source`` in stored order: resize + centre crop, padded with
    ``mask=False`` zero images to a multiple of ``global_batch_size``. Arguments as for
    :func:`build_train_iterator`."""
    process_index, process_count = process_of(process_index, process_count)
    check_batch(source, global_batch_size, process_count)
    stream = grain.MapDataset.source(source)
    if source.encoded:
        stream = stream.map(DecodeEval(image_size))
    stream = stream.map(ToOutput(dtype, source.mean, source.std, with_mask=True))
    stream = padded_to_batches(
        stream, global_batch_size, Padding(image_shape(source, image_size), dtype)
    )
    plan = Plan(
        stream=stream,
        stream_length=len(stream),
        num_records=len(source),
        seed=0,
        global_batch_size=global_batch_size,
        process_index=process_index,
        process_count=process_count,
        drop_remainder=True,  # the padding makes every batch full
        worker_count=worker_count,
        read_threads=read_threads,
        prefetch_batches=prefetch_batches,
    )
    return BatchIterator(plan, 0)

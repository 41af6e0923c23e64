"""The DALI loader: the grain stream's samples and crops, decoded by NVIDIA DALI.

Order, sharding and augmentation are the grain loader's (:mod:`jaxdist.data.pipeline`): the
same global sample stream, the same process shares, and the same crop window and flip for
every sample, planned by the same code from the same position-keyed RNG. Grain reads and
plans the records (the encoded bytes, a crop window, a flip: microseconds each); DALI does
the expensive part, one pipeline per local device:

* decode the crop window only (``decoders.image_slice``): on GPUs with ``device="mixed"``
  (nvJPEG, and the hardware JPEG decoder of A100/H100-class GPUs), elsewhere on the CPU
  (libjpeg-turbo, the same decoder the grain loader uses);
* resize the window to the output side, as the grain loader does: a window over twice the
  output first to the size the grain loader's reduced-scale decode gives it (antialiased
  cubic), then every window with one bilinear resize without antialiasing;
* mirror and normalise (``crop_mirror_normalize``), to uint8 or float32.

So the two loaders give the same samples in the same order, eval images within JPEG
rounding of each other, and a resumed run continues exactly: the position is one integer,
``next_sample``, and reopening the stream there replays the same windows.

On GPU hosts each pipeline's output stays on its GPU and is handed to JAX by DLPack as that
device's shard of the global batch (:attr:`~jaxdist.data.config.Pipeline.batch_sharding`);
on CPU hosts the outputs are numpy batches, placed like the grain loader's.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import grain.python as grain
import numpy as np

from jaxdist.data import pipeline as grain_loader
from jaxdist.data.crop_plans import PlanEval, PlannedBatch, PlanPadding, PlanTrain
from jaxdist.data.pipeline import Batch, BatchIterator
from jaxdist.data.sources import DatasetError, ImageSource

__all__ = [
    "DaliBatchIterator",
    "build_dali_eval_iterator",
    "build_dali_train_iterator",
    "dali_available",
    "decode_device",
]

INSTALL_HINT = "pip install 'jaxdist[dali]' (CUDA 12; for CUDA 13: pip install nvidia-dali-cuda130)"


def dali_available() -> bool:
    """Whether NVIDIA DALI can be imported."""
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return False
    return True


def require_dali() -> None:
    if not dali_available():
        raise DatasetError(
            f"data.loader=dali needs NVIDIA DALI, which is not installed: {INSTALL_HINT}"
        )


def decode_device(devices: Sequence[Any]) -> str:
    """``mixed`` (GPU decode) when the devices are GPUs, else ``cpu``."""
    return "mixed" if devices and devices[0].platform == "gpu" else "cpu"


# --------------------------------------------------------------------------- DALI pipelines


def crop_pipeline(
    batch_size: int,
    size: int,
    dtype: str,
    mean: Sequence[float],
    std: Sequence[float],
    device: str,
    device_id: int | None,
    threads: int,
):
    """A DALI pipeline fed planned records: window decode, resize, mirror, normalise."""
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(
        batch_size=batch_size,
        num_threads=threads,
        device_id=device_id,
        prefetch_queue_depth=1,
        exec_dynamic=True,
        enable_conditionals=True,
    )
    def pipeline():
        jpegs = fn.external_source(name="jpegs", dtype=types.UINT8)
        anchors = fn.external_source(name="anchors", dtype=types.INT32)
        shapes = fn.external_source(name="shapes", dtype=types.INT32)
        reduced = fn.external_source(name="reduced", dtype=types.FLOAT)
        reduce = fn.external_source(name="reduce", dtype=types.BOOL)
        flips = fn.external_source(name="flips", dtype=types.INT32)
        images = fn.decoders.image_slice(
            jpegs, anchors, shapes, device=device, output_type=types.RGB, axis_names="HW"
        )
        # The grain loader decodes crops over twice the output at 1/2 .. 1/8 scale, the
        # IDCT's low-pass; here an antialiased cubic resize to the same size (the closest
        # of DALI's filters to it), for those samples only.
        if reduce:
            images = fn.resize(images, size=reduced, antialias=True, interp_type=types.INTERP_CUBIC)
        images = fn.resize(
            images, size=[size, size], antialias=False, interp_type=types.INTERP_LINEAR
        )
        normalised = dtype == "float32"
        return fn.crop_mirror_normalize(
            images,
            mirror=flips,
            mean=list(mean) if normalised else [0.0],
            std=list(std) if normalised else [1.0],
            dtype=types.FLOAT if normalised else types.UINT8,
            output_layout="HWC",
        )

    built = pipeline()
    built.build()
    return built


class DaliBatchIterator(Iterator[Batch]):
    """Per-process batches ``{"image", "label", ("mask")}`` decoded by DALI, with
    :class:`~jaxdist.data.pipeline.BatchIterator`'s position, state and resume.

    ``records`` iterates this process's planned batches; each of ``devices`` (this process's
    devices, in the order their rows follow each other) gets a pipeline decoding its rows,
    one batch ahead of the one handed out. With a ``sharding``, GPU outputs become the
    global ``jax.Array`` of images without leaving the GPUs; otherwise images are numpy."""

    def __init__(
        self,
        records: BatchIterator,
        *,
        image_size: int,
        dtype: str,
        mean: Sequence[float],
        std: Sequence[float],
        devices: Sequence[Any],
        sharding: Any = None,
        threads: int | None = None,
        with_mask: bool = False,
    ) -> None:
        require_dali()
        self._records = records
        self._sharding = sharding
        self._with_mask = with_mask
        self._device = decode_device(devices)
        self._groups = [[device] for device in devices]
        local = records.global_batch_size // records.process_count
        if sharding is not None and self._device == "mixed":
            self._groups = row_groups(sharding, local * records.process_count)
            devices = [group[0] for group in self._groups]
        if not devices or local % len(devices):
            raise ValueError(
                f"the DALI loader splits this process's {local} samples over its "
                f"{len(devices)} local devices; the batch must divide evenly"
            )
        self._per_device = local // len(devices)
        threads = threads or max(1, (os.cpu_count() or 1) // len(devices))
        gpu = self._device == "mixed"
        self._pipelines = [
            crop_pipeline(
                self._per_device,
                image_size,
                dtype,
                mean,
                std,
                self._device,
                device.local_hardware_id if gpu else None,
                threads,
            )
            for device in devices
        ]
        self._in_flight: PlannedBatch | None = None
        self._in_flight_end = records.next_sample
        self._yielded = records.next_sample
        self._schedule()

    # ------------------------------------------------------------------ iteration
    def _fed(self, planned: PlannedBatch) -> list[Any]:
        """The pipelines with rows of ``planned`` (a short last batch leaves some idle)."""
        return [p for i, p in enumerate(self._pipelines) if i * self._per_device < len(planned)]

    def _schedule(self) -> None:
        """Feed the next planned batch to the pipelines and start them."""
        try:
            planned = next(self._records)
        except StopIteration:
            self._in_flight = None
            return
        for index, pipeline in enumerate(self._fed(planned)):
            start = index * self._per_device
            for name, values in planned.rows(start, start + self._per_device).items():
                pipeline.feed_input(name, values)
            pipeline.schedule_run()
        self._in_flight, self._in_flight_end = planned, self._records.next_sample

    def __iter__(self) -> DaliBatchIterator:
        return self

    def __next__(self) -> Batch:
        planned, end = self._in_flight, self._in_flight_end
        if planned is None:
            raise StopIteration
        outputs = [pipeline.outputs()[0] for pipeline in self._fed(planned)]
        images = self._images(outputs, planned)
        self._schedule()  # decodes while the caller trains on this batch
        batch = {"image": images, "label": planned.labels}
        if self._with_mask:
            batch["mask"] = planned.masks
        self._yielded = end
        return batch

    def _images(self, outputs: list[Any], planned: PlannedBatch) -> Any:
        if self._device == "mixed" and self._sharding is not None:
            return self._global_images(outputs, len(planned))
        if self._device == "mixed":
            outputs = [out.as_cpu() for out in outputs]
        images = np.concatenate([np.array(out.as_array()) for out in outputs])
        images[~planned.masks] = 0  # eval padding: zero images, as the grain loader's
        return images

    def _global_images(self, outputs: list[Any], rows: int) -> Any:
        """Each GPU's decoded rows as its shard of the global image batch (DLPack, copied
        on the device: DALI reuses its buffers); devices that hold the same rows (a model
        axis) get copies of them."""
        import jax

        shards = []
        for out, group in zip(outputs, self._groups, strict=False):
            decoded = jax.dlpack.from_dlpack(out.as_tensor()).copy()
            shards += [decoded] + [jax.device_put(decoded, d) for d in group[1:]]
        shape = (rows * self._records.process_count, *shards[0].shape[1:])
        return jax.make_array_from_single_device_arrays(shape, self._sharding, shards)

    # ------------------------------------------------------------------ position and state
    @property
    def next_sample(self) -> int:
        """Global samples handed out so far (the batch decoding ahead is not counted)."""
        return self._yielded

    @property
    def epoch(self) -> float:
        return self._yielded / self._records.num_records

    @property
    def global_batch_size(self) -> int:
        return self._records.global_batch_size

    def get_state(self) -> dict[str, Any]:
        """The position of the batches handed out: reopening there replays the same windows."""
        return {**self._records.position_state(), "next_sample": self._yielded}

    def position_state(self) -> dict[str, Any]:
        return self.get_state()

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved :meth:`get_state` (the stream reopens at its position)."""
        self._drain()
        self._records.set_state({**state, "grain": None})
        self._yielded = self._records.next_sample
        self._schedule()

    def _drain(self) -> None:
        if self._in_flight is not None:
            for pipeline in self._fed(self._in_flight):
                pipeline.outputs()
            self._in_flight = None

    def close(self) -> None:
        """Finish the batch in flight, stop grain's readers and drop the pipelines."""
        self._drain()
        self._records.close()
        self._pipelines = []

    def __enter__(self) -> DaliBatchIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def row_groups(sharding: Any, global_rows: int) -> list[list[Any]]:
    """This process's devices grouped by the batch rows they hold, in row order: one DALI
    pipeline decodes each group's rows on its first device."""
    index_map = sharding.addressable_devices_indices_map((global_rows,))
    groups: dict[int, list[Any]] = {}
    for device, index in sorted(index_map.items(), key=lambda item: item[0].id):
        rows = index[0] if index else slice(None)
        groups.setdefault(rows.start or 0, []).append(device)
    return [groups[start] for start in sorted(groups)]


# --------------------------------------------------------------------------- builders


def check_dali_source(source: ImageSource) -> None:
    if not source.encoded:
        raise DatasetError(
            f"data.loader=dali decodes images, but {source!r} holds decoded arrays; "
            "use data.loader=grain for it"
        )


def _checked(
    source: ImageSource,
    global_batch_size: int,
    process_index: int | None,
    process_count: int | None,
) -> tuple[int, int]:
    """This process's index and count, once DALI, the source and the batch are fit."""
    require_dali()
    check_dali_source(source)
    process = grain_loader.process_of(process_index, process_count)
    grain_loader.check_batch(source, global_batch_size, process[1])
    return process


def _decoded(
    stream: grain.MapDataset,
    source: ImageSource,
    global_batch_size: int,
    process: tuple[int, int],
    *,
    stream_length: int | None,
    seed: int,
    start_sample: int,
    drop_remainder: bool,
    read_threads: int,
    prefetch_batches: int,
    with_mask: bool,
    **decode: Any,
) -> DaliBatchIterator:
    """``stream`` of planned records, cut into this process's batches, decoded by DALI."""
    plan = grain_loader.Plan(
        stream=stream,
        stream_length=stream_length,
        num_records=len(source),
        seed=seed,
        global_batch_size=global_batch_size,
        process_index=process[0],
        process_count=process[1],
        drop_remainder=drop_remainder,
        worker_count=0,
        read_threads=read_threads,
        prefetch_batches=prefetch_batches,
        batch_fn=PlannedBatch,
    )
    records = BatchIterator(plan, start_sample)
    return DaliBatchIterator(
        records, mean=source.mean, std=source.std, with_mask=with_mask, **decode
    )


def build_dali_train_iterator(
    source: ImageSource,
    global_batch_size: int,
    *,
    seed: int,
    devices: Sequence[Any],
    sharding: Any = None,
    start_sample: int = 0,
    process_index: int | None = None,
    process_count: int | None = None,
    image_size: int = 224,
    dtype: str = "float32",
    num_epochs: int | None = None,
    shuffle: bool = True,
    augment: bool = True,
    drop_remainder: bool = True,
    read_threads: int = 2,
    prefetch_batches: int = 2,
    threads: int | None = None,
) -> DaliBatchIterator:
    """Training batches for this process, decoded by DALI: the samples, windows and flips of
    :func:`~jaxdist.data.pipeline.build_train_iterator` with the same arguments.

    ``devices``: this process's devices (one pipeline each); ``sharding``: the batch's
    sharding, for GPU outputs to stay on their GPUs; ``threads``: DALI threads per pipeline
    (default: the host's cores shared among the pipelines)."""
    process = _checked(source, global_batch_size, process_index, process_count)
    stream = grain_loader.shuffled_records(source, seed, num_epochs, shuffle)
    if augment:
        stream = stream.random_map(PlanTrain(image_size), seed=grain_loader.seeds_of(seed)[1])
    else:
        stream = stream.map(PlanEval(image_size))
    return _decoded(
        stream,
        source,
        global_batch_size,
        process,
        stream_length=None if num_epochs is None else len(stream),
        seed=seed,
        start_sample=start_sample,
        drop_remainder=drop_remainder,
        read_threads=read_threads,
        prefetch_batches=prefetch_batches,
        with_mask=False,
        image_size=image_size,
        dtype=dtype,
        devices=devices,
        sharding=sharding,
        threads=threads,
    )


def build_dali_eval_iterator(
    source: ImageSource,
    global_batch_size: int,
    *,
    devices: Sequence[Any],
    sharding: Any = None,
    process_index: int | None = None,
    process_count: int | None = None,
    image_size: int = 224,
    dtype: str = "float32",
    read_threads: int = 2,
    prefetch_batches: int = 2,
    threads: int | None = None,
) -> DaliBatchIterator:
    """One pass over ``source`` in stored order, centre-cropped by DALI and padded with
    ``mask=False`` zero images, as :func:`~jaxdist.data.pipeline.build_eval_iterator`."""
    process = _checked(source, global_batch_size, process_index, process_count)
    stream = grain.MapDataset.source(source).map(PlanEval(image_size))
    stream = grain_loader.padded_to_batches(stream, global_batch_size, PlanPadding())
    return _decoded(
        stream,
        source,
        global_batch_size,
        process,
        stream_length=len(stream),
        seed=0,
        start_sample=0,
        drop_remainder=True,
        read_threads=read_threads,
        prefetch_batches=prefetch_batches,
        with_mask=True,
        image_size=image_size,
        dtype=dtype,
        devices=devices,
        sharding=sharding,
        threads=threads,
    )

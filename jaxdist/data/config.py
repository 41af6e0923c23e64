"""The trainer's entry point: a :class:`DataConfig` in, a :class:`Pipeline` out.

::

    data = make_pipeline(DataConfig(source="folder", root="/data/imagenet", seed=0))
    it = data.train_iterator(global_batch_size=1024, start_sample=0)
    batch = next(it)                      # {"image": [1024/P, 224, 224, 3], "label": [1024/P]}
    state = it.get_state()                # store with the checkpoint
    # next batch-size stage at a known sample count:
    it = data.train_iterator(global_batch_size=2048, start_sample=it.next_sample)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxdist.data.arrayrecord import ArrayRecordSource
from jaxdist.data.hf_source import HuggingFaceSource
from jaxdist.data.pipeline import (
    BatchIterator,
    build_eval_iterator,
    build_train_iterator,
    image_shape,
)
from jaxdist.data.small_datasets import load_digits, load_mnist5k
from jaxdist.data.sources import ImageFolderSource, ImageSource, SyntheticSource
from jaxdist.data.tfds_source import TfdsSource

__all__ = [
    "SOURCES",
    "DataConfig",
    "Pipeline",
    "make_pipeline",
]

SOURCES = ("folder", "arrayrecord", "tfds", "hf", "synthetic", "digits", "mnist5k")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """What to read and how.

    Attributes:
      source: ``folder`` (ROOT/<split>/<class>/*.JPEG), ``arrayrecord`` (output of
        ``jaxdist data convert``), ``tfds`` (a prepared TFDS dataset), ``hf`` (a Hugging Face
        dataset), ``synthetic``, ``digits`` or ``mnist5k``.
      root: dataset folder for ``folder`` and ``arrayrecord``; for ``tfds`` the TFDS data dir
        and for ``hf`` the ``datasets`` cache dir (both optional: the library's default).
      dataset: the dataset ``tfds`` or ``hf`` reads: a TFDS name such as ``imagenet2012``; a
        Hub name such as ``ILSVRC/imagenet-1k`` or a local folder.
      image_size: output side for JPEG sources.
      dtype: ``float32`` (normalised on the host) or ``uint8`` (normalise on the device).
      seed: shuffle and augmentation seed.
      worker_count: grain worker processes (0 = decode in threads of this process).
      read_threads: threads per process or worker, each preparing one batch.
      prefetch_batches: batches buffered ahead.
      synthetic_train_examples, synthetic_eval_examples, num_classes: synthetic data size.
      val_fraction: held-out share of the small datasets.
      image_key, label_key: the ``tfds`` features or ``hf`` columns holding the images and
        labels (``""``: the first common name the dataset has, such as ``image``/``img`` and
        ``label``/``fine_label``).
    """

    source: str = "synthetic"
    root: str | None = None
    dataset: str | None = None
    image_size: int = 224
    dtype: str = "float32"
    seed: int = 0
    worker_count: int = 0
    read_threads: int = 2
    prefetch_batches: int = 2
    synthetic_train_examples: int = 1_281_167
    synthetic_eval_examples: int = 50_000
    num_classes: int = 1000
    val_fraction: float = 0.2
    image_key: str = ""
    label_key: str = ""

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"data source must be one of {SOURCES}, got {self.source!r}")
        if self.source in ("folder", "arrayrecord") and not self.root:
            raise ValueError(f"data source {self.source!r} needs root=<dataset folder>")
        if self.source in ("tfds", "hf") and not self.dataset:
            raise ValueError(f"data source {self.source!r} needs dataset=<dataset name>")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> DataConfig:
        """Build from a plain mapping (e.g. ``ConfigDict.to_dict()``); unknown keys are errors."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"unknown data config keys {unknown}; expected some of {sorted(known)}"
            )
        return cls(**values)


def open_source(config: DataConfig, split: str) -> ImageSource:
    """The source for ``split`` (``train`` or ``val``) named by ``config``."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    if config.source == "folder":
        return ImageFolderSource(config.root, split)
    if config.source == "arrayrecord":
        return ArrayRecordSource(config.root, split)
    if config.source == "tfds":
        return TfdsSource(config.dataset, split, data_dir=config.root or None,
                          image_key=config.image_key, label_key=config.label_key)  # fmt: skip
    if config.source == "hf":
        return HuggingFaceSource(config.dataset, split, cache_dir=config.root or None,
                                 image_key=config.image_key, label_key=config.label_key)  # fmt: skip
    if config.source == "synthetic":
        count = (
            config.synthetic_train_examples if split == "train" else config.synthetic_eval_examples
        )
        # A different seed per split, so eval images are not the train images.
        seed = config.seed * 2 + (split == "val")
        shape = (config.image_size, config.image_size, 3)
        return SyntheticSource(count, shape, config.num_classes, seed)
    loader = load_digits if config.source == "digits" else load_mnist5k
    return loader(split, val_fraction=config.val_fraction)


class Pipeline:
    """Train and eval sources of one dataset plus the settings to iterate them."""

    def __init__(self, config: DataConfig) -> None:
        self.config = config
        self.train_source = open_source(config, "train")
        self._eval_source: ImageSource | None = None

    @property
    def eval_source(self) -> ImageSource:
        if self._eval_source is None:
            self._eval_source = open_source(self.config, "val")
        return self._eval_source

    @property
    def num_classes(self) -> int:
        return len(self.train_source.classes)

    @property
    def num_train_examples(self) -> int:
        return len(self.train_source)

    @property
    def num_eval_examples(self) -> int:
        return len(self.eval_source)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """``(H, W, C)`` of one output image."""
        return image_shape(self.train_source, self.config.image_size)

    @property
    def mean(self) -> tuple[float, ...]:
        """Per-channel mean (0-255 units) used to normalise; for ``dtype="uint8"`` on device."""
        return tuple(self.train_source.mean)

    @property
    def std(self) -> tuple[float, ...]:
        return tuple(self.train_source.std)

    def _options(self) -> dict[str, Any]:
        c = self.config
        return {
            "image_size": c.image_size,
            "dtype": c.dtype,
            "worker_count": c.worker_count,
            "read_threads": c.read_threads,
            "prefetch_batches": c.prefetch_batches,
        }

    def train_iterator(
        self,
        global_batch_size: int,
        *,
        start_sample: int = 0,
        process_index: int | None = None,
        process_count: int | None = None,
        num_epochs: int | None = None,
    ) -> BatchIterator:
        """Shuffled, augmented, repeating batches from stream position ``start_sample``."""
        return build_train_iterator(
            self.train_source,
            global_batch_size,
            seed=self.config.seed,
            start_sample=start_sample,
            process_index=process_index,
            process_count=process_count,
            num_epochs=num_epochs,
            **self._options(),
        )

    def eval_iterator(
        self,
        global_batch_size: int,
        *,
        process_index: int | None = None,
        process_count: int | None = None,
    ) -> BatchIterator:
        """One padded pass over the held-out split (weight metrics by ``batch["mask"]``)."""
        return build_eval_iterator(
            self.eval_source,
            global_batch_size,
            process_index=process_index,
            process_count=process_count,
            **self._options(),
        )


def make_pipeline(config: DataConfig | Mapping[str, Any]) -> Pipeline:
    """Open the dataset ``config`` names; raises :class:`DatasetError` if it is missing or
    malformed."""
    if not isinstance(config, DataConfig):
        config = DataConfig.from_dict(config)
    return Pipeline(config)

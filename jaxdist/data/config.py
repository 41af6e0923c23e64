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
from jaxdist.data.dali_loader import (
    DaliBatchIterator,
    build_dali_eval_iterator,
    build_dali_train_iterator,
)
from jaxdist.data.hf_source import HuggingFaceSource
from jaxdist.data.pipeline import (
    BatchIterator,
    build_eval_iterator,
    build_train_iterator,
    image_shape,
)
from jaxdist.data.small_datasets import VAL_FRACTION, load_digits, load_mnist5k
from jaxdist.data.sources import DatasetError, ImageFolderSource, ImageSource, SyntheticSource
from jaxdist.data.splits import open_split, overlap, parse_split
from jaxdist.data.tfds_source import TfdsSource

__all__ = [
    "SOURCES",
    "DataConfig",
    "Pipeline",
    "make_pipeline",
]

# Synthetic data's classes when data.num_classes does not say (ImageNet's).
SYNTHETIC_CLASSES = 1000
SOURCES = ("folder", "arrayrecord", "tfds", "hf", "synthetic", "digits", "mnist5k")
ENCODED_SOURCES = ("folder", "arrayrecord", "tfds", "hf")  # image bytes, decoded per sample
LOADERS = ("grain", "dali")


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
      loader: who decodes: ``grain`` (simplejpeg and OpenCV in grain's threads or worker
        processes) or ``dali`` (NVIDIA DALI, on the GPU on GPU hosts; the same samples,
        crops and flips; ``pip install 'jaxdist[dali]'``).
      dali_threads: DALI threads per pipeline (one pipeline per local device; 0: the host's
        cores shared among them).
      worker_count: grain worker processes (0 = decode in threads of this process).
      read_threads: threads per process or worker, each preparing one batch.
      prefetch_batches: batches buffered ahead.
      synthetic_train_examples, synthetic_eval_examples: synthetic data size.
      num_classes: the classes. Every source but ``synthetic`` has its own (class folders,
        the ClassLabel's names), which a non-zero value must equal; ``synthetic`` makes this
        many (0: ImageNet's 1000).
      train_split, eval_split: what to train on and what to evaluate on, as split strings
        (:mod:`~jaxdist.data.splits`): ``train``, ``train[:90%]``, ``train+validation``,
        ``test``; ``val`` is the dataset's held-out split by its usual name. Their records
        must not overlap.
      val_fraction: held-out share of ``digits`` and ``mnist5k`` (their ``val`` split).
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
    loader: str = "grain"
    dali_threads: int = 0
    worker_count: int = 0
    read_threads: int = 2
    prefetch_batches: int = 2
    synthetic_train_examples: int = 1_281_167
    synthetic_eval_examples: int = 50_000
    num_classes: int = 0
    val_fraction: float = 0.2
    train_split: str = "train"
    eval_split: str = "val"
    image_key: str = ""
    label_key: str = ""

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"data source must be one of {SOURCES}, got {self.source!r}")
        if self.source in ("folder", "arrayrecord") and not self.root:
            raise ValueError(f"data source {self.source!r} needs root=<dataset folder>")
        if self.source in ("tfds", "hf") and not self.dataset:
            raise ValueError(f"data source {self.source!r} needs dataset=<dataset name>")
        if self.source not in ("digits", "mnist5k") and self.val_fraction != VAL_FRACTION:
            raise ValueError(
                f"data.val_fraction holds out a share of digits and mnist5k only; for "
                f"{self.source!r} use split strings: data.train_split='train[:80%]' "
                "data.eval_split='train[80%:]'"
            )
        self._check_loader()
        parse_split(self.train_split, "data.train_split")
        parse_split(self.eval_split, "data.eval_split")

    def _check_loader(self) -> None:
        if self.loader not in LOADERS:
            raise ValueError(f"data.loader must be one of {LOADERS}, got {self.loader!r}")
        if self.loader != "dali":
            return
        if self.source not in ENCODED_SOURCES:
            raise ValueError(
                f"data.loader=dali decodes images, but data.source={self.source!r} holds "
                f"decoded arrays; use it with data.loader=grain, or a source of image files "
                f"{ENCODED_SOURCES}"
            )
        if self.worker_count:
            raise ValueError(
                f"data.worker_count={self.worker_count} starts grain decode processes; with "
                "data.loader=dali DALI decodes in its own threads (data.dali_threads): set "
                "data.worker_count=0"
            )

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


def open_source(config: DataConfig, split: str, field: str = "split") -> ImageSource:
    """The source of split string ``split`` (:mod:`~jaxdist.data.splits`, e.g. ``train`` or
    ``train[:90%]``) of the dataset ``config`` names; ``field`` names it in errors."""
    return open_split(split, lambda name: _open_named(config, name), field)


def _open_named(config: DataConfig, split: str, show_progress: bool = False) -> ImageSource:
    """One named split of the dataset ``config`` names (``show_progress``: the ``datasets``
    library's bars while it prepares its cache)."""
    if config.source == "folder":
        return ImageFolderSource(config.root, split)
    if config.source == "arrayrecord":
        return ArrayRecordSource(config.root, split)
    if config.source == "tfds":
        return TfdsSource(
            config.dataset,
            split,
            data_dir=config.root or None,
            image_key=config.image_key,
            label_key=config.label_key,
        )
    if config.source == "hf":
        return HuggingFaceSource(
            config.dataset,
            split,
            cache_dir=config.root or None,
            image_key=config.image_key,
            label_key=config.label_key,
            show_progress=show_progress,
        )
    if config.source == "synthetic":
        if split not in ("train", "val"):
            raise DatasetError(f"synthetic data has the splits 'train' and 'val', not {split!r}")
        count = (
            config.synthetic_train_examples if split == "train" else config.synthetic_eval_examples
        )
        # A different seed per split, so eval images are not the train images.
        seed = config.seed * 2 + (split == "val")
        shape = (config.image_size, config.image_size, 3)
        return SyntheticSource(count, shape, config.num_classes or SYNTHETIC_CLASSES, seed)
    loader = load_digits if config.source == "digits" else load_mnist5k
    return loader(split, val_fraction=config.val_fraction)


class Pipeline:
    """Train and eval sources of one dataset plus the settings to iterate them.
    ``show_progress``: third-party progress bars while a dataset is prepared (off in runs)."""

    def __init__(self, config: DataConfig, show_progress: bool = False) -> None:
        self.config = config
        self.show_progress = show_progress
        # Where a batch's images go (the step's data sharding): DALI's GPU outputs are
        # placed there directly; numpy batches are placed by the step.
        self.batch_sharding: Any = None
        if config.loader == "dali":
            from jaxdist.data.dali_loader import require_dali

            require_dali()
        self._named: dict[str, ImageSource] = {}  # each named split opened once
        self.train_source = open_split(config.train_split, self._open, "data.train_split")
        self._eval_source: ImageSource | None = None
        found = len(self.train_source.classes)
        if config.num_classes and config.num_classes != found:
            names = ", ".join(map(str, self.train_source.classes[:3]))
            raise DatasetError(
                f"data.num_classes={config.num_classes}, but the {config.source} dataset has "
                f"{found} classes ({names}{', ...' if found > 3 else ''}); the model takes the "
                "dataset's: leave data.num_classes at 0"
            )

    def _open(self, name: str) -> ImageSource:
        if name not in self._named:
            self._named[name] = _open_named(self.config, name, self.show_progress)
        return self._named[name]

    @property
    def eval_source(self) -> ImageSource:
        """The held-out records (opened when first asked for); refused if they overlap the
        train records."""
        if self._eval_source is None:
            c = self.config
            source = open_split(c.eval_split, self._open, "data.eval_split")
            sizes = {name: len(self._open(name)) for name in _shared_names(c)}
            shared = overlap(c.train_split, c.eval_split, sizes)
            if shared:
                raise DatasetError(
                    f"data.eval_split {c.eval_split!r} and data.train_split {c.train_split!r} "
                    f"share {shared}: held-out metrics would be measured on training data; "
                    "choose disjoint ranges, e.g. 'train[:90%]' and 'train[90%:]'"
                )
            self._eval_source = source
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
    ) -> BatchIterator | DaliBatchIterator:
        """Shuffled, augmented, repeating batches from stream position ``start_sample``."""
        common = {
            "seed": self.config.seed,
            "start_sample": start_sample,
            "process_index": process_index,
            "process_count": process_count,
            "num_epochs": num_epochs,
        }
        if self.config.loader == "dali":
            return build_dali_train_iterator(
                self.train_source, global_batch_size, **common, **self._dali_options()
            )
        return build_train_iterator(
            self.train_source, global_batch_size, **common, **self._options()
        )

    def eval_iterator(
        self,
        global_batch_size: int,
        *,
        process_index: int | None = None,
        process_count: int | None = None,
    ) -> BatchIterator | DaliBatchIterator:
        """One padded pass over the held-out split (weight metrics by ``batch["mask"]``)."""
        common = {"process_index": process_index, "process_count": process_count}
        if self.config.loader == "dali":
            return build_dali_eval_iterator(
                self.eval_source, global_batch_size, **common, **self._dali_options()
            )
        return build_eval_iterator(self.eval_source, global_batch_size, **common, **self._options())

    def _dali_options(self) -> dict[str, Any]:
        import jax

        c = self.config
        return {
            "image_size": c.image_size,
            "dtype": c.dtype,
            "read_threads": c.read_threads,
            "prefetch_batches": c.prefetch_batches,
            "devices": jax.local_devices(),
            "sharding": self.batch_sharding,
            "threads": c.dali_threads or None,
        }


def _shared_names(config: DataConfig) -> set[str]:
    """The split names both the train and the eval split strings read from."""
    names = [
        {p.name for p in parse_split(text)} for text in (config.train_split, config.eval_split)
    ]
    return names[0] & names[1]


def make_pipeline(config: DataConfig | Mapping[str, Any]) -> Pipeline:
    """Open the dataset ``config`` names; raises :class:`DatasetError` if it is missing or
    malformed."""
    if not isinstance(config, DataConfig):
        config = DataConfig.from_dict(config)
    return Pipeline(config)

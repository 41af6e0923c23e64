"""Input pipeline: sources, transforms and per-host, checkpointable batch iterators on grain.

* :mod:`~jaxdist.data.sources` -- JPEG folder, synthetic and in-memory sources;
* :mod:`~jaxdist.data.arrayrecord` -- ArrayRecord shards and the folder converter;
* :mod:`~jaxdist.data.tfds_source`, :mod:`~jaxdist.data.hf_source` -- prepared TFDS datasets
  and Hugging Face datasets, read as JPEG bytes;
* :mod:`~jaxdist.data.small_datasets` -- the 8x8 digits and MNIST-5k, shipped inside jaxdist;
* :mod:`~jaxdist.data.transforms` -- decode, random-resized-crop, centre crop, normalise;
* :mod:`~jaxdist.data.pipeline` -- the global sample stream cut into per-process batches;
* :mod:`~jaxdist.data.config` -- :func:`make_pipeline`, the trainer's entry point.

See ``docs/data.md``.
"""

from jaxdist.data.arrayrecord import ArrayRecordSource, convert_folder
from jaxdist.data.config import SOURCES, DataConfig, Pipeline, make_pipeline, open_source
from jaxdist.data.hf_source import HuggingFaceSource
from jaxdist.data.pipeline import BatchIterator, build_eval_iterator, build_train_iterator
from jaxdist.data.small_datasets import load_digits, load_mnist5k
from jaxdist.data.sources import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ArraySource,
    DatasetError,
    ImageFolderSource,
    ImageSource,
    SyntheticSource,
)
from jaxdist.data.tfds_source import TfdsSource
from jaxdist.data.transforms import normalize

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "SOURCES",
    "ArrayRecordSource",
    "ArraySource",
    "BatchIterator",
    "DataConfig",
    "DatasetError",
    "HuggingFaceSource",
    "ImageFolderSource",
    "ImageSource",
    "Pipeline",
    "SyntheticSource",
    "TfdsSource",
    "build_eval_iterator",
    "build_train_iterator",
    "convert_folder",
    "load_digits",
    "load_mnist5k",
    "make_pipeline",
    "normalize",
    "open_source",
]

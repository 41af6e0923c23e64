"""What the ImageNet recipes share, so that each states only its paper's values.

:func:`jaxdist.run.config.base_config`'s defaults are already ResNet-50 on 224² images of
1,000 classes for 90 epochs, with SGD (Nesterov momentum 0.9, weight decay 1e-4) and a cosine
schedule after 5 warm-up epochs. :func:`imagenet` adds where the data is and the compute
dtype; :func:`imagenet_pod` adds what the record runs on pods of hundreds or thousands of
chips set alike.
"""

from __future__ import annotations

import ml_collections

from jaxdist.run.config import base_config

__all__ = ["imagenet", "imagenet_pod"]


def imagenet(model: str = "resnet50") -> ml_collections.ConfigDict:
    """``model`` on ImageNet as a folder of JPEGs at ``/data/imagenet`` (``--set data.root``
    moves it), computing in bfloat16."""
    c = base_config()
    c.model.name = model
    c.model.dtype = "bfloat16"
    c.data.source = "folder"
    c.data.root = "/data/imagenet"
    return c


def imagenet_pod() -> ml_collections.ConfigDict:
    """:func:`imagenet` as runs on pods feed it: ArrayRecord shards at
    ``/data/imagenet-arrayrecord`` (``jaxdist data convert``) of uint8 images normalised on
    the device (4x less host-to-device traffic), 32 images per device and step, label
    smoothing 0.1, a polynomial decay to 1e-4, evaluation every 4 epochs and progress every 10
    steps."""
    c = imagenet()
    c.data.source = "arrayrecord"
    c.data.root = "/data/imagenet-arrayrecord"
    c.data.dtype = "uint8"
    c.max_per_device_batch = 32
    c.label_smoothing = 0.1
    c.lr.kind = "poly"
    c.lr.end_lr = 1e-4
    c.eval_every_epochs = 4.0
    c.log_every_steps = 10
    return c

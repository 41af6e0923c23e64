"""Image classification: a ResNet from the recipe's ``model`` fields, trained with the
(label-smoothed) cross-entropy on the images of its ``data`` fields and evaluated by top-1 and
top-5 accuracy. The task every recipe without a ``get_task`` trains."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from jaxdist import models
from jaxdist.data import DataConfig, make_pipeline
from jaxdist.data.transforms import normalize
from jaxdist.pipeline import stages as pipeline_stages
from jaxdist.tasks.task import PipelineParts, Replicas, Task
from jaxdist.training import optim
from jaxdist.training.batchnorm import CrossReplicaBatchNorm
from jaxdist.training.classifier_loss import classifier_loss
from jaxdist.training.eval_step import classifier_eval

__all__ = ["DTYPES", "ImageClassification", "NormalizeOnDevice", "build_model", "model_description"]

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def build_model(
    cfg: ml_collections.ConfigDict, num_classes: int, axis_name: Any, num_replicas: int
):
    """The recipe's model with cross-replica BatchNorm over ``axis_name`` (``num_replicas``
    devices) in groups of ``cfg.bn_group_size``."""
    group = cfg.bn_group_size
    if group is not None and (group < 1 or num_replicas % group):
        raise ValueError(
            f"model.bn_group_size={group} must divide the {num_replicas} data-parallel "
            "devices (None: BatchNorm statistics over all of them)"
        )
    if cfg.dtype not in DTYPES:
        raise ValueError(f"model.dtype must be one of {sorted(DTYPES)}, got {cfg.dtype!r}")
    norm = functools.partial(
        CrossReplicaBatchNorm,
        axis_name=axis_name,
        group_size=group,
        momentum=cfg.bn_momentum,
        epsilon=cfg.bn_epsilon,
    )
    return models.create(
        cfg.name,
        num_classes=num_classes,
        width=cfg.width,
        stem=cfg.stem,
        dtype=DTYPES[cfg.dtype],
        zero_init_last_bn_scale=cfg.zero_init_last_bn_scale,
        pointwise_matmul=cfg.pointwise_matmul,
        norm=norm,
    )


class NormalizeOnDevice:
    """A model whose ``apply`` first normalises uint8 images (for ``data.dtype="uint8"``)."""

    def __init__(self, model, mean, std) -> None:
        self.model, self.mean, self.std = model, mean, std

    def apply(self, variables, images, **kwargs):
        return self.model.apply(variables, normalize(images, self.mean, self.std), **kwargs)


class ImageClassification(Task):
    """A recipe's ResNet classifier on its image data.

    Attributes:
      data: the image :class:`~jaxdist.data.Pipeline` (``data.num_classes``, ``image_shape``).
      model: the flax classifier, its BatchNorm over the replicas' axes.
      applied: ``model`` as applied to a batch's images (normalising uint8 images first).
      example: one input image batch ``(1, *image_shape)``, to trace shapes with.
    """

    headline = "top1"
    higher_is_better = True
    unit = "images"

    def __init__(self, config: ml_collections.ConfigDict, replicas: Replicas) -> None:
        self.config = config
        self.data = make_pipeline(DataConfig.from_dict(config.data.to_dict()))
        self.name = config.model.name
        self.num_classes = self.data.num_classes
        # The run's config (printed, recorded in config.json) holds the dataset's real count.
        config.data.num_classes = self.num_classes
        self.label_smoothing = config.label_smoothing
        self.model = build_model(
            config.model, self.num_classes, replicas.axis_names, replicas.count
        )
        self.applied = self.model
        if config.data.dtype == "uint8":
            self.applied = NormalizeOnDevice(self.model, self.data.mean, self.data.std)
        self.example = jnp.zeros((1, *self.data.image_shape), jnp.float32)
        self._loss = classifier_loss(
            self.applied, num_classes=self.num_classes, label_smoothing=self.label_smoothing
        )
        self._eval = classifier_eval(self.applied)

    def init_variables(self, rng: jax.Array) -> tuple[Any, dict]:
        variables = dict(models.init_variables(self.model, rng, self.example))
        return variables.pop("params"), variables

    def loss(self, params, model_state, batch, rng):
        return self._loss(params, model_state, batch, rng)

    def eval_sums(self, params, model_state, batch):
        return self._eval(params, model_state, batch)

    def batch_spec(self, global_batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        dtype = jnp.uint8 if self.config.data.dtype == "uint8" else jnp.float32
        return {
            "image": jax.ShapeDtypeStruct((global_batch_size, *self.data.image_shape), dtype),
            "label": jax.ShapeDtypeStruct((global_batch_size,), jnp.int32),
        }

    def model_inputs(self, batch: dict) -> jax.Array:
        """The images as the model takes them (normalised on the device for uint8 data)."""
        if self.config.data.dtype == "uint8":
            return normalize(batch["image"], self.data.mean, self.data.std)
        return batch["image"]

    def pipeline_parts(
        self, virtual_stages: int, boundaries: Sequence[int] | None
    ) -> PipelineParts:
        """The ResNet cut into stages at layer indices (stem, blocks, head); the cross-entropy
        and accuracy on the last stage's logits."""
        if boundaries:
            modules = pipeline_stages.split_module(self.model, boundaries=tuple(boundaries))
        else:
            modules = pipeline_stages.split_module(self.model, stages=virtual_stages)
        num_classes, smoothing = self.num_classes, self.label_smoothing

        def loss(logits, micro_batch):
            labels = micro_batch["label"]
            value = optim.smoothed_cross_entropy(logits, labels, num_classes, smoothing).mean()
            return value, {"accuracy": (jnp.argmax(logits, -1) == labels).mean()}

        return PipelineParts(
            stages=pipeline_stages.flax_stages(modules),
            loss=loss,
            inputs=self.model_inputs,
            split=pipeline_stages.variable_splitter(modules, self.example),
        )

    def describe(self) -> dict[str, Any]:
        return model_description(self.config)


def model_description(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """What a pipeline profile records of the recipe's model."""
    m = config.model
    return {
        "name": m.name,
        "width": m.width,
        "stem": m.stem,
        "dtype": m.dtype,
        "image_size": config.data.image_size,
    }

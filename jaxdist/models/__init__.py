"""Models the recipes train, looked up by name.

``MODELS`` maps a name to a factory taking :class:`~jaxdist.models.resnet.ResNet` fields as
keyword arguments::

    model = create("resnet50", num_classes=1000, dtype=jnp.bfloat16)
    variables = init_variables(model, key, images_BxHxWxC)
    logits, updates = model.apply(variables, images, train=True, mutable=["batch_stats"])

:func:`param_count` counts parameters with ``jax.eval_shape``, so even ResNet-152 is counted
without allocating or computing anything.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxdist.models.resnet import (
    ARCHITECTURES,
    BasicBlock,
    BottleneckBlock,
    PointwiseConv,
    ResNet,
    default_norm,
    resnet10,
    resnet18,
    resnet34,
    resnet50,
    resnet101,
    resnet152,
)

MODELS: dict[str, Callable[..., nn.Module]] = {
    "resnet10": resnet10,
    "resnet18": resnet18,
    "resnet34": resnet34,
    "resnet50": resnet50,
    "resnet101": resnet101,
    "resnet152": resnet152,
}


def create(name: str, **kwargs: Any) -> nn.Module:
    """Build the model registered as ``name`` with the given fields."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; expected one of {sorted(MODELS)}")
    return MODELS[name](**kwargs)


def param_shapes(
    model: nn.Module, input_shape: Sequence[int], input_dtype: Any = jnp.float32
) -> Any:
    """Shapes and dtypes of ``model``'s variables (``params`` and ``batch_stats``), computed
    abstractly with ``jax.eval_shape``: nothing is allocated or run."""
    images = jax.ShapeDtypeStruct(tuple(input_shape), input_dtype)
    return jax.eval_shape(lambda x: model.init(jax.random.key(0), x, train=False), images)


def init_variables(model: nn.Module, rng: jax.Array, images: Any) -> dict[str, Any]:
    """``model``'s variables (``params``, ``batch_stats``) from ``rng``, made by one compiled
    program: run op by op, init compiles each op on its own at every start, and JAX's
    compilation cache keeps none of them."""
    return jax.jit(lambda key, x: model.init(key, x, train=False))(rng, images)


def param_count(model: nn.Module, input_shape: Sequence[int] = (1, 224, 224, 3)) -> int:
    """Number of trainable parameters (the ``params`` collection; running statistics are not
    parameters), counted without materialising them."""
    params = param_shapes(model, input_shape)["params"]
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))


__all__ = [
    "ARCHITECTURES",
    "MODELS",
    "BasicBlock",
    "BottleneckBlock",
    "PointwiseConv",
    "ResNet",
    "create",
    "default_norm",
    "init_variables",
    "param_count",
    "param_shapes",
    "resnet10",
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet101",
    "resnet152",
]

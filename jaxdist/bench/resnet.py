"""ResNet-50 training throughput: jaxdist's TrainStep against the flax imagenet example.

Three steps are timed: jaxdist's (its ResNet-50, whose 1x1 convolutions are matrix products),
the same with ``pointwise_matmul=False`` (1x1 convolutions as ``nn.Conv``, like the example's),
which tells the model's share of the difference from the step's, and the example's.

The peer is written here the way flax's ``examples/imagenet`` writes it (``models.py`` and
``train.py``), so both run on the same devices, batch and resolution:

* model: ResNet-50 v1.5 with ``nn.Conv(padding="SAME")`` (the stem ``[(3, 3), (3, 3)]``),
  ``nn.BatchNorm(momentum=0.9, epsilon=1e-5, axis_name="batch")`` synced across all devices,
  zero-initialised last BN scale, ``max_pool(..., padding="SAME")``;
* step: cross-entropy on one-hot labels plus ``0.5 * 1e-4 * sum(w**2)`` over ``ndim > 1``
  parameters, ``value_and_grad``, ``lax.pmean(grads, "batch")``, Nesterov momentum SGD, metrics
  averaged with ``pmean``; a plain ``jax.jit`` of a ``shard_map`` over a ``batch`` axis (the
  example uses ``pmap``, which is the same SPMD program), state not donated, as there. It is
  the train-step benchmark's baseline (:func:`jaxdist.bench.train_step.baseline_step`) with
  that weight decay.

All steps take already-sharded device batches, so this times the step alone; the input
pipeline's rate (:func:`jaxdist.bench.data.measure`) is reported next to it.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist import models
from jaxdist.bench import timing
from jaxdist.bench.train_step import baseline_step
from jaxdist.runtime import dispatch
from jaxdist.training import optim
from jaxdist.training.batchnorm import CrossReplicaBatchNorm
from jaxdist.training.classifier_loss import classifier_loss
from jaxdist.training.train_step import TrainStep

__all__ = [
    "StepRate",
    "measure",
]


class _FlaxBottleneck(nn.Module):
    filters: int
    strides: tuple[int, int]
    norm: functools.partial
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
        residual = x
        y = nn.relu(self.norm()(conv(self.filters, (1, 1))(x)))
        y = nn.relu(self.norm()(conv(self.filters, (3, 3), self.strides)(y)))
        y = self.norm(scale_init=nn.initializers.zeros_init())(conv(self.filters * 4, (1, 1))(y))
        if residual.shape != y.shape:
            residual = self.norm(name="norm_proj")(
                conv(self.filters * 4, (1, 1), self.strides, name="conv_proj")(residual)
            )
        return nn.relu(residual + y)


class FlaxExampleResNet50(nn.Module):
    """flax ``examples/imagenet`` ResNet50 (stage sizes 3, 4, 6, 3); ``dtype`` is the
    example's ``half_precision`` (bfloat16 computation, float32 parameters)."""

    num_classes: int = 1000
    width: int = 64
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = True):
        norm = functools.partial(
            nn.BatchNorm,
            use_running_average=not train,
            momentum=0.9,
            epsilon=1e-5,
            dtype=self.dtype,
            axis_name="batch",
        )
        x = nn.Conv(
            self.width, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], use_bias=False, dtype=self.dtype
        )(x)
        x = nn.relu(norm(name="bn_init")(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for i, block_size in enumerate((3, 4, 6, 3)):
            for j in range(block_size):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = _FlaxBottleneck(self.width * 2**i, strides, norm, self.dtype)(x)
        x = nn.Dense(self.num_classes, dtype=self.dtype)(jnp.mean(x, axis=(1, 2)))
        return jnp.asarray(x, jnp.float32)


@dataclass(frozen=True)
class StepRate:
    name: str
    images_per_s: float
    step_ms: float
    compile_s: float


def _time_interleaved(
    runners: dict[str, Callable[[], Any]], batch_size: int, steps: int, warmup: int, rounds: int
) -> list[StepRate]:
    """Compile and warm up every runner, then time them in interleaved rounds of ``steps``
    steps (:func:`jaxdist.bench.timing.interleaved_rounds`); medians over rounds."""
    compile_s = timing.warm_up(runners, warmup)
    seconds = timing.interleaved_rounds(runners, steps, rounds)
    rates = []
    for name in runners:
        step_s = statistics.median(seconds[name])
        rates.append(StepRate(name, batch_size / step_s, step_s * 1e3, compile_s[name]))
    return rates


JAXDIST = "jaxdist TrainStep"
JAXDIST_CONV_1X1 = "jaxdist, 1x1 as nn.Conv"
FLAX_EXAMPLE = "flax example (jit+pmean)"


def _jaxdist_runner(
    mesh: Mesh,
    images: np.ndarray,
    labels: np.ndarray,
    width: int,
    pointwise_matmul: bool,
    dtype: Any = jnp.float32,
) -> Callable[[], Any]:
    """The trainer's TrainStep, model and optimizer, as one step on a fixed batch."""
    norm = functools.partial(CrossReplicaBatchNorm, axis_name="data")
    model = models.resnet50(width=width, norm=norm, pointwise_matmul=pointwise_matmul, dtype=dtype)
    dummy = jnp.zeros((1, *images.shape[1:]), jnp.float32)
    variables = model.init(jax.random.key(0), dummy, train=False)
    step = TrainStep(
        classifier_loss(model, num_classes=1000), optim.sgd_momentum(0.1), mesh, data_axes="data"
    )
    params = variables.pop("params")
    holder = {"state": step.init(params, dict(variables))}
    batch = step.shard_batch({"image": images, "label": labels})
    rng_key = jax.random.PRNGKey(0)

    def run():
        holder["state"], metrics = step(holder["state"], batch, rng_key)
        return metrics

    return run


def _flax_example_runner(
    mesh: Mesh, images: np.ndarray, labels: np.ndarray, width: int, dtype: Any = jnp.float32
) -> Callable[[], Any]:
    """The flax imagenet example's model, optimizer and jit + pmean step."""
    flax_model = FlaxExampleResNet50(width=width, dtype=dtype)
    dummy = jnp.zeros((1, *images.shape[1:]), jnp.float32)
    variables = flax_model.init(jax.random.key(0), dummy, train=False)
    tx = optax.sgd(0.1, momentum=0.9, nesterov=True)
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(variables["params"], replicated)
    stats = jax.device_put(variables["batch_stats"], replicated)
    opt_state = jax.device_put(tx.init(variables["params"]), replicated)
    sharded = NamedSharding(mesh, P("batch"))
    batch = {"image": jax.device_put(images, sharded), "label": jax.device_put(labels, sharded)}
    # The example's step: its L2 weight decay, and the state not donated, as there.
    train_step = baseline_step(flax_model, tx, mesh, "batch", weight_decay=1e-4, donate=False)
    carry = {"state": (params, stats, opt_state)}
    # The same queue limit as jaxdist's TrainStep (jaxdist.runtime.dispatch), so that neither runner
    # can queue more steps than the other, nor deep enough to hang XLA:CPU.
    window = dispatch.shared_window(mesh)

    def run():
        window.make_room()
        outputs = train_step(*carry["state"], batch)
        carry["state"] = outputs[:3]
        window.add(outputs[3])
        return outputs[3]

    return run


def measure(
    batch_size: int,
    image_size: int,
    steps: int,
    warmup: int = 1,
    width: int = 64,
    rounds: int = 3,
    conv_1x1_variant: bool = True,
    dtype: Any = jnp.float32,
    devices: Any = None,
) -> list[StepRate]:
    """Images/s of jaxdist's step and the flax example's on all devices, on the same random
    batch. ``conv_1x1_variant`` adds jaxdist's step with its 1x1 convolutions as ``nn.Conv``
    (``ResNet.pointwise_matmul=False``), which tells the model's share of the difference.
    ``dtype`` is both models' computation (``jnp.bfloat16``: mixed precision, parameters
    float32). ``devices``: the devices to run on (default: all)."""
    devices = np.asarray(jax.devices() if devices is None else devices)
    rng = np.random.default_rng(0)
    images = rng.standard_normal((batch_size, image_size, image_size, 3), np.float32)
    labels = rng.integers(0, 1000, batch_size).astype(np.int32)

    data_mesh = Mesh(devices, ("data",))
    runners = {JAXDIST: _jaxdist_runner(data_mesh, images, labels, width, True, dtype)}
    if conv_1x1_variant:
        runners[JAXDIST_CONV_1X1] = _jaxdist_runner(data_mesh, images, labels, width, False, dtype)
    runners[FLAX_EXAMPLE] = _flax_example_runner(
        Mesh(devices, ("batch",)), images, labels, width, dtype
    )
    return _time_interleaved(runners, batch_size, steps, warmup, rounds)

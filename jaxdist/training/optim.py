"""Large-batch training pieces on top of optax: loss, learning-rate rules and optimizers.

* :func:`smoothed_cross_entropy` – label smoothing (``optax.smooth_labels``) + softmax
  cross-entropy, computed in float32 whatever the logits' dtype.
* :func:`scaled_learning_rate` – the linear scaling rule, ``base_lr * batch / 256`` (Goyal).
* :func:`lr_schedule` – warm-up then cosine / polynomial / constant / step decay, **as a
  function of the fractional epoch**, built from optax schedule primitives evaluated at epoch
  values.
* :func:`lars` and :func:`sgd_momentum` – ``optax.lars`` and ``optax.sgd`` with weight decay
  (and, for LARS, the trust ratio) masked off BatchNorm parameters and biases.

How the learning rate reaches the optimizer
-------------------------------------------
optax calls a schedule with the *step count*, but with batch-size ramping (see
:mod:`jaxdist.training.batch_schedule`) a step no longer stands for a fixed number of samples, so a
schedule written in steps goes wrong the moment the batch size changes. Here the schedule is a
function of the fractional epoch (samples seen / dataset size), and the optimizers are built
with ``optax.inject_hyperparams``, which keeps ``learning_rate`` as a value in the optimizer
state. The train step sets it before each update::

    lr = lr_fn(epoch)                                   # epoch: float32 scalar, traced
    opt_state = set_learning_rate(opt_state, lr)
    updates, opt_state = tx.update(grads, opt_state, params)

That is all the adapter there is: no step-to-epoch conversion inside optax, the state carries
the LR that was used (handy for logging), and it survives a checkpoint like any other leaf.
Pass the optimizers a number as ``learning_rate`` (the initial value): a callable would be
treated by ``inject_hyperparams`` as a schedule of the step count and would overwrite what the
train step sets.

Masks
-----
MLPerf's reference LARS (and Goyal/flax for weight decay) exclude BatchNorm scales and biases
and all biases from weight decay and from the trust-ratio scaling. In a flax ResNet those are
exactly the leaves with ``ndim <= 1`` (conv kernels are 4-D, the classifier kernel 2-D), which
is the rule :func:`decay_mask` applies. A masked-out leaf under ``optax.lars`` receives
``lr * grad`` accumulated with momentum: plain momentum SGD without weight decay.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxdist.training import global_norm

__all__ = [
    "adamw",
    "get_learning_rate",
    "lars",
    "lr_schedule",
    "make_optimizer",
    "scaled_learning_rate",
    "set_learning_rate",
    "sgd_momentum",
    "smoothed_cross_entropy",
]

SCHEDULE_KINDS = ("cosine", "poly", "constant", "step")

EpochSchedule = Callable[[jax.typing.ArrayLike], jax.Array]


# --------------------------------------------------------------------------- loss


def smoothed_cross_entropy(
    logits: jax.Array, labels: jax.Array, num_classes: int, smoothing: float = 0.0
) -> jax.Array:
    """Per-example softmax cross-entropy against one-hot labels smoothed by ``smoothing``.

    The target puts ``1 - smoothing + smoothing / num_classes`` on the true class and
    ``smoothing / num_classes`` on every other class. Logits are upcast to float32 first, so
    bf16 models get a float32 loss.

    Args:
      logits: ``(..., num_classes)``.
      labels: integer class indices, shape ``logits.shape[:-1]``.
      num_classes: number of classes (must equal ``logits.shape[-1]``).
      smoothing: in ``[0, 1)``; 0 gives the plain cross-entropy.

    Returns:
      the loss of every example, shape ``logits.shape[:-1]`` (average it yourself, so padded
      examples can be masked out).
    """
    if logits.shape[-1] != num_classes:
        raise ValueError(
            f"logits have {logits.shape[-1]} classes in their last axis, expected "
            f"num_classes={num_classes} (logits shape {logits.shape})"
        )
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels must have shape {logits.shape[:-1]} (logits shape without the class axis), "
            f"got {labels.shape}"
        )
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"labels must be integer class indices, got dtype {labels.dtype}")
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
    targets = optax.smooth_labels(jax.nn.one_hot(labels, num_classes, dtype=jnp.float32), smoothing)
    return optax.softmax_cross_entropy(logits.astype(jnp.float32), targets)


# --------------------------------------------------------------------------- learning rate


def scaled_learning_rate(base_lr: float, batch_size: int, base_batch: int = 256) -> float:
    """Linear scaling rule (Goyal et al. 2017): ``base_lr * batch_size / base_batch``.

    ``scaled_learning_rate(0.1, 8192) == 3.2``, Goyal's 8K-batch peak LR.
    """
    if base_lr <= 0:
        raise ValueError(f"base_lr must be positive, got {base_lr}")
    for name, value in (("batch_size", batch_size), ("base_batch", base_batch)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return base_lr * batch_size / base_batch


def lr_schedule(
    kind: str,
    peak_lr: float,
    warmup_epochs: float,
    total_epochs: float,
    end_lr: float = 0.0,
    power: float = 2.0,
    init_lr: float = 0.0,
    step_epochs: Sequence[float] = (),
    step_factor: float = 0.1,
) -> EpochSchedule:
    """Learning rate as a function of the fractional epoch.

    Linear warm-up from ``init_lr`` at epoch 0 to ``peak_lr`` at ``warmup_epochs``, then

    * ``"cosine"``: half a cosine from ``peak_lr`` down to ``end_lr`` at ``total_epochs``;
    * ``"poly"``: ``(peak_lr - end_lr) * (1 - t)**power + end_lr``, ``t`` going from 0 to 1
      between the end of warm-up and ``total_epochs`` (MLPerf LARS: power 2, end 1e-4);
    * ``"constant"``: ``peak_lr``;
    * ``"step"``: ``peak_lr``, multiplied by ``step_factor`` from each epoch in
      ``step_epochs`` on (Goyal et al.: 0.1 at epochs 30, 60, 80 of 90).

    ``end_lr`` and ``power`` apply to the decaying kinds only. After ``total_epochs`` the value
    stays at its end. The returned function accepts a Python
    float or a (traced) float array, so the train step can evaluate it under ``jit``.
    """
    step_epochs = tuple(step_epochs)
    _check_schedule(
        kind, peak_lr, warmup_epochs, total_epochs, end_lr, power, init_lr, step_epochs, step_factor
    )
    # optax schedules do arithmetic on their count without casting it to an int, so the
    # "steps" below are epochs and the boundaries may be fractional.
    warmup = optax.linear_schedule(init_lr, peak_lr, transition_steps=warmup_epochs)
    decay_epochs = total_epochs - warmup_epochs
    if kind == "cosine":
        after_warmup = optax.cosine_decay_schedule(
            peak_lr, decay_steps=decay_epochs, alpha=end_lr / peak_lr if peak_lr else 0.0
        )
    elif kind == "poly":
        after_warmup = optax.polynomial_schedule(
            peak_lr, end_lr, power=power, transition_steps=decay_epochs
        )
    elif kind == "step":
        # The joined schedule sees epochs counted from the end of warm-up.
        after_warmup = optax.piecewise_constant_schedule(
            peak_lr, {e - warmup_epochs: step_factor for e in step_epochs}
        )
    else:
        after_warmup = optax.constant_schedule(peak_lr)
    joined = optax.join_schedules([warmup, after_warmup], boundaries=[warmup_epochs])

    def schedule(epoch: jax.typing.ArrayLike) -> jax.Array:
        return jnp.asarray(joined(jnp.asarray(epoch, jnp.float32)), jnp.float32)

    return schedule


def _check_schedule(
    kind, peak_lr, warmup_epochs, total_epochs, end_lr, power, init_lr, step_epochs, step_factor
) -> None:
    """One ValueError naming the first argument of :func:`lr_schedule` that cannot work."""
    if kind not in SCHEDULE_KINDS:
        raise ValueError(f"lr_schedule kind must be one of {SCHEDULE_KINDS}, got {kind!r}")
    for name, value in (("peak_lr", peak_lr), ("end_lr", end_lr), ("init_lr", init_lr)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite non-negative number, got {value}")
    if not 0 <= warmup_epochs < total_epochs:
        raise ValueError(
            f"need 0 <= warmup_epochs < total_epochs, got warmup_epochs={warmup_epochs}, "
            f"total_epochs={total_epochs}"
        )
    if kind == "poly" and power <= 0:
        raise ValueError(f"poly schedule needs a positive power, got {power}")
    if kind == "step":
        inside = all(warmup_epochs < e <= total_epochs for e in step_epochs)
        if not step_epochs or not inside or list(step_epochs) != sorted(set(step_epochs)):
            raise ValueError(
                f"step schedule needs increasing step_epochs in (warmup_epochs, total_epochs] = "
                f"({warmup_epochs}, {total_epochs}], got {step_epochs}"
            )
        if not 0 <= step_factor <= 1:
            raise ValueError(f"step_factor must be in [0, 1], got {step_factor}")
    elif step_epochs:
        raise ValueError(f"step_epochs only applies to kind='step', got kind={kind!r}")


def set_learning_rate(opt_state: Any, learning_rate: jax.typing.ArrayLike) -> Any:
    """Write ``learning_rate`` into every ``inject_hyperparams`` state inside ``opt_state``
    (also when wrapped, e.g. by ``optax.MultiSteps``).

    The value is cast to the dtype already stored, so the state's shapes and dtypes never
    change and a jitted step is not retraced.
    """
    current = optax.tree_utils.tree_get(opt_state, "learning_rate")
    if current is None:
        raise KeyError(
            "optimizer state has no 'learning_rate' hyperparameter; build the optimizer with "
            "jaxdist.training.optim.make_optimizer (or optax.inject_hyperparams)"
        )
    value = jnp.asarray(learning_rate, dtype=jnp.result_type(current))
    return optax.tree_utils.tree_set(opt_state, learning_rate=value)


def get_learning_rate(opt_state: Any) -> jax.Array:
    """The learning rate stored in ``opt_state`` (the one the last update used)."""
    value = optax.tree_utils.tree_get(opt_state, "learning_rate")
    if value is None:
        raise KeyError("optimizer state has no 'learning_rate' hyperparameter")
    return value


# --------------------------------------------------------------------------- optimizers


# The eps each optimizer that reads one takes when none is given: optax's defaults. adamw
# divides by sqrt(v) + eps and needs eps > 0; LARS's trust ratio needs none.
DEFAULT_EPS = {"adamw": 1e-8, "lars": 0.0}


def _check_initial_learning_rate(learning_rate: Any) -> None:
    if callable(learning_rate) or jnp.ndim(learning_rate) != 0:
        raise TypeError(
            f"learning_rate must be a number (the initial value), got {learning_rate!r}; the "
            f"train step sets it each step from the epoch schedule with set_learning_rate"
        )


def decay_mask(params: Any) -> Any:
    """``True`` for leaves that get weight decay and LARS trust-ratio scaling: kernels
    (``ndim > 1``); ``False`` for BatchNorm scales/offsets and biases (``ndim <= 1``)."""
    return jax.tree.map(lambda p: jnp.ndim(p) > 1, params)


def _masked_lars(
    learning_rate: float,
    weight_decay: float,
    momentum: float,
    trust_coefficient: float,
    eps: float,
    nesterov: bool,
) -> optax.GradientTransformation:
    # The masks are callables; fixing them here keeps inject_hyperparams from mistaking them
    # for schedules of the step count.
    return optax.lars(
        learning_rate,
        weight_decay=weight_decay,
        weight_decay_mask=decay_mask,
        trust_coefficient=trust_coefficient,
        eps=eps,
        trust_ratio_mask=decay_mask,
        momentum=momentum,
        nesterov=nesterov,
    )


def lars(
    learning_rate: float,
    weight_decay: float,
    momentum: float = 0.9,
    trust_coefficient: float = 0.001,
    eps: float = DEFAULT_EPS["lars"],
    nesterov: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """``optax.lars`` with weight decay and trust ratio only on kernels (MLPerf reference).

    Kernels get ``lr * trust * (g + wd * w)`` with ``trust = trust_coefficient * |w| /
    (|g + wd * w| + eps)``; BatchNorm parameters and biases get ``lr * g``; both go through
    momentum. ``learning_rate`` is the initial value of an injected hyperparameter (see the
    module docstring); ``weight_decay`` and ``momentum`` are injected too.
    """
    _check_initial_learning_rate(learning_rate)
    return optax.inject_hyperparams(_masked_lars, static_args=("nesterov",))(
        learning_rate=learning_rate,
        weight_decay=weight_decay,
        momentum=momentum,
        trust_coefficient=trust_coefficient,
        eps=eps,
        nesterov=nesterov,
    )


def _masked_sgd(
    learning_rate: float, momentum: float, nesterov: bool, weight_decay: float
) -> optax.GradientTransformation:
    # Decay added to the gradient before momentum, as an L2 term in the loss would be (flax
    # imagenet example: 0.5 * wd * |w|^2 over ndim > 1 parameters).
    return optax.chain(
        optax.add_decayed_weights(weight_decay, mask=decay_mask),
        optax.sgd(learning_rate, momentum=momentum, nesterov=nesterov),
    )


def sgd_momentum(
    learning_rate: float,
    momentum: float = 0.9,
    nesterov: bool = True,
    weight_decay: float = 1e-4,
) -> optax.GradientTransformationExtraArgs:
    """Momentum SGD with L2 weight decay on kernels only (the flax imagenet example's
    optimizer: Nesterov 0.9, wd 1e-4 on ``ndim > 1`` parameters). ``learning_rate`` is the
    initial value of an injected hyperparameter (see the module docstring)."""
    _check_initial_learning_rate(learning_rate)
    return optax.inject_hyperparams(_masked_sgd, static_args=("nesterov",))(
        learning_rate=learning_rate,
        momentum=momentum,
        nesterov=nesterov,
        weight_decay=weight_decay,
    )


def _masked_adamw(
    learning_rate: float, b1: float, b2: float, eps: float, weight_decay: float
) -> optax.GradientTransformation:
    return optax.adamw(
        learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=decay_mask
    )


def adamw(
    learning_rate: float,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = DEFAULT_EPS["adamw"],
    weight_decay: float = 1e-4,
) -> optax.GradientTransformationExtraArgs:
    """``optax.adamw`` with decoupled weight decay on ``ndim > 1`` parameters only (kernels
    and embeddings; not norms or biases). ``learning_rate`` is the initial value of an injected hyperparameter (see the module
    docstring)."""
    _check_initial_learning_rate(learning_rate)
    if eps <= 0:
        raise ValueError(
            f"adamw needs eps > 0 (it divides by sqrt(v) + eps), got {eps}; "
            f"leave it unset for the usual {DEFAULT_EPS['adamw']}"
        )
    return optax.inject_hyperparams(_masked_adamw)(
        learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay
    )


OPTIMIZERS: dict[str, Callable[..., optax.GradientTransformationExtraArgs]] = {
    "adamw": adamw,
    "lars": lars,
    "sgd": sgd_momentum,
}


def make_optimizer(
    name: str, learning_rate: float, *, clip_norm: float = 0.0, **kwargs: Any
) -> optax.GradientTransformationExtraArgs:
    """Build the optimizer registered as ``name`` (``"adamw"``, ``"lars"`` or ``"sgd"``); ``kwargs`` are
    that optimizer's keyword arguments. ``clip_norm > 0`` clips the gradients to that global
    norm first: the norm over the whole model, also where a pipeline updates it stage by
    stage (:func:`~jaxdist.training.global_norm.clip_by_global_norm`)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; expected one of {sorted(OPTIMIZERS)}")
    if clip_norm < 0:
        raise ValueError(f"clip_norm must be >= 0 (0: no clipping), got {clip_norm}")
    optimizer = OPTIMIZERS[name](learning_rate, **kwargs)
    if clip_norm:
        return optax.chain(global_norm.clip_by_global_norm(clip_norm), optimizer)
    return optimizer

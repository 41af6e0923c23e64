"""Cross-replica BatchNorm with a group size (MLPerf's "BN span").

Statistics can be taken over

* the whole data axis (``group_size=None``): flax's ``BatchNorm(axis_name=...)`` behaviour,
  what the flax ImageNet example does;
* groups of ``k`` consecutive devices along the data axes (``group_size=k``): MLPerf's BN span
  (e.g. 128 images = 2 devices of 64), which is both cheaper and, for very large batches,
  better than the whole axis;
* each device alone (``group_size=1``): Goyal et al.'s per-worker BN over 32 images.

Groups exchange their statistics inside the group only, so a device moves O(group) bytes
whatever the size of the data axis (gathering every replica's statistics would move
O(devices): for ResNet-50 on 256 chips 54 MB per micro-batch, where a group of 4 needs 0.4
MB):

* an all-reduce over each group (``lax.pmean`` with ``axis_index_groups``), which the train
  steps use (their ``shard_map`` runs with ``check_vma=False``). On a TPU this keeps the
  gradients' collective permutes free to run beside backward: the TPU compiler does not
  overlap a permute with another permute, so statistics sent by permutes at every norm of
  the backward pass would leave the gradients little of it to hide behind
  (docs/planning.md);
* under ``shard_map(check_vma=True)``, where jax has no grouped collectives, collective
  permutes whose pairs stay inside each group: recursive doubling (log2 k exchanges of the
  whole statistics) when ``k`` is a power of two, otherwise a ring of ``k - 1`` steps that
  gathers the group's rows and sums them in group order.

Either way every device of a group ends with the same mean up to rounding (a compiler may
fuse a device's own division by the count into the addition, as XLA:CPU does with a fused
multiply-add), and backward transposes each collective into one of the same size.

Running statistics are updated from the group's statistics, so with groups (or per-device BN)
they differ between devices; :class:`jaxdist.training.train_step.TrainStep` averages them over
the data axes after every step so that evaluation sees one consistent set. Averaging every step
equals averaging once before evaluation, because the running average is linear.

Variable names (``batch_stats/mean``, ``batch_stats/var``, ``params/scale``, ``params/bias``)
match ``flax.linen.BatchNorm`` so checkpoints carry over.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from jaxdist.comm.collectives import AxisName, axis_size
from jaxdist.comm.scopes import BATCHNORM_SCOPE

__all__ = ["CrossReplicaBatchNorm", "replica_mean"]


def replica_mean(tree: Any, axis_name: AxisName, group_size: int | None = None) -> Any:
    """Mean of ``tree`` over replicas along ``axis_name``, in groups of ``group_size``
    consecutive devices (``None``: all of them; ``1``: no averaging). Call inside shard_map."""
    with jax.named_scope(BATCHNORM_SCOPE):  # how jaxdist.aot names this traffic
        return _replica_mean(tree, axis_name, group_size)


def _replica_mean(tree: Any, axis_name: AxisName, group_size: int | None) -> Any:
    """:func:`replica_mean` without its scope (see the module docstring for the routes)."""
    p = axis_size(axis_name)
    if group_size is None or group_size == p:
        return lax.pmean(tree, axis_name)
    if group_size < 1 or p % group_size:
        raise ValueError(
            f"BatchNorm group_size must divide the {p} devices along {axis_name!r}, got {group_size}"
        )
    if group_size == 1:
        return tree
    groups = [list(range(start, start + group_size)) for start in range(0, p, group_size)]
    try:
        return lax.pmean(tree, axis_name, axis_index_groups=groups)
    except NotImplementedError:  # shard_map with check_vma=True: no grouped collectives
        pass
    group_sum = _doubling_sum if group_size & (group_size - 1) == 0 else _ring_sum
    return jax.tree.map(lambda leaf: group_sum(leaf, axis_name, p, group_size) / group_size, tree)


def _doubling_sum(x: jax.Array, axis_name: AxisName, p: int, k: int) -> jax.Array:
    """Sum over each group of ``k`` (a power of two) consecutive devices by recursive
    doubling: at step ``s`` device ``i`` adds what device ``i ^ 2**s`` holds, so the group
    is summed in log2(k) exchanges."""
    distance = 1
    while distance < k:
        pairs = [(i, i ^ distance) for i in range(p)]
        x = x + lax.ppermute(x, axis_name, pairs)
        distance *= 2
    return x


def _ring_sum(x: jax.Array, axis_name: AxisName, p: int, k: int) -> jax.Array:
    """Sum over each group of ``k`` consecutive devices: ``k - 1`` ring steps inside the
    group gather its rows, which every device then adds in the group's order."""
    to_next = [(i, (i // k) * k + (i % k + 1) % k) for i in range(p)]
    rows = [x]
    for _ in range(k - 1):
        rows.append(lax.ppermute(rows[-1], axis_name, to_next))
    # rows[s] came from the device s places before this one in its group.
    position = lax.axis_index(axis_name) % k
    from_first = jnp.take(jnp.stack(rows), (position - jnp.arange(k)) % k, axis=0)
    return from_first.sum(0)


class CrossReplicaBatchNorm(nn.Module):
    """BatchNorm over the last axis with statistics shared across replicas (see module doc).

    Attributes:
      use_running_average: normalise with the running statistics (evaluation).
      axis_name: data axis (or axes) to share statistics over; ``None`` for local only.
      group_size: devices per statistics group; ``None`` for the whole axis.
      momentum, epsilon: as in ``flax.linen.BatchNorm``.
      dtype: output dtype (statistics are always computed in float32).
    """

    use_running_average: bool | None = None
    axis_name: AxisName | None = None
    group_size: int | None = None
    momentum: float = 0.9
    epsilon: float = 1e-5
    dtype: Any = None
    param_dtype: Any = jnp.float32
    use_bias: bool = True
    use_scale: bool = True
    scale_init: Callable = nn.initializers.ones
    bias_init: Callable = nn.initializers.zeros

    @nn.compact
    def __call__(self, x: jax.Array, use_running_average: bool | None = None) -> jax.Array:
        use_running_average = nn.merge_param(
            "use_running_average", self.use_running_average, use_running_average
        )
        features = x.shape[-1]
        running_mean = self.variable("batch_stats", "mean", jnp.zeros, (features,), jnp.float32)
        running_var = self.variable("batch_stats", "var", jnp.ones, (features,), jnp.float32)

        if use_running_average:
            mean, var = running_mean.value, running_var.value
        else:
            x32 = x.astype(jnp.float32)
            reduce_axes = tuple(range(x.ndim - 1))
            # Stacked, as flax.linen.BatchNorm does: one [2, C] collective, and on CPU XLA then
            # leaves both sums to its fast reduction kernels instead of fusing the division by
            # the count into slower loop-emitted reductions (see docs/models.md).
            stats_2xC = jnp.stack([x32.mean(reduce_axes), jnp.square(x32).mean(reduce_axes)])
            # At init no mesh axis is bound; the shapes are all that matter then.
            if self.axis_name is not None and not self.is_initializing():
                stats_2xC = replica_mean(stats_2xC, self.axis_name, self.group_size)
            mean, mean_of_squares = stats_2xC[0], stats_2xC[1]
            var = jnp.maximum(mean_of_squares - jnp.square(mean), 0.0)
            if not self.is_initializing():
                m = self.momentum
                running_mean.value = m * running_mean.value + (1 - m) * mean
                running_var.value = m * running_var.value + (1 - m) * var

        # Fold the scale into the per-channel multiplier before touching the activations, as
        # flax.linen.BatchNorm does: ``(x - mean) * rsqrt(var + eps) * scale`` costs one more
        # multiply per element, and its gradient one more full reduction over the activations
        # per norm (for rsqrt and scale separately); ResNet-50 has 53 norms.
        multiplier = lax.rsqrt(var + self.epsilon)
        if self.use_scale:
            multiplier = multiplier * self.param(
                "scale", self.scale_init, (features,), self.param_dtype
            )
        y = (x.astype(jnp.float32) - mean) * multiplier
        if self.use_bias:
            y = y + self.param("bias", self.bias_init, (features,), self.param_dtype)
        return y.astype(self.dtype or x.dtype)

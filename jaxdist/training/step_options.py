"""A train step's options, one small record per concern: how gradients travel
(:class:`Communication`), where the state lives (:class:`StateSharding`) and how float16
steps are kept finite (:class:`Precision`).

Both steps take them, :class:`~jaxdist.training.train_step.TrainStep` and
:class:`~jaxdist.pipeline.step.PipelineStep`::

    TrainStep(loss_fn, optax.adamw(1e-3), mesh,
              communication=Communication("ring", bucket_bytes=4 << 20),
              sharding=StateSharding("fsdp", prefetch=2),
              precision=Precision(skip_nonfinite=True))

A step refuses, in one line when it is built, options it cannot honour on its mesh
(:mod:`jaxdist.training.step_checks`); a pipeline step refuses more of them than a
data-parallel one.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import Any

from jaxdist.comm import buckets as bucketing
from jaxdist.comm import collectives, hybrid
from jaxdist.training import sharding as sharding_lib
from jaxdist.training.loss_scale import DynamicLossScale

__all__ = ["NO_ALLREDUCE", "Communication", "Precision", "StateSharding"]

# Measurement only: skip the gradient allreduce, so each device trains on its own shard. The
# train-step benchmark times this to split a step into compute and communication.
NO_ALLREDUCE = "none"


@dataclasses.dataclass(frozen=True)
class Communication:
    """How a step's gradients are averaged over the data axes.

    Attributes:
      allreduce: a name from :data:`jaxdist.comm.collectives.ALGORITHMS`, ``"auto"`` (a
        schedule per bucket and factors or not per dense layer, by the cost model on
        ``links``), or :data:`NO_ALLREDUCE` (for measurements only).
      options: passed to the schedule (``transfer_dtype=jnp.bfloat16`` sends gradients in
        bf16, accumulating in float32; ``unroll_limit``; ...).
      bucket_bytes: gradient fusion threshold; ``None`` or 0: one bucket for all gradients.
      sfb_layers: dense layers (flax module paths such as ``"head"``, or ``"all"``) whose
        gradient travels as sufficient factors (:mod:`jaxdist.training.dense_factors`). With
        ``"auto"`` these are the candidates (default: every dense layer; ``()``: none), each
        sent as factors only where the cost model says that is cheaper.
      links: the links the cost model prices on: ``"LATENCY:BANDWIDTH"``, a
        ``jaxdist bench allreduce --json`` file of this mesh, or a
        :class:`~jaxdist.comm.cost_model.Link`/``Network`` (see
        :func:`jaxdist.comm.hybrid.resolve_links`). Needed by ``"auto"`` (default: the link
        ``jaxdist cluster`` emulates); otherwise it only adds predictions to a step's plan.
      wait_free: run each gradient bucket's schedule beside the rest of the backward pass,
        one message step per matrix product, in the compiled program's own order
        (:mod:`jaxdist.training.wait_free`); the same arithmetic. With accumulation, beside
        the last micro-batch's backward. Needs a permute schedule, and no sufficient factors
        or sharded state.
    """

    allreduce: str = "native"
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    bucket_bytes: int | None = bucketing.DEFAULT_BUCKET_BYTES
    sfb_layers: str | tuple[str, ...] | list[str] | None = None
    links: Any = None
    wait_free: bool = False

    def __post_init__(self) -> None:
        # Read-only, as the record is: one default instance serves every step.
        object.__setattr__(self, "options", types.MappingProxyType(dict(self.options or {})))

    @property
    def named(self) -> bool:
        """Whether one named schedule averages every gradient (not ``auto``, not none)."""
        return self.allreduce not in (NO_ALLREDUCE, hybrid.AUTO)


@dataclasses.dataclass(frozen=True)
class StateSharding:
    """Where a step's parameters and optimizer state live (:mod:`jaxdist.training.sharding`).

    Attributes:
      kind: ``"replicated"`` (default), ``"zero1"`` (optimizer state and update sharded) or
        ``"fsdp"`` (parameters too). Every optax transformation is exact under each. The
        reduce-scatters and all-gathers run the communication's schedule's two halves
        (:data:`jaxdist.comm.collectives.SHARDED_ALGORITHMS`).
      axes: the data axes the state is sharded over. Default: the mesh's ``fsdp`` axis
        where it is one data axis of several, else all of them
        (:func:`~jaxdist.training.sharding.default_shard_axes`), as a recipe places it.
        Fewer than the data axes is HSDP: sharded inside each group, the groups averaging
        their gradients as data parallel replicas (with the ring, or XLA's all-reduce under
        ``native``); name every data axis to shard over all of them.
      gather: the schedule of the parameter all-gathers, when it is not the gradients'
        (``"native"`` beside a permute schedule: XLA's all-gather for the parameters, the
        schedule's reduce-scatter for the gradients). Default: the gradients' schedule.
      keep_gathered: FSDP keeps each unit's gathered parameters from forward for backward
        instead of gathering them again (more memory, half the parameter traffic).
      prefetch: how many layers ahead of its use FSDP may start a layer's gather, in forward
        and in backward (default 1: beside the layer before). More gives a gather more
        compute to hide behind and holds that many more layers gathered at once.
      scatter_behind: in scanned layers, FSDP reduce-scatters each layer's gradient during
        the backward of the layer before it instead of at the end of its own, so that it
        has compute to hide behind; holds one layer's whole gradient more. Unrolled layers
        need no such choice: the compiler schedules across them.
      min_shard_elements: parameters with fewer elements stay whole on every device.
      dims: a tree like the parameters: the dimension of each that is split over ``axes``,
        or None to keep it whole, as logical axis rules place them
        (:func:`jaxdist.training.logical_axes.split_dims` with ``fsdp``). Default (None):
        each parameter's first dimension the shard count divides.
    """

    kind: str = "replicated"
    axes: str | tuple[str, ...] | None = None
    gather: str | None = None
    keep_gathered: bool = False
    prefetch: int = 1
    scatter_behind: bool = False
    min_shard_elements: int = sharding_lib.DEFAULT_MIN_SHARD_ELEMENTS
    dims: Any = None

    @property
    def sharded(self) -> bool:
        """Whether any state is split (ZeRO-1 or FSDP)."""
        return self.kind != "replicated"

    def gather_schedule(self, communication: Communication) -> str:
        """The schedule the parameters are all-gathered with."""
        return communication.allreduce if self.gather is None else self.gather

    def gather_options(self, communication: Communication) -> dict[str, Any]:
        """The options of the parameters' all-gathers: those of the communication's that the
        gather schedule takes, never ``transfer_dtype``, which is for gradients (a rounded
        gather would cut every device's float32 master copy)."""
        taken = (
            *collectives.COMMON_OPTIONS,
            *collectives.get(self.gather_schedule(communication)).options,
        )
        return {k: v for k, v in communication.options.items() if k in taken}


@dataclasses.dataclass(frozen=True)
class Precision:
    """How a step keeps reduced-precision training finite.

    Attributes:
      loss_scale: a :class:`~jaxdist.training.loss_scale.DynamicLossScale` for float16
        training, or ``None``.
      skip_nonfinite: a step whose loss, gradients or updated parameters hold inf/NaN leaves
        the state as it was (but for the step count), as loss scaling does, and reports
        ``skipped`` in its metrics; without it such a step is applied and the trainer stops
        at it.
    """

    loss_scale: DynamicLossScale | None = None
    skip_nonfinite: bool = False

    @property
    def checks_finite(self) -> bool:
        """Whether a step tests its gradients for inf/NaN."""
        return self.loss_scale is not None or self.skip_nonfinite

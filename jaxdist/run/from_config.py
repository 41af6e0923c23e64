"""A recipe's config read in one pass into what the run is built from: the mesh it asks for,
its batch stages, the learning-rate schedule, the optimizer, and the step options every step
takes (:func:`read_recipe`). Each problem raises ``ValueError`` naming the config field.

A field set away from its default that does nothing with the rest of the config (``lr.power``
with a cosine schedule, ``optimizer.trust_coefficient`` with SGD, ``unroll_limit`` with XLA's
own all-reduce) is refused too: the run would silently ignore it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax

from jaxdist.run.config import (
    OPTIMIZER_FIELDS,
    base_config,
    batch_stages,
    refuse_unread,
)
from jaxdist.tasks import Task
from jaxdist.training import optim
from jaxdist.training.step_options import Communication, Precision, StateSharding

__all__ = [
    "RecipeParts",
    "StepParts",
    "build_optimizer",
    "optimizer_arguments",
    "read_recipe",
    "step_options",
]


@dataclasses.dataclass(frozen=True)
class RecipeParts:
    """What :func:`read_recipe` read from a recipe's config, checked.

    Attributes:
      mesh: the mesh preset, TOML path or inline spec (``""``: every device, one axis).
      stages: the pipeline stages (0: none).
      batch_stages: ``(start_epoch, global_batch)`` of each batch-size stage.
      lr_fn: ``epoch -> learning rate`` (jitted: a new value never recompiles).
      optimizer: the recipe's optimizer, its learning rate a hyperparameter set each step.
      communication, sharding, precision: the step options both kinds of step take.
    """

    mesh: str
    stages: int
    batch_stages: tuple[tuple[float, int], ...]
    lr_fn: Callable[[float], jax.Array]
    optimizer: optax.GradientTransformation
    communication: Communication
    sharding: StateSharding
    precision: Precision


def read_recipe(config: ml_collections.ConfigDict) -> RecipeParts:
    """Every field of ``config`` that is not a step kind's or the task's, read and checked
    once: the values first, then the fields the recipe's switches leave unread, then the
    schedule and the optimizer built from them."""
    stages = config.pipeline.stages if "pipeline" in config else 0
    if stages < 0:
        raise ValueError(f"pipeline.stages must be >= 0 (0: no pipeline), got {stages}")
    communication, sharding, precision = step_options(config)
    opt, lr = config.optimizer, config.lr
    _check_optimizer(opt)
    arguments = optimizer_arguments(opt)
    refuse_unread(config)
    batches = batch_stages(config)
    lr_fn = jax.jit(
        optim.lr_schedule(
            lr.kind,
            lr.peak,
            lr.warmup_epochs,
            config.num_epochs,
            end_lr=lr.end_lr,
            power=lr.power,
            init_lr=lr.init_lr,
            step_epochs=tuple(lr.step_epochs),
            step_factor=lr.step_factor,
        )
    )
    # The learning rate is set each step; the one it starts with only fills the state.
    initial_lr = float(lr_fn(0.0))
    optimizer = optim.make_optimizer(opt.name, initial_lr, clip_norm=opt.clip_norm, **arguments)
    return RecipeParts(
        config.mesh, stages, batches, lr_fn, optimizer, communication, sharding, precision
    )


def _check_optimizer(opt: ml_collections.ConfigDict) -> None:
    if opt.name not in OPTIMIZER_FIELDS:
        raise ValueError(
            f"optimizer.name must be one of {sorted(OPTIMIZER_FIELDS)}, got {opt.name!r}"
        )
    if opt.clip_norm < 0:
        raise ValueError(f"optimizer.clip_norm must be >= 0 (0: no clipping), got {opt.clip_norm}")


def build_optimizer(
    opt: ml_collections.ConfigDict, initial_lr: float
) -> optax.GradientTransformation:
    """``config.optimizer``'s optimizer alone (as :func:`read_recipe` builds it), its
    learning rate a hyperparameter set each step, after global-norm clipping when
    ``clip_norm`` is set."""
    _check_optimizer(opt)
    refuse_unread(ml_collections.ConfigDict({"optimizer": opt}))
    return optim.make_optimizer(
        opt.name, initial_lr, clip_norm=opt.clip_norm, **optimizer_arguments(opt)
    )


def optimizer_arguments(opt: ml_collections.ConfigDict) -> dict[str, Any]:
    """The hyperparameters ``config.optimizer`` gives its optimizer: the fields it reads, an
    unset ``eps`` (``None``) as that optimizer's own (:data:`optim.DEFAULT_EPS`)."""
    arguments = {k: opt[k] for k in OPTIMIZER_FIELDS[opt.name]}
    if "eps" in arguments and arguments["eps"] is None:
        arguments["eps"] = optim.DEFAULT_EPS[opt.name]
    return arguments


def sfb_layers_setting(text: str) -> str | tuple[str, ...] | None:
    """``config.sfb_layers`` as :class:`~jaxdist.training.train_step.TrainStep` takes it:
    ``""`` -> None (none; every dense layer a candidate for ``auto``), ``"none"`` -> ``()``,
    ``"all"``, or a tuple of comma-separated module paths."""
    if not isinstance(text, str):
        raise ValueError(
            f"sfb_layers must be a string ('', 'all', 'none' or comma-separated "
            f"module paths), got {text!r}"
        )
    text = text.strip()
    if text in ("", "all"):
        return text or None
    if text == "none":
        return ()
    return tuple(name.strip() for name in text.split(",") if name.strip())


@dataclasses.dataclass(frozen=True)
class StepParts:
    """What a recipe's step is built from.

    Attributes:
      task: what is trained (:class:`~jaxdist.tasks.Task`): its loss, or its pipeline stages.
      optimizer: the recipe's optimizer.
      communication, sharding, precision: the recipe's step options, as both steps take
        them (:func:`step_options`).
    """

    task: Task
    optimizer: optax.GradientTransformation
    communication: Communication
    sharding: StateSharding
    precision: Precision


_TRANSFER_DTYPES = ("bfloat16", "float16", "float32")


def _transfer_dtype(text: str) -> Any:
    """The dtype the recipe's ``transfer_dtype`` names; a ValueError names the choices."""
    if text not in _TRANSFER_DTYPES:
        raise ValueError(
            f"transfer_dtype must be one of {', '.join(_TRANSFER_DTYPES)} (or empty: each "
            f"gradient's own dtype), got {text!r}"
        )
    return jnp.dtype(text)


def step_options(
    config: ml_collections.ConfigDict,
) -> tuple[Communication, StateSharding, Precision]:
    """The recipe's fields every step takes: how gradients are averaged and priced, where
    the state lives, and whether non-finite steps are skipped."""
    if config.allreduce == "native" and config.unroll_limit != base_config().unroll_limit:
        raise ValueError(
            f"unroll_limit={config.unroll_limit} shapes the ppermute schedules, "
            "and allreduce='native' is XLA's own all-reduce: choose a schedule "
            "(ring, torus2d, ...) or leave unroll_limit out"
        )
    options: dict[str, Any] = {"unroll_limit": config.unroll_limit}
    if config.transfer_dtype:
        options["transfer_dtype"] = _transfer_dtype(config.transfer_dtype)
    communication = Communication(
        config.allreduce,
        options=options,
        bucket_bytes=config.bucket_bytes,
        sfb_layers=sfb_layers_setting(config.sfb_layers),
        links=config.links or None,
        wait_free=config.wait_free,
    )
    sharding = StateSharding(
        config.sharding,
        gather=config.gather or None,
        prefetch=config.prefetch,
        scatter_behind=config.scatter_behind,
    )
    return communication, sharding, Precision(skip_nonfinite=config.skip_nonfinite_steps > 0)

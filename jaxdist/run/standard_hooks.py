"""The trainer's own hooks (:mod:`jaxdist.run.hooks`), in the order the loop calls them."""

from __future__ import annotations

from typing import Any

import jax

from jaxdist.run import rerun
from jaxdist.run.checkpoint import Checkpointer
from jaxdist.run.hooks import Hook
from jaxdist.run.log import RunLog
from jaxdist.run.mlperf import MlperfLog
from jaxdist.run.nonfinite import NonFiniteGuard
from jaxdist.run.preemption import PreemptionGuard
from jaxdist.run.profile import StepProfiler
from jaxdist.run.tensorboard import TensorBoard
from jaxdist.run.watchdog import Watchdog
from jaxdist.run.workdir_lock import WorkdirLock

__all__ = ["STANDARD_HOOKS", "check_hook_settings", "standard_hooks"]

# The trainer's own hooks, in the order the loop calls them: the lock first and the rerun
# check second, so that nothing is read or written before both agree; the event log last, so
# that it records what the others decided.
STANDARD_HOOKS: tuple[type[Hook], ...] = (
    WorkdirLock,
    rerun.RerunCheck,
    Watchdog,
    PreemptionGuard,
    StepProfiler,
    NonFiniteGuard,
    TensorBoard,
    MlperfLog,
)


def check_hook_settings(
    config: Any, total_steps: int, profile_steps: tuple[int, int] | None, hooks=()
) -> None:
    """Each standard hook's, and each of ``hooks``', check of ``config``'s settings
    (:meth:`~jaxdist.run.hooks.Hook.check_settings`), before the run is built."""
    for kind in (*STANDARD_HOOKS, *(type(hook) for hook in hooks)):
        kind.check_settings(config, total_steps, profile_steps)


def standard_hooks(
    parts: Any,
    log: RunLog,
    ckpt: Checkpointer,
    lock: WorkdirLock,
    *,
    allow_config_change: bool = False,
) -> list[Hook]:
    """The hooks for one run of ``parts`` (a :class:`~jaxdist.run.build.RunParts`), one of
    each of :data:`STANDARD_HOOKS`, in its order: ``lock`` is the workdir's lock, which the
    caller holds before ``ckpt`` opens the checkpoints, and the others are new. The hooks read
    their settings from ``parts.hooks``; the rerun check and TensorBoard also record the
    config. ``allow_config_change`` lets the rerun check accept a changed config."""
    cfg, workdir, settings = parts.config, parts.workdir, parts.hooks
    writer = jax.process_index() == 0  # only process 0 writes logs
    return [
        lock,
        rerun.RerunCheck(
            workdir,
            cfg,
            allow_change=allow_config_change,
            devices=parts.resolved_devices,
            progress=log.progress,
            write=writer,
        ),
        Watchdog(settings.watchdog_s, workdir),
        PreemptionGuard(ckpt.manager),
        StepProfiler(parts.profile_steps, workdir),
        NonFiniteGuard(settings.nonfinite_steps, kept=ckpt.kept),
        TensorBoard(
            workdir,
            settings.tensorboard,
            enabled=writer,
            config=rerun.flatten(cfg),
            headline=parts.task.headline,
        ),
        MlperfLog(parts, enabled=writer),
    ]

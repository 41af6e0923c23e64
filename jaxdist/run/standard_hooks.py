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

__all__ = ["standard_hooks"]


def standard_hooks(trainer: Any, log: RunLog, ckpt: Checkpointer) -> list[Hook]:
    """New hooks for one run of ``trainer`` (:class:`~jaxdist.run.trainer.Trainer`): the lock
    first and the rerun check second, so that nothing is read or written before both agree;
    the event log last, so that it records what the others decided."""
    cfg, workdir = trainer.config, trainer.workdir
    writer = jax.process_index() == 0  # only process 0 writes logs
    return [
        WorkdirLock(workdir),
        rerun.RerunCheck(
            workdir,
            cfg,
            allow_change=trainer.allow_config_change,
            devices=trainer.resolved_devices,
            progress=log.progress,
            write=writer,
        ),
        Watchdog(cfg.watchdog_s, workdir),
        PreemptionGuard(ckpt.manager),
        StepProfiler(trainer.profile_steps, workdir),
        NonFiniteGuard(cfg.skip_nonfinite_steps, kept=ckpt.kept),
        TensorBoard(
            workdir,
            cfg.tensorboard,
            enabled=writer,
            config=rerun.flatten(cfg),
            headline=trainer.task.headline,
        ),
        MlperfLog(trainer, workdir, enabled=writer, init_ms=trainer.init_ms),
    ]

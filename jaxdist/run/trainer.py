"""The training loop: a recipe's config in, a trained state, logs and checkpoints out.

::

    config = jaxdist.run.config.load_recipe("recipes/mnist_small_batch.py")
    summary = Trainer(config, workdir="runs/mnist").run()

Each step:

1. the batch-size schedule names the step's stage; at a stage boundary the data iterator is
   rebuilt at the stream position reached (nothing dropped or repeated) and the stage's
   train step (one per accumulation setting: a data-parallel
   :class:`~jaxdist.training.train_step.TrainStep`, or a
   :class:`~jaxdist.pipeline.step.PipelineStep` when the recipe has pipeline stages) compiles
   once for the new batch shape;
2. the learning rate is the epoch schedule at the *fractional epoch* (samples seen / dataset
   size), written into the optimizer state before the call, so it follows the samples and not
   the step count, and a changing value never recompiles;
3. the step runs with an RNG folded from the seed and the step number, so a resumed run draws
   the same numbers as an uninterrupted one.

What is trained is the recipe's task (:mod:`jaxdist.tasks`): its variables, loss, evaluation
and data; everything here is the same for every task.

Around the steps: periodic evaluation (the task's metrics on the held-out split), progress lines,
``metrics.jsonl``, the MLPerf event log (``events.log``, :mod:`jaxdist.run.mlperf`: one
``run_start`` ... ``run_stop`` across resumes) and checkpoints (:mod:`jaxdist.run.checkpoint`)
every N steps, at the end and on SIGTERM. Only process 0 writes logs; every process takes
part in checkpoints.

What stops a run early keeps what it did: the workdir is locked against a second run
(:mod:`~jaxdist.run.workdir_lock`); a non-finite loss stops it before anything non-finite is saved
(:mod:`~jaxdist.run.nonfinite`); an unreadable data file stops it with a checkpoint of the
steps before; a process stuck on one activity is reported and ended
(:mod:`~jaxdist.run.watchdog`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from jax.sharding import Mesh

from jaxdist.data import DatasetError
from jaxdist.run import rerun, steps
from jaxdist.run.agreement import check_same_everywhere, run_facts
from jaxdist.run.checkpoint import Checkpointer, newest_config_record
from jaxdist.run.config import batch_stages, config_problems
from jaxdist.run.from_config import (
    StepParts,
    build_lr_schedule,
    build_mesh,
    build_optimizer,
    step_options,
)
from jaxdist.run.log import RunLog, WorkdirError, describe_error, last_eval
from jaxdist.run.loop import Loop, open_iterator, report
from jaxdist.run.mlperf import epoch_events, log_run_start, log_run_stop, now_ms
from jaxdist.run.nonfinite import NonFiniteGuard
from jaxdist.run.preemption import PreemptionGuard
from jaxdist.run.profile import StepProfiler
from jaxdist.run.tensorboard import check_mode
from jaxdist.run.watchdog import Watchdog
from jaxdist.run.workdir_lock import WorkdirLock
from jaxdist.tasks import Replicas, Task
from jaxdist.tasks.image_classification import ImageClassification
from jaxdist.training.batch_schedule import BatchSchedule
from jaxdist.training.batches import data_axes_of
from jaxdist.training.eval_step import EvalStep
from jaxdist.training.protocol import Step
from jaxdist.training.train_step import TrainState

__all__ = ["TaskFactory", "Trainer"]

# A recipe's ``get_task``: the task of a config, on the replicas the mesh gives it.
TaskFactory = Callable[[ml_collections.ConfigDict, Replicas], Task]


class Trainer:
    """Train ``config`` (a recipe's ConfigDict, see :func:`jaxdist.run.config.base_config`),
    writing logs and checkpoints under ``workdir``; :meth:`run` resumes from the newest
    checkpoint there, if any. ``task`` builds what is trained from the config (a recipe's
    ``get_task``, see :mod:`jaxdist.tasks`; default: image classification); ``recipe`` is its
    file, which every process must have alike (:mod:`jaxdist.run.agreement`). ``mesh``
    replaces the recipe's (a mesh of compile-only devices, :mod:`jaxdist.aot`, lets its steps
    be compiled but not run). ``profile_steps=(first,
    last)`` traces those steps into ``WORKDIR/profile`` (:mod:`jaxdist.run.profile`)."""

    def __init__(
        self,
        config: ml_collections.ConfigDict,
        workdir: str | Path,
        *,
        allow_config_change: bool = False,
        task: TaskFactory | None = None,
        recipe: str | Path | None = None,
        mesh: Mesh | None = None,
        profile_steps: tuple[int, int] | None = None,
    ) -> None:
        self._init_ms = now_ms()  # MLPerf's init_start: building the run is initialisation
        self.config = config
        self.workdir = Path(workdir)
        self.allow_config_change = allow_config_change
        self.task_factory = task or ImageClassification
        self.recipe = recipe
        self.profiler = StepProfiler(profile_steps, self.workdir)
        with config_problems():
            self._build(config, mesh)
        self.profiler.check(1, self.total_steps)

    def _build(self, config: ml_collections.ConfigDict, mesh: Mesh | None) -> None:
        """Everything the config describes: mesh, data, batch plan, model, loss, optimizer and
        the train step of every stage, so that a bad value fails here, before any training."""
        stages = config.pipeline.stages if "pipeline" in config else 0
        self.mesh = build_mesh(config.mesh, stages) if mesh is None else mesh
        try:
            recorded = rerun.recorded_devices(self.workdir)  # e.g. a pipeline's "auto" cut
        except OSError as err:
            raise WorkdirError.from_os_error(err, self.workdir) from err
        self.step_kind = steps.for_recipe(config, self.mesh, recorded)  # the one choice of step
        names = self.step_kind.data_axes
        self.data_axes = data_axes_of(self.mesh, names)  # one name, or a tuple of several
        self.num_replicas = math.prod(self.mesh.shape[a] for a in names)
        self.task = self.task_factory(config, Replicas(self.data_axes, self.num_replicas))
        self.data = self.task.data
        self.schedule = BatchSchedule(
            batch_stages(config), dataset_size=self.data.num_train_examples
        )
        self.plans = self.schedule.device_plans(self.num_replicas, config.max_per_device_batch)
        self.step_kind.check_batches([b for _, b in batch_stages(config)], self.num_replicas)
        self.total_steps = self.schedule.steps_for_epochs(config.num_epochs)
        if config.max_steps:
            self.total_steps = min(self.total_steps, config.max_steps)
        self.nonfinite = NonFiniteGuard(config.skip_nonfinite_steps)
        check_mode(config.tensorboard)
        self.watchdog = Watchdog(config.watchdog_s, self.workdir)
        if config.eval_batch_size % self.num_replicas:
            raise ValueError(
                f"eval_batch_size={config.eval_batch_size} must be a multiple of the "
                f"{self.num_replicas} data-parallel devices"
            )

        self.lr_fn = jax.jit(build_lr_schedule(config))
        self._parts = StepParts(
            task=self.task,
            optimizer=build_optimizer(config.optimizer, float(self.lr_fn(0.0))),
            options=step_options(config),
        )
        self.eval_step = EvalStep(self.task.eval_sums, self.mesh, data_axes=self.data_axes)
        self._train_steps: dict[int, Step] = {}
        self._compiled_steps: list[Step] = []  # steps that ran once (compiling is not watched)
        # Steps that choose routes (auto) or send factors print their plan after a first step.
        self._shows_plans = config.allreduce == "auto" or bool(self._parts.options["sfb_layers"])
        for stage in range(len(self.plans)):
            self.train_step_for(stage)

    # ------------------------------------------------------------------ pieces

    def train_step_for(self, stage: int) -> Step:
        """The train step of a batch-schedule stage: one per accumulation setting; a new
        batch shape compiles once more."""
        accumulation = self.plans[stage].accumulation_steps
        if accumulation not in self._train_steps:
            self._train_steps[accumulation] = self.step_kind.build(self._parts, accumulation)
        return self._train_steps[accumulation]

    def initial_state(self) -> Any:
        """Parameters and BatchNorm statistics from the seed, placed on the mesh."""
        return self.train_step_for(0).init(*self._variables(abstract=False))

    def abstract_state(self) -> Any:
        """What :meth:`initial_state` returns, as shapes with their shardings: the target a
        checkpoint is read into. Nothing is initialised or placed, so a resumed run does not
        pay for the parameters the checkpoint replaces."""
        return self.train_step_for(0).abstract_init(*self._variables(abstract=True))

    def _variables(self, abstract: bool) -> tuple[Any, Any]:
        key = jax.random.key(self.config.seed)
        init = self.task.init_variables
        return jax.eval_shape(init, key) if abstract else init(key)

    def evaluate(self, state: Any) -> dict[str, float]:
        """The task's metrics over the whole held-out split."""
        step = self.train_step_for(0)
        params, model_state = step.whole_variables(state)
        whole = TrainState(state.step, params, model_state, opt_state=None)
        totals = None
        with self.data.eval_iterator(self.config.eval_batch_size) as batches:
            for batch in batches:
                sums = self.eval_step(whole, step.shard_batch(batch))
                totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
        totals = {k: float(v) for k, v in jax.device_get(totals).items()}
        return self.task.eval_metrics(totals)

    # ------------------------------------------------------------------ the loop

    def run(self, on_step: Callable[[int, TrainState], None] | None = None) -> dict[str, Any]:
        """Train to ``num_epochs`` (or ``max_steps``), resuming if a checkpoint exists.

        ``on_step(step, state)`` is called after every step (steps counted from 1).
        Returns a summary: final step and epoch, last eval, whether it was preempted, and
        ``already_finished`` when the workdir held a finished run (then nothing is trained or
        written, and the eval is the one recorded in its ``metrics.jsonl``).
        """
        check_same_everywhere(run_facts(self.config, self.mesh, self.recipe))
        if self.workdir.exists() and not self.workdir.is_dir():
            raise WorkdirError(f"the workdir {self.workdir} is a file, not a folder: give "
                               "another --workdir")  # fmt: skip
        try:
            with WorkdirLock(self.workdir), self.watchdog:
                return self._run(on_step)
        except OSError as err:  # a save's own failures are CheckpointWriteError already
            raise WorkdirError.from_os_error(err, self.workdir) from err

    def _run(self, on_step: Callable[[int, TrainState], None] | None) -> dict[str, Any]:
        cfg = self.config
        writer = jax.process_index() == 0
        # Compared now, before anything is read or written; recorded once the checkpoint is read.
        trained_with = newest_config_record(self.workdir / "checkpoints")
        changes = self._check_config(write=False, trained_with=trained_with)
        log = RunLog(self.workdir, enabled=writer, tensorboard=cfg.tensorboard)
        ckpt = Checkpointer(
            self.workdir / "checkpoints",
            every_steps=cfg.checkpoint.every_steps,
            keep=cfg.checkpoint.keep,
            async_save=cfg.checkpoint.async_save,
        )
        loop, failure = None, None
        try:
            loop = self._resume(ckpt, log, changes)
            if loop.step >= self.total_steps:
                return self._already_finished(loop, log)
            with PreemptionGuard(ckpt.manager) as guard:
                while loop.step < self.total_steps and not loop.preempted:
                    self._train_one_step(loop, log, ckpt)
                    self._report_progress(loop, log, ckpt)
                    self._evaluate_when_due(loop, log)
                    self._save(loop, ckpt)
                    if on_step is not None:
                        on_step(loop.step, loop.state)
                    loop.preempted = guard.preempted(loop.step)
                    loop.stopped_by = guard.signal_name if loop.preempted else ""
            self._finish(loop, ckpt, log)
        except BaseException as err:  # KeyboardInterrupt too: the event log says why it stopped
            failure = describe_error(err)
            raise
        finally:
            self.watchdog.pause()
            self.profiler.stop()
            ckpt.close()
            if loop is not None and loop.iterator is not None:
                loop.iterator.close()
            log.close(aborted_by=failure)
        self.state = loop.state
        return {"step": loop.step, "epoch": loop.epoch, "preempted": loop.preempted,
                "stopped_by": loop.stopped_by, **loop.last_eval}  # fmt: skip

    def _resume(self, ckpt: Checkpointer, log: RunLog, changes: list) -> Loop:
        """The loop's state: from the newest checkpoint, or fresh from the seed; the event log
        records the start and any accepted config change."""
        step, data_state, trained_with = 0, None, None
        if ckpt.steps():
            step, state, data_state, meta = ckpt.restore(self.abstract_state())
            trained_with = meta.get("config")  # absent from checkpoints of older versions
        else:
            state = self.initial_state()
        note = trained_with and rerun.record_note(self.workdir, trained_with, step)
        self._check_config(write=jax.process_index() == 0, trained_with=trained_with)
        if note:
            log.progress(note, final=True)
        self.profiler.check(step + 1, self.total_steps)
        if 0 < step < self.total_steps:
            log.progress(f"resumed from step {step} (epoch {meta['epoch']:.3f})", final=True)
        base_rng = jax.random.PRNGKey(self.config.seed)
        loop = Loop(state=state, step=step, base_rng=base_rng, data_state=data_state)
        loop.epoch = self.schedule.epoch_at(step)
        if step < self.total_steps:
            log_run_start(log, self, step, changes, self._init_ms)
            log.hyperparameters(rerun.flatten(self.config))
            for key, old, new in changes:
                log.progress(f"config changed: {key} {old!r} -> {new!r}", final=True)
        return loop

    def _check_config(self, write: bool, trained_with: dict | None = None) -> list:
        """The accepted differences from the config the workdir's checkpoints were trained
        with (``trained_with``), else from its recorded ``config.json``."""
        return rerun.check_rerun(self.workdir, self.config, allow_change=self.allow_config_change,
                                 write=write, devices=self._devices(),
                                 trained_with=trained_with)  # fmt: skip

    def _devices(self) -> dict[str, Any]:
        """What the run resolved on this machine: the mesh, and a pipeline's "auto" cut."""
        mesh = ",".join(f"{axis}={size}" for axis, size in self.mesh.shape.items())
        return {"mesh": mesh, **self.step_kind.resolved}

    def _already_finished(self, loop: Loop, log: RunLog) -> dict[str, Any]:
        """A rerun of a finished run: say so, train nothing, append nothing."""
        log.progress(
            f"already finished: step {loop.step} of {self.total_steps} (epoch {loop.epoch:.2f}); "
            "nothing to train (raise num_epochs or max_steps to go on)",
            final=True,
        )
        self.state = loop.state
        return {"step": loop.step, "epoch": loop.epoch, "preempted": False,
                "already_finished": True, **last_eval(self.workdir)}  # fmt: skip

    def _train_one_step(self, loop: Loop, log: RunLog, ckpt: Checkpointer) -> None:
        """One step: a new stage's iterator and step if the step starts one, the epoch's LR,
        the step's RNG."""
        step = loop.step
        epoch = self.schedule.epoch_at(step)
        epoch_events(log, self.schedule, step, self.total_steps)
        self.watchdog.watch(step + 1, "reading the input batch of")
        try:
            if self.schedule.stage_index_at(step) != loop.stage:
                loop.stage = self.schedule.stage_index_at(step)
                loop.iterator = open_iterator(self.data, self.schedule, step, loop)
                loop.data_state = None
            batch = next(loop.iterator)
        except DatasetError as err:
            raise self._stopped_by_data(err, loop, ckpt) from err
        train_step = self.train_step_for(loop.stage)
        batch = train_step.shard_batch(batch)
        loop.lr = float(self.lr_fn(epoch))
        loop.state = train_step.set_learning_rate(loop.state, loop.lr)
        rng = jax.random.fold_in(loop.base_rng, step)
        compiled = train_step in self._compiled_steps
        if compiled:
            self.watchdog.watch(step + 1, "running")
        else:  # the first call compiles: its time grows with the model, not with a hang
            self.watchdog.pause()
        with self.profiler.step(step + 1, lambda: loop.state):
            loop.state, metrics = train_step(loop.state, batch, rng)
        if not compiled:
            self._compiled_steps.append(train_step)
            self._show_gradient_plan(train_step, log)
        loop.step += 1
        loop.batch_size = self.schedule.batch_size_at(step)
        loop.window_samples += loop.batch_size
        loop.window_steps += 1
        loop.pending.append(metrics)
        loop.epoch = self.schedule.epoch_at(loop.step)

    def _show_gradient_plan(self, train_step: Step, log: RunLog) -> None:
        """After a train step's first call, when it chooses routes (``auto``) or sends factors:
        the plan, as ``TrainStep.plan().table()`` prints it (a pipeline step refuses both)."""
        if not self._shows_plans:
            return
        log.progress(f"gradient plan, {train_step.accumulation_steps} micro-batch(es) per step:",
                     final=True)  # fmt: skip
        for line in train_step.plan().table().splitlines():
            log.progress(line, final=True)

    def _report_progress(self, loop: Loop, log: RunLog, ckpt: Checkpointer) -> None:
        """Every ``log_every_steps``: :func:`~jaxdist.run.loop.report`; a non-finite loss stops
        the run here (after its record is written)."""
        if loop.step % self.config.log_every_steps == 0 or loop.step == self.total_steps:
            fetched = report(loop, log, self.total_steps)
            self.nonfinite.check_steps(loop.step, fetched, ckpt.kept())

    def _save(
        self, loop: Loop, ckpt: Checkpointer, force: bool = False, data_state: dict | None = None
    ) -> None:
        """A checkpoint when one is due (or ``force``), of finite steps and parameters only;
        a failed background save stops the run at the step after it. ``data_state`` replaces
        the iterator's own state."""
        ckpt.check()
        if not (force or ckpt.should_save(loop.step)):
            return
        self.watchdog.watch(loop.step, "saving the checkpoint of")
        self.nonfinite.check_steps(loop.step, jax.device_get(loop.pending), ckpt.kept())
        self.nonfinite.check_params(loop.step, loop.state.params, ckpt.kept())
        meta = {"epoch": loop.epoch, "stage": loop.stage,
                "config": rerun.config_record(self.config, self._devices()),
                "samples_seen": loop.iterator.next_sample}  # fmt: skip
        if data_state is None:
            data_state = loop.iterator.get_state()
        ckpt.save(loop.step, loop.state, data_state, meta, force=force)

    def _stopped_by_data(self, err: DatasetError, loop: Loop, ckpt: Checkpointer):
        """The error to stop with when the input cannot be read: with one process, after a
        checkpoint of the steps done, so that a rerun resumes there once the data is fixed
        (with several, the others cannot join this save: the newest saved step is kept)."""
        if jax.process_count() == 1 and loop.step > 0 and loop.iterator is not None:
            self._save(loop, ckpt, force=True, data_state=loop.iterator.position_state())
            ckpt.wait()
        return DatasetError(f"{err}; the run stopped at step {loop.step} ({ckpt.kept()})")

    def _evaluate_when_due(self, loop: Loop, log: RunLog) -> None:
        """The task's metrics every ``eval_every_epochs`` and at the end; the first eval whose
        headline metric reaches ``target_accuracy`` is logged as reached."""
        every = self.config.eval_every_epochs
        previous = self.schedule.epoch_at(loop.step - 1)
        due = every > 0 and math.floor(loop.epoch / every) > math.floor(previous / every)
        if not (loop.step == self.total_steps or due):
            return
        self.watchdog.pause()
        epoch = loop.epoch
        log.event("eval_start", epoch_num=epoch)
        loop.last_eval = self.evaluate(loop.state)
        log.event("eval_stop", epoch_num=epoch)
        headline = loop.last_eval[self.task.headline]
        log.metrics({"kind": "eval", "step": loop.step, "epoch": epoch, **loop.last_eval})
        log.event("eval_accuracy", headline, epoch_num=epoch, step=loop.step)
        shown = ", ".join(f"{k} {v:.4f}" for k, v in loop.last_eval.items())
        log.progress(f"eval at epoch {epoch:.2f}: {shown}", final=True)
        target = self.config.target_accuracy
        reached = headline >= target if self.task.higher_is_better else headline <= target
        if reached and not loop.reached_target:
            loop.reached_target = True
            log.event("target_reached", headline, epoch_num=epoch)

    def _finish(self, loop: Loop, ckpt: Checkpointer, log: RunLog) -> None:
        """The final checkpoint and the ``run_stop`` event."""
        if loop.step > 0 and loop.iterator is not None:
            self._save(loop, ckpt, force=True)
            ckpt.wait()
        side = "below" if self.task.higher_is_better else "above"
        shortfall = (
            f"{self.task.headline} stayed {side} target_accuracy {self.config.target_accuracy}"
        )
        log_run_stop(log, loop, self.schedule, self.total_steps, shortfall)

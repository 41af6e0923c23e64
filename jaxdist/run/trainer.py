"""The training loop: a recipe's config in, a trained state, logs and checkpoints out.

::

    config = jaxdist.run.config.load_recipe("recipes/mnist_small_batch.py")
    summary = Trainer(config, workdir="runs/mnist").run()

The trainer builds nothing itself: :func:`~jaxdist.run.build.build_run` resolves the whole
config once, in the constructor (a bad value fails there, before any training), into
:class:`~jaxdist.run.build.RunParts` (``trainer.parts``). The loop reads those parts and their
settings; the config itself is kept only as the run's record.

What is trained is the recipe's task (:mod:`jaxdist.tasks`): its variables, loss, evaluation
and data. The step is a :class:`~jaxdist.training.train_step.TrainStep` (data parallel), or a
:class:`~jaxdist.pipeline.step.PipelineStep` when the recipe has pipeline stages. Each step:

1. the batch-size schedule names the step's stage; at a stage boundary the data iterator is
   rebuilt at the stream position reached (nothing dropped or repeated) and the stage's train
   step (one per accumulation setting) compiles once for the new batch shape;
2. the learning rate is the epoch schedule at the *fractional epoch* (samples seen / dataset
   size), written into the optimizer state before the call, so it follows the samples and not
   the step count, and a changing value never recompiles;
3. the step runs with an RNG folded from the seed and the step number, so a resumed run draws
   the same numbers as an uninterrupted one.

Around the steps, in this loop: resume from the newest checkpoint, progress lines and
``metrics.jsonl`` every ``log_every_steps``, the task's metrics on the held-out split every
``eval_every_epochs``, checkpoints every ``checkpoint.every_steps`` and at the end. Everything
else is a hook (:mod:`jaxdist.run.hooks`) that the loop calls at fixed moments: the workdir lock,
the rerun comparison, the watchdog, preemption (SIGTERM, Ctrl-C), the profiler, the non-finite
guard, TensorBoard and the MLPerf event log. Only process 0 writes logs; every process takes
part in checkpoints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.data import DatasetError, Pipeline
from jaxdist.data.pipeline import reading_share
from jaxdist.run import pipeline_config, rerun
from jaxdist.run.agreement import check_same_everywhere, run_facts
from jaxdist.run.build import TaskFactory, build_run
from jaxdist.run.checkpoint import Checkpointer, CheckpointMismatchError, newest_config_record
from jaxdist.run.hooks import Hook, Hooks, OnStep
from jaxdist.run.log import RunLog, WorkdirError, describe_error, format_duration, last_eval
from jaxdist.run.standard_hooks import standard_hooks
from jaxdist.run.workdir_lock import WorkdirLock
from jaxdist.runtime.distributed import peer_lost
from jaxdist.tasks.image_classification import ImageClassification
from jaxdist.training.batches import data_share
from jaxdist.training.protocol import Step
from jaxdist.training.train_state import TrainState

__all__ = ["Loop", "TaskFactory", "Trainer"]


@dataclasses.dataclass
class Loop:
    """What the training loop carries from one step to the next; hooks read it."""

    state: TrainState
    step: int  # steps done, counted from 1
    total_steps: int
    base_rng: jax.Array
    data_state: dict | None = None  # the checkpoint's data position, until the iterator opens
    stage: int = -1  # the batch schedule's stage
    iterator: Any = None
    epoch: float = 0.0
    lr: float = 0.0
    batch_size: int = 0
    pending: list = dataclasses.field(default_factory=list)  # metrics since the last report
    started: float = dataclasses.field(default_factory=time.perf_counter)
    window_start: float = dataclasses.field(default_factory=time.perf_counter)
    window_samples: int = 0
    window_steps: int = 0
    last_eval: dict = dataclasses.field(default_factory=dict)
    reached_target: bool = False
    stopped_by: str = ""  # why the run stopped early: e.g. SIGTERM or SIGINT (Ctrl-C)
    config_changes: list = dataclasses.field(default_factory=list)  # accepted on resume


class Trainer:
    """Train ``config`` (a recipe's ConfigDict, see :func:`jaxdist.run.config.base_config`),
    writing logs and checkpoints under ``workdir``; :meth:`run` resumes from the newest
    checkpoint there, if any. ``task`` builds what is trained from the config (a recipe's
    ``get_task``, see :mod:`jaxdist.tasks`; default: image classification); ``recipe`` is its
    file, which every process must have alike (:mod:`jaxdist.run.agreement`). ``mesh``
    replaces the recipe's (a mesh of compile-only devices, :mod:`jaxdist.aot`, lets its steps
    be compiled but not run). ``profile_steps=(first, last)`` traces those steps into
    ``WORKDIR/profile`` (:mod:`jaxdist.run.profile`). ``hooks`` are called after the trainer's
    own (:mod:`jaxdist.run.hooks`). What the config resolved to is ``parts``
    (:class:`~jaxdist.run.build.RunParts`: ``parts.mesh``, ``parts.task``, ``parts.data``,
    ``parts.schedule``, ``parts.plans``, ``parts.total_steps``, ...)."""

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
        hooks: Sequence[Hook] = (),
    ) -> None:
        self.workdir = Path(workdir)
        self.allow_config_change = allow_config_change
        self.recipe = recipe
        self.user_hooks = list(hooks)
        # Everything the config describes, built and checked now, before any training.
        try:
            recorded = rerun.recorded_devices(self.workdir)  # e.g. a pipeline's "auto" cut
        except OSError as err:
            raise WorkdirError.from_os_error(err, self.workdir) from err
        self.parts = parts = build_run(
            config,
            self.workdir,
            task_factory=task or ImageClassification,
            mesh=mesh,
            recorded=recorded,
            profile_steps=profile_steps,
            hooks=self.user_hooks,
        )
        self.config = parts.config  # the run's record only: the loop reads the parts
        if isinstance(parts.data, Pipeline):  # a loader decoding on GPUs places the images
            parts.data.batch_sharding = NamedSharding(parts.mesh, P(parts.data_axes))
        self._compiled_steps: list[Step] = []  # steps that ran once (compiling is not watched)

    # ------------------------------------------------------------------ pieces

    def train_step_for(self, stage: int) -> Step:
        """The train step of a batch-schedule stage: one per accumulation setting, built with
        the run; a new batch shape compiles once more."""
        return self.parts.train_step_for(stage)

    def initial_state(self) -> Any:
        """The task's variables from the seed, made straight into their places on the mesh
        by one compiled program: a sharded state is never whole on one device, and a
        replicated one is born on every device at once, not on the host first."""
        key = jax.random.key(self.parts.settings.seed)
        return self.train_step_for(0).init_sharded(self.parts.task.init_variables, key)

    def abstract_state(self) -> Any:
        """What :meth:`initial_state` returns, as shapes with their shardings: the target a
        checkpoint is read into. Nothing is initialised or placed, so a resumed run does not
        pay for the parameters the checkpoint replaces."""
        key = jax.random.key(self.parts.settings.seed)
        shapes = jax.eval_shape(self.parts.task.init_variables, key)
        return self.train_step_for(0).abstract_init(*shapes)

    def evaluate(self, state: Any) -> dict[str, float]:
        """The task's metrics over the whole held-out split."""
        step = self.train_step_for(0)
        params, model_state = step.whole_variables(state)
        whole = TrainState(state.step, params, model_state, opt_state=None)
        totals = None
        with (
            self._reading(),
            self.parts.data.eval_iterator(self.parts.settings.eval_batch_size) as batches,
        ):
            for batch in batches:
                sums = self.parts.eval_step(whole, step.shard_batch(batch))
                totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
        totals = {k: float(v) for k, v in jax.device_get(totals).items()}
        return self.parts.task.eval_metrics(totals)

    def _reading(self) -> contextlib.AbstractContextManager[None]:
        """Iterators built inside read this process's part of every global batch: the same
        part as the other processes holding its replicas (:func:`data_share`)."""
        return reading_share(*data_share(self.parts.mesh, self.parts.data_axes))

    def resolved_devices(self) -> dict[str, Any]:
        """What the run resolved on this machine: the mesh, and a pipeline's "auto" cut."""
        return self.parts.resolved_devices()

    # ------------------------------------------------------------------ the loop

    def run(self, on_step: Callable[[int, TrainState], None] | None = None) -> dict[str, Any]:
        """Train to ``num_epochs`` (or ``max_steps``), resuming if a checkpoint exists.

        ``on_step(step, state)`` is called after every step (steps counted from 1), after its
        checkpoint if one was due. Returns a summary: final step and epoch, the last
        evaluation's metrics, whether it was preempted (and by what), and
        ``already_finished`` when the workdir held a finished run (then nothing is trained or
        written, and the metrics are those recorded in its ``metrics.jsonl``).
        """
        check_same_everywhere(run_facts(self.config, self.parts.mesh, self.recipe))
        if self.workdir.exists() and not self.workdir.is_dir():
            raise WorkdirError(
                f"the workdir {self.workdir} is a file, not a folder: give another --workdir"
            )
        try:
            return self._run(on_step)
        except OSError as err:  # a save's own failures are CheckpointWriteError already
            raise WorkdirError.from_os_error(err, self.workdir) from err
        except jax.errors.JaxRuntimeError as err:  # a killed peer fails the collectives here
            lost = peer_lost(err, jax.process_count())
            if lost is None:
                raise
            raise lost from err

    def _run(self, on_step: Callable | None) -> dict[str, Any]:
        saves, log_every = self.parts.checkpoint, self.parts.settings.log_every_steps
        log = RunLog(self.workdir, enabled=jax.process_index() == 0)
        on_steps = [OnStep(on_step)] if on_step is not None else []
        loop, failure = None, None
        with contextlib.ExitStack() as held:
            # The workdir's lock before anything else: opening the checkpoints moves an
            # incomplete one aside, which would be the save of a run still writing there.
            lock = held.enter_context(WorkdirLock(self.workdir))
            held.enter_context(self._reading())
            ckpt = Checkpointer(
                self.workdir / "checkpoints",
                every_steps=saves.every_steps,
                keep=saves.keep,
                async_save=saves.async_save,
            )
            own = standard_hooks(
                self.parts, log, ckpt, lock, allow_config_change=self.allow_config_change
            )
            hooks = Hooks(own + self.user_hooks + on_steps)
            try:
                for hook in hooks.hooks:  # the rerun check comes first after the lock
                    if hook is not lock:
                        held.enter_context(hook)
                log.open()
                loop = self._resume(ckpt, log, hooks)
                if loop.step >= self.parts.total_steps:
                    return self._already_finished(loop, log)
                hooks.run_started(loop)
                while loop.step < self.parts.total_steps and not loop.stopped_by:
                    self._train_one_step(loop, log, ckpt, hooks)
                    if loop.step % log_every == 0 or loop.step == self.parts.total_steps:
                        self._report(loop, log, hooks)
                    if self._eval_due(loop):
                        self._evaluate(loop, log, hooks)
                    ckpt.check()  # a failed background save stops the run at the step after it
                    if ckpt.should_save(loop.step):
                        self._save(loop, ckpt, hooks)
                    hooks.step_done(loop)
                    loop.stopped_by = hooks.stop_requested(loop)
                self._finish(loop, ckpt, hooks)
            except BaseException as err:  # KeyboardInterrupt too: the event log says why
                failure = describe_error(err)
                raise
            finally:
                if loop is not None:
                    hooks.run_ended(loop, failure)
                ckpt.close()
                if loop is not None and loop.iterator is not None:
                    loop.iterator.close()
                log.close()
        self.state = loop.state
        return {
            "step": loop.step,
            "epoch": loop.epoch,
            "preempted": bool(loop.stopped_by),
            "stopped_by": loop.stopped_by,
            **loop.last_eval,
        }

    def _resume(self, ckpt: Checkpointer, log: RunLog, hooks: Hooks) -> Loop:
        """The loop's state: from the newest checkpoint, or fresh from the seed."""
        step, data_state, meta = 0, None, {}
        if ckpt.steps():
            try:
                step, state, data_state, meta = ckpt.restore(self.abstract_state())
            except CheckpointMismatchError as err:
                raise self._pipeline_mismatch(err, ckpt) from None
        else:
            state = self.initial_state()
        loop = Loop(
            state=state,
            step=step,
            total_steps=self.parts.total_steps,
            base_rng=jax.random.PRNGKey(self.parts.settings.seed),
            data_state=data_state,
            epoch=self.parts.schedule.epoch_at(step),
        )
        hooks.resumed(loop, meta)
        if 0 < step < self.parts.total_steps:
            log.progress(f"resumed from step {step} (epoch {meta['epoch']:.3f})", final=True)
        return loop

    def _pipeline_mismatch(
        self, err: CheckpointMismatchError, ckpt: Checkpointer
    ) -> CheckpointMismatchError:
        """``err``, said as what it is when a pipeline recipe resumes under another sharding:
        the same model, laid out another way."""
        recorded = newest_config_record(ckpt.directory) or {}
        old, new = recorded.get("sharding"), self.parts.step_parts.sharding.kind
        if not isinstance(self.parts.step_kind, pipeline_config.Pipeline) or old in (None, new):
            return err
        return CheckpointMismatchError(
            f"the checkpoints in {ckpt.directory} hold this pipeline under sharding={old!r}; "
            "a pipeline stores each stage as one vector laid out for its sharding and "
            f"replica count, so it resumes only under them: rerun with --set sharding={old}, "
            f"or train under sharding={new!r} in another --workdir"
        )

    def _already_finished(self, loop: Loop, log: RunLog) -> dict[str, Any]:
        """A rerun of a finished run: say so, train nothing, append nothing."""
        log.progress(
            f"already finished: step {loop.step} of {self.parts.total_steps} (epoch {loop.epoch:.2f}); "
            "nothing to train (raise num_epochs or max_steps to go on)",
            final=True,
        )
        self.state = loop.state
        return {
            "step": loop.step,
            "epoch": loop.epoch,
            "preempted": False,
            "already_finished": True,
            **last_eval(self.workdir),
        }

    def _train_one_step(self, loop: Loop, log: RunLog, ckpt: Checkpointer, hooks: Hooks) -> None:
        """One step: a new stage's iterator and step if the step starts one, the epoch's LR,
        the step's RNG."""
        step = loop.step
        hooks.step_starting(loop)
        try:
            if self.parts.schedule.stage_index_at(step) != loop.stage:
                loop.stage = self.parts.schedule.stage_index_at(step)
                if loop.iterator is not None:
                    loop.iterator.close()
                loop.iterator = self.parts.schedule.open_iterator(
                    self.parts.data, step, loop.data_state
                )
                loop.data_state = None  # the stream continues from here
            batch = next(loop.iterator)
        except DatasetError as err:
            raise self._stopped_by_data(err, loop, ckpt, hooks) from err
        train_step = self.train_step_for(loop.stage)
        batch = train_step.shard_batch(batch)
        loop.lr = float(self.parts.lr_fn(self.parts.schedule.epoch_at(step)))
        loop.state = train_step.set_learning_rate(loop.state, loop.lr)
        rng = jax.random.fold_in(loop.base_rng, step)
        compiled = train_step in self._compiled_steps
        hooks.step_calling(loop, compiled)
        with hooks.around_step(loop):
            loop.state, metrics = train_step(loop.state, batch, rng)
        if not compiled:
            self._compiled_steps.append(train_step)
            self._show_gradient_plan(train_step, log)
        loop.step += 1
        loop.batch_size = self.parts.schedule.batch_size_at(step)
        loop.window_samples += loop.batch_size
        loop.window_steps += 1
        loop.pending.append(metrics)
        loop.epoch = self.parts.schedule.epoch_at(loop.step)

    def _show_gradient_plan(self, train_step: Step, log: RunLog) -> None:
        """After a train step's first call, when it chooses routes (``auto``) or sends factors:
        the plan, as ``TrainStep.plan().table()`` prints it (a pipeline step refuses both)."""
        if not self.parts.shows_plans:
            return
        log.progress(
            f"gradient plan, {train_step.accumulation_steps} micro-batch(es) per step:", final=True
        )
        for line in train_step.plan().table().splitlines():
            log.progress(line, final=True)

    def _report(self, loop: Loop, log: RunLog, hooks: Hooks) -> None:
        """The mean metrics since the last report to ``metrics.jsonl`` and a progress line with
        the elapsed time and an ETA from the recent step rate."""
        fetched = jax.device_get(loop.pending)
        means = {k: float(np.mean([m[k] for m in fetched])) for k in fetched[0]}
        now = time.perf_counter()
        window = now - loop.window_start
        rate = loop.window_samples / window
        record = {
            "kind": "train",
            "step": loop.step,
            "epoch": loop.epoch,
            "lr": loop.lr,
            "batch_size": loop.batch_size,
            f"{self.parts.task.unit}_per_sec": rate,
            **means,
        }
        log.metrics(record)
        eta = (self.parts.total_steps - loop.step) * window / loop.window_steps
        log.progress(
            f"step {loop.step}/{self.parts.total_steps} | epoch {loop.epoch:.2f} | "
            f"{rate:.0f} {self.parts.task.unit}/s | loss {means['loss']:.4f} | "
            f"lr {loop.lr:.4g} | batch {loop.batch_size} | "
            f"{format_duration(now - loop.started)} elapsed, eta {format_duration(eta)}"
        )
        loop.pending, loop.window_start = [], now
        loop.window_samples = loop.window_steps = 0
        hooks.recorded(loop, record)
        hooks.reported(loop, fetched)  # the non-finite guard may stop the run here

    def _eval_due(self, loop: Loop) -> bool:
        """Every ``eval_every_epochs`` (at the first step past each multiple) and at the end."""
        every = self.parts.settings.eval_every_epochs
        previous = self.parts.schedule.epoch_at(loop.step - 1)
        due = every > 0 and math.floor(loop.epoch / every) > math.floor(previous / every)
        return due or loop.step == self.parts.total_steps

    def _evaluate(self, loop: Loop, log: RunLog, hooks: Hooks) -> None:
        """The task's metrics now; the first whose headline metric reaches ``target_accuracy``
        marks the target reached."""
        hooks.evaluating(loop)
        loop.last_eval = self.evaluate(loop.state)
        headline = loop.last_eval[self.parts.task.headline]
        target = self.parts.settings.target_accuracy
        loop.reached_target |= (
            headline >= target if self.parts.task.higher_is_better else headline <= target
        )
        hooks.evaluated(loop)
        record = {"kind": "eval", "step": loop.step, "epoch": loop.epoch, **loop.last_eval}
        log.metrics(record)
        hooks.recorded(loop, record)
        shown = ", ".join(f"{k} {v:.4f}" for k, v in loop.last_eval.items())
        log.progress(f"eval at epoch {loop.epoch:.2f}: {shown}", final=True)

    def _save(
        self,
        loop: Loop,
        ckpt: Checkpointer,
        hooks: Hooks,
        force: bool = False,
        data_state: dict | None = None,
    ) -> None:
        """A checkpoint now (the hooks may refuse one, e.g. of non-finite parameters);
        ``data_state`` replaces the iterator's own state."""
        ckpt.check()
        hooks.saving(loop)
        meta = {
            "epoch": loop.epoch,
            "stage": loop.stage,
            "config": rerun.config_record(self.config, self.resolved_devices()),
            "samples_seen": loop.iterator.next_sample,
        }
        if data_state is None:
            data_state = loop.iterator.get_state()
        ckpt.save(loop.step, loop.state, data_state, meta, force=force)

    def _stopped_by_data(self, err: DatasetError, loop: Loop, ckpt: Checkpointer, hooks: Hooks):
        """The error to stop with when the input cannot be read: with one process, after a
        checkpoint of the steps done, so that a rerun resumes there once the data is fixed
        (with several, the others cannot join this save: the newest saved step is kept)."""
        if jax.process_count() == 1 and loop.step > 0 and loop.iterator is not None:
            self._save(loop, ckpt, hooks, force=True, data_state=loop.iterator.position_state())
            ckpt.wait()
        return DatasetError(f"{err}; the run stopped at step {loop.step} ({ckpt.kept()})")

    def _finish(self, loop: Loop, ckpt: Checkpointer, hooks: Hooks) -> None:
        """The final checkpoint, written before the run is called ended."""
        if loop.step > 0 and loop.iterator is not None:
            self._save(loop, ckpt, hooks, force=True)
            ckpt.wait()

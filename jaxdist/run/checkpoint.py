"""Checkpoints on orbax: train state, data-iterator position and schedule position, together.

One :class:`Checkpointer` per run directory wraps an ``orbax.checkpoint.CheckpointManager``
with three items per step:

* ``state`` -- the :class:`~jaxdist.training.train_step.TrainState` pytree (parameters, BatchNorm
  statistics, optimizer state with its injected learning rate, loss scale), written by every
  process for its own shards and restored straight onto the mesh's shardings;
* ``data`` -- the input iterator's :meth:`~jaxdist.data.BatchIterator.get_state` (JSON);
* ``meta`` -- where the run is: step, samples seen, epoch, batch-size stage (JSON).

Saves are asynchronous (orbax copies the arrays to host memory before ``save`` returns and
writes them in a background thread, so the next step may donate the device buffers), happen
every ``every_steps`` steps and at the end, and the last ``keep`` are kept.

Restoring tries the newest step first; if it cannot be read (a truncated or corrupted file, a
missing item) it warns in one line and falls back to the one before, and so on; the unreadable
steps are then moved aside (``checkpoints.unreadable/``) so that they are saved anew. A preemption is a SIGTERM:
:class:`PreemptionGuard` turns it into a flag that the training loop checks after each step, so
the checkpoint is written from a consistent state and not from inside a signal handler.
"""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import shutil
import signal
import sys
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxdist.run.log import describe_error

__all__ = [
    "Checkpointer",
    "NoCheckpointError",
    "PreemptionGuard",
]

log = logging.getLogger(__name__)


class CheckpointWarning(RuntimeWarning):
    """A checkpoint could not be read and was skipped (or moved aside)."""


class NoCheckpointError(RuntimeError):
    """No step in the directory could be restored."""

    exit_code = 1


class Checkpointer:
    """Save and restore a run's checkpoints under ``directory``.

    Args:
      directory: checkpoint root (one sub-folder per saved step).
      every_steps: save interval; 0 saves only when forced (end of run, preemption).
      keep: how many of the newest checkpoints to keep.
      async_save: write in a background thread.
    """

    ITEMS = ("state", "data", "meta")

    def __init__(
        self,
        directory: str | Path,
        *,
        every_steps: int = 1000,
        keep: int = 3,
        async_save: bool = True,
    ) -> None:
        if every_steps < 0 or keep < 1:
            raise ValueError(
                f"checkpoint needs every_steps >= 0 and keep >= 1, got {every_steps}, {keep}"
            )
        self.directory = Path(directory).absolute()
        self.every_steps = every_steps
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            # The manager's own interval is not used: save() decides, so that forced saves
            # and the every_steps rule live in one place.
            save_interval_steps=1,
            enable_async_checkpointing=async_save,
            create=True,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=self.ITEMS)

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is on the ``every_steps`` grid."""
        return self.every_steps > 0 and step > 0 and step % self.every_steps == 0

    def save(
        self,
        step: int,
        state: Any,
        data_state: Mapping[str, Any],
        meta: Mapping[str, Any],
        *,
        force: bool = False,
    ) -> bool:
        """Save at ``step`` if it is on the grid or ``force``; returns whether it did."""
        if not (force or self.should_save(step)):
            return False
        if step in self.manager.all_steps():
            return False  # already saved (e.g. the grid step was also the last one)
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(dict(data_state)),
            meta=ocp.args.JsonSave({**meta, "step": int(step)}),
        )
        return bool(self.manager.save(step, args=args, force=True))

    def steps(self) -> list[int]:
        """Saved steps, oldest first."""
        return sorted(self.manager.all_steps())

    def restore(self, abstract_state: Any) -> tuple[int, Any, dict, dict]:
        """Restore the newest readable checkpoint as ``(step, state, data_state, meta)``.

        ``abstract_state`` is a pytree of ``jax.ShapeDtypeStruct`` with shardings (see
        :func:`abstract_like`); the arrays are read straight into those shardings. A step that
        cannot be read is skipped with a one-line :class:`CheckpointWarning`; once an older
        step is restored, the unreadable newer ones are moved to :attr:`unreadable_directory`,
        so that the run saves those steps anew instead of meeting them again. Raises
        :class:`NoCheckpointError`, leaving every checkpoint where it is, if none is readable.
        """
        self.manager.wait_until_finished()
        self.manager.reload()
        steps = sorted(self.manager.all_steps(), reverse=True)
        if not steps:
            raise NoCheckpointError(f"no checkpoint under {self.directory}")
        failures: list[tuple[int, str]] = []
        found = None
        with _library_noise_hidden(self.directory, failures):
            for step in steps:
                try:
                    found = step, self._restore_step(step, abstract_state)
                    break
                except Exception as err:  # any unreadable checkpoint: try the previous one
                    failures.append((step, describe_error(err, limit=160)))
        for step, reason in failures:
            warnings.warn(
                f"checkpoint at step {step} in {self.directory} cannot be read ({reason})",
                CheckpointWarning,
                stacklevel=2,
            )
        if found is None:
            tried = "; ".join(f"step {s}: {reason}" for s, reason in failures)
            raise NoCheckpointError(
                f"none of the {len(steps)} checkpoints under {self.directory} can be read "
                f"({tried}); they are left untouched: move that folder aside to start afresh, "
                "or train in another --workdir"
            )
        step, restored = found
        if failures:
            self._move_aside([s for s, _ in failures], restored_step=step)
        return step, restored.state, dict(restored.data), dict(restored.meta)

    @property
    def unreadable_directory(self) -> Path:
        """Where steps that could not be read are moved: beside the checkpoints, not among
        them, so the manager neither lists nor prunes them."""
        return self.directory.with_name(self.directory.name + ".unreadable")

    def _restore_step(self, step: int, abstract_state: Any) -> Any:
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state),
                data=ocp.args.JsonRestore(),
                meta=ocp.args.JsonRestore(),
            ),
        )
        if dict(restored.meta).get("step") != step:
            raise ValueError(f"meta says step {restored.meta.get('step')}, folder says {step}")
        return restored

    def _move_aside(self, steps: list[int], restored_step: int) -> None:
        """Move unreadable ``steps`` (process 0 moves; every process then sees them gone)."""
        if jax.process_index() == 0:
            self.unreadable_directory.mkdir(exist_ok=True)
            for step in steps:
                source = self.directory / str(step)
                target = self.unreadable_directory / str(step)
                suffix = 1
                while target.exists():  # a step found unreadable once before
                    target = self.unreadable_directory / f"{step}-{suffix}"
                    suffix += 1
                shutil.move(source, target)
                warnings.warn(
                    f"moved the unreadable step {step} to {target}; resuming from step "
                    f"{restored_step}, and step {step} will be saved anew",
                    CheckpointWarning,
                    stacklevel=3,
                )
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("jaxdist_checkpoint_moved_aside")
        self.manager.reload()

    def wait(self) -> None:
        """Block until background saves are on disk."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


class _UnreadCheckpointFutures(logging.Filter):
    """Drops asyncio's "Future exception was never retrieved" reports about reads under one
    checkpoint directory: a failed restore leaves such futures behind, and they report when
    collected, possibly at exit, long after the one-line warning said what failed."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = str(directory)

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += str(record.exc_info[1])
        return not ("never retrieved" in text and self.directory in text)


@contextlib.contextmanager
def _library_noise_hidden(directory: Path, failures: list, settle_s: float = 0.2, most_s=3.0):
    """Hide what TensorStore and asyncio print about failed reads of checkpoints under
    ``directory``. A failed read leaves TensorStore threads calling back into orbax's closed
    event loop, and each prints an "Event loop is closed" traceback to ``sys.stderr``: if
    ``failures`` is not empty at the end, this waits until they have gone quiet for
    ``settle_s`` (at most ``most_s``) before stderr comes back. The read's futures are
    filtered out of the asyncio log for good."""
    asyncio_log = logging.getLogger("asyncio")
    if not any(
        isinstance(f, _UnreadCheckpointFutures) and f.directory == str(directory)
        for f in asyncio_log.filters
    ):
        asyncio_log.addFilter(_UnreadCheckpointFutures(directory))
    captured = io.StringIO()
    real = sys.stderr
    sys.stderr = captured
    try:
        yield
    finally:
        if failures:
            deadline = time.monotonic() + most_s
            size = -1
            while size != len(captured.getvalue()) and time.monotonic() < deadline:
                size = len(captured.getvalue())
                time.sleep(settle_s)
            gc.collect()
        sys.stderr = real


def abstract_like(state: Any) -> Any:
    """``ShapeDtypeStruct``s (with shardings) of a live state: the restore target."""
    return jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
            if isinstance(x, jax.Array)
            else x
        ),
        state,
    )


class PreemptionGuard:
    """Turns SIGTERM into ``preempted`` being true at the next step boundary.

    With several processes a signal reaches them at different steps, so they would stop at
    different steps and the save would hang; there orbax's ``reached_preemption`` (JAX's
    preemption sync point, agreed through the coordination service) decides instead.
    Use as a context manager; the previous handler is restored on exit.
    """

    def __init__(self, manager: ocp.CheckpointManager | None = None) -> None:
        self._manager = manager
        self._signalled = False
        self._previous = None

    def __enter__(self) -> PreemptionGuard:
        if jax.process_count() == 1:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _handle(self, signum: int, frame: Any) -> None:
        log.warning("SIGTERM received: saving a checkpoint after this step, then stopping")
        self._signalled = True

    def preempted(self, step: int) -> bool:
        """Whether to save and stop after ``step``."""
        if jax.process_count() > 1 and self._manager is not None:
            return bool(self._manager.reached_preemption(step))
        return self._signalled

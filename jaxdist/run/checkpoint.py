"""Checkpoints on orbax: train state, data-iterator position and schedule position, together.

One :class:`Checkpointer` per run directory wraps an ``orbax.checkpoint.CheckpointManager``
with three items per step:

* ``state`` -- the :class:`~jaxdist.training.train_state.TrainState` pytree (parameters, BatchNorm
  statistics, optimizer state with its injected learning rate, loss scale), written by every
  process for its own shards and restored straight onto the mesh's shardings;
* ``data`` -- the input iterator's :meth:`~jaxdist.data.BatchIterator.get_state` (JSON);
* ``meta`` -- where the run is: step, samples seen, epoch, batch-size stage, and the config
  record it was trained with (``config.json``'s content, so a workdir whose ``config.json`` is
  missing or replaced is still compared with what its checkpoints were trained with) (JSON).

Saves are asynchronous (orbax copies the arrays to host memory before ``save`` returns and
writes them in a background thread, so the next step may donate the device buffers), happen
every ``every_steps`` steps and at the end, and the last ``keep`` are kept.

Restoring tries the newest step first; if it cannot be read (a truncated or corrupted file, a
missing item) it warns in one line and falls back to the one before, and so on; the unreadable
steps are then moved aside (``checkpoints.unreadable/``) so that they are saved anew. A save cut
short (the run killed while writing) leaves orbax's temporary folder, which is moved there too
when the directory is opened. A checkpoint whose arrays have other names or shapes than the run
(another model or recipe) is an error naming the first difference, not a fallback: every step
would differ alike. A preemption (SIGTERM) saves through :mod:`jaxdist.run.preemption`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jaxdist.run.checkpoint_digest import array_digests, check_digests, dotted_name
from jaxdist.run.checkpoint_noise import failures_reported, unawaited_coroutine_warnings_hidden
from jaxdist.run.log import describe_error

__all__ = [
    "CheckpointMismatchError",
    "CheckpointWriteError",
    "Checkpointer",
    "NoCheckpointError",
]


def state_type_handlers(replica_parallel: bool) -> ocp.type_handlers.TypeHandlerRegistry:
    """orbax's handlers for the leaves of a train state; the checkpointer asks for
    replica-parallel writing only when there are several processes.

    Replica-parallel writing spreads a replicated array's bytes over the processes that hold
    a copy. In one process every copy is local and there is nothing to spread, but orbax
    still compiles a slicing program for each array, which makes the first save of a
    replicated ResNet-50 on 8 CPU devices about ten times slower."""
    h = ocp.type_handlers
    arrays = h.ArrayHandler(use_replica_parallel=replica_parallel)
    return h.create_type_handler_registry(
        (jax.Array, arrays),
        (np.ndarray, h.NumpyHandler()),
        (np.number, h.ScalarHandler()),
        (int, h.ScalarHandler()),
        (float, h.ScalarHandler()),
        (bytes, h.ScalarHandler()),
        (str, h.StringHandler()),
    )


class CheckpointWarning(RuntimeWarning):
    """A checkpoint could not be read and was skipped (or moved aside)."""


class NoCheckpointError(RuntimeError):
    """No step in the directory could be restored."""

    exit_code = 1


class CheckpointMismatchError(RuntimeError):
    """The checkpoint holds another model: its arrays' names or shapes differ from the run's."""

    exit_code = 1


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (a full disk, a file-size limit, lost storage)."""

    exit_code = 1


# Orbax writes a step into ``<step>.orbax-checkpoint-tmp`` and renames it when complete.
INCOMPLETE_SUFFIX = ".orbax-checkpoint-tmp"


class Checkpointer:
    """Save and restore a run's checkpoints under ``directory``.

    Args:
      directory: checkpoint root (one sub-folder per saved step).
      every_steps: save interval; 0 saves only when forced (end of run, preemption).
      keep: how many of the newest checkpoints to keep.
      async_save: write in a background thread.
    """

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
        self._move_incomplete_aside()
        self._writing: int | None = None  # the step a background save is writing
        self._failed = False  # a failed write was reported (raised) already
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            # The manager's own interval is not used: save() decides, so that forced saves
            # and the every_steps rule live in one place.
            save_interval_steps=1,
            enable_async_checkpointing=async_save,
            create=True,
        )
        handlers = {
            "state": ocp.PyTreeCheckpointHandler(
                type_handler_registry=state_type_handlers(jax.process_count() > 1)
            ),
            "data": ocp.JsonCheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler(),
        }
        self.manager = ocp.CheckpointManager(
            self.directory, options=options, item_handlers=handlers
        )
        failures_reported(self.directory)  # by restore's warnings and _write_error

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
        self.wait()  # the previous save's failure is reported as its own
        digests = array_digests(state)  # before the save: the state may be donated after it
        args = ocp.args.Composite(
            state=ocp.args.PyTreeSave(state),
            data=ocp.args.JsonSave(dict(data_state)),
            meta=ocp.args.JsonSave({**meta, "step": int(step), "digests": digests}),
        )
        self._writing = step
        try:
            return bool(self.manager.save(step, args=args, force=True))
        except Exception as err:
            raise self._write_error(err) from err

    def steps(self) -> list[int]:
        """Saved steps, oldest first."""
        return sorted(self.manager.all_steps())

    def kept(self) -> str:
        """Which checkpoint a run that stops now leaves to resume from, for its last line."""
        steps = self.steps()
        return f"the newest checkpoint, step {steps[-1]}, is kept" if steps else "no checkpoint yet"

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
        for step in steps:
            try:
                found = step, self._restore_step(step, abstract_state)
                break
            except CheckpointMismatchError:
                raise
            except Exception as err:  # any unreadable checkpoint: try the previous one
                unawaited_coroutine_warnings_hidden()
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
        meta = {k: v for k, v in dict(restored.meta).items() if k != "digests"}  # ours to check
        return step, restored.state, dict(restored.data), meta

    @property
    def unreadable_directory(self) -> Path:
        """Where steps that could not be read are moved: beside the checkpoints, not among
        them, so the manager neither lists nor prunes them."""
        return self.directory.with_name(self.directory.name + ".unreadable")

    def _restore_step(self, step: int, abstract_state: Any) -> Any:
        self._check_same_arrays(step, abstract_state)
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(
                    abstract_state,
                    restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state),
                ),
                data=ocp.args.JsonRestore(),
                meta=ocp.args.JsonRestore(),
            ),
        )
        if dict(restored.meta).get("step") != step:
            raise ValueError(f"meta says step {restored.meta.get('step')}, folder says {step}")
        check_digests(restored.state, dict(restored.meta).get("digests"))
        return restored

    def _check_same_arrays(self, step: int, abstract_state: Any) -> None:
        """Raise :class:`CheckpointMismatchError` at the first array whose name or shape in
        step ``step`` differs from ``abstract_state``'s. Metadata that cannot be read says
        nothing here: the restore then fails and counts the step as unreadable."""
        try:
            saved = ocp.StandardCheckpointHandler().metadata(
                epath.Path(self.directory / str(step) / "state")
            )
        except Exception:  # unreadable: left to the restore's own fallback
            return
        difference = first_difference(_array_shapes(saved), _array_shapes(abstract_state))
        if difference is not None:
            raise CheckpointMismatchError(
                f"the checkpoint at step {step} in {self.directory} holds another model or "
                f"recipe: {difference}; train this one in another --workdir"
            )

    def _move_incomplete_aside(self) -> None:
        """Move saves cut short (orbax's temporary folders) to :attr:`unreadable_directory`,
        so that they are kept for inspection and the step is saved anew."""
        if jax.process_index() != 0 or not self.directory.is_dir():
            return
        for partial in sorted(self.directory.glob(f"*{INCOMPLETE_SUFFIX}*")):
            target = _free_name(self.unreadable_directory / partial.name)
            target.parent.mkdir(exist_ok=True)
            shutil.move(partial, target)
            warnings.warn(
                f"moved an incomplete checkpoint (a save cut short) from {partial} to {target}",
                CheckpointWarning,
                stacklevel=3,
            )

    def _move_aside(self, steps: list[int], restored_step: int) -> None:
        """Move unreadable ``steps`` (process 0 moves; every process then sees them gone)."""
        if jax.process_index() == 0:
            self.unreadable_directory.mkdir(exist_ok=True)
            for step in steps:
                target = _free_name(self.unreadable_directory / str(step))
                shutil.move(self.directory / str(step), target)
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

    def check(self) -> None:
        """:class:`CheckpointWriteError` if a background save has failed by now (does not
        wait for one still running): a full disk stops the run at the next step."""
        try:
            self.manager.check_for_errors()
        except Exception as err:
            raise self._write_error(err) from err

    def wait(self) -> None:
        """Block until background saves are on disk; :class:`CheckpointWriteError` if one
        failed."""
        try:
            self.manager.wait_until_finished()
        except Exception as err:
            raise self._write_error(err) from err
        self._writing = None

    def close(self) -> None:
        try:
            if not self._failed:
                self.wait()
        finally:
            self.manager.close()

    def _write_error(self, err: Exception) -> CheckpointWriteError:
        """One line: which step could not be written where, why, and what is kept."""
        step, self._writing, self._failed = self._writing, None, True
        unawaited_coroutine_warnings_hidden()
        complete = [s for s in self.steps() if s != step]
        kept = f"step {complete[-1]} is the newest complete one" if complete else "none is kept"
        return CheckpointWriteError(
            f"cannot write the checkpoint of step {step} to {self.directory} "
            f"({_os_error(err)}); {kept}"
        )


def newest_config_record(directory: Path) -> dict | None:
    """The config record saved in the meta of the newest complete checkpoint under
    ``directory``, read without restoring anything; ``None`` when there is none (or it
    predates config records, or cannot be read: the restore then decides)."""
    steps = (
        sorted((int(p.name) for p in Path(directory).glob("*") if p.name.isdigit()), reverse=True)
        if Path(directory).is_dir()
        else []
    )
    for step in steps:
        try:
            meta = json.loads((Path(directory) / str(step) / "meta" / "metadata").read_text())
        except (OSError, ValueError):
            continue
        return meta["config"] if isinstance(meta.get("config"), dict) else None
    return None


def _os_error(err: Exception) -> str:
    """The operating system's reason inside a TensorStore error ("File too large (errno
    27)"), or the error's first line. The reason is named from the error code: the text
    before the code is not always the reason (a spec payload such as ``[tensorstore_spec=
    '...']`` can stand between them)."""
    found = re.search(r"\[os_error_code='(\d+)'\]", str(err))
    if found:
        code = int(found.group(1))
        return f"{os.strerror(code)} (errno {code})"
    return describe_error(err, limit=200)


def _free_name(path: Path) -> Path:
    """``path``, or ``path-1``, ``path-2``, ... if taken (a step moved aside once before)."""
    target, suffix = path, 1
    while target.exists():
        target = path.with_name(f"{path.name}-{suffix}")
        suffix += 1
    return target


def _array_shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    """Dotted path -> shape of every array leaf (live, abstract or orbax metadata)."""
    return {
        dotted_name(path): tuple(leaf.shape)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
        if hasattr(leaf, "shape")
    }


def first_difference(saved: dict[str, tuple], expected: dict[str, tuple]) -> str | None:
    """The first array (in the run's order) that is missing from ``saved`` or has another
    shape there, or the first one ``saved`` has beyond ``expected``; None if they agree."""
    for name, shape in expected.items():
        if name not in saved:
            return f"{name} {shape} is not in it"
        if saved[name] != shape:
            return f"{name} is {saved[name]} there and {shape} in this run"
    extra = [name for name in saved if name not in expected]
    if extra:
        return f"it has {extra[0]} {saved[extra[0]]}, which this run has not"
    return None


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

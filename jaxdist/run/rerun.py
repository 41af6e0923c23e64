"""The config a workdir's run was started with, and what a rerun may change.

A run records its resolved config (every field, derived ones included) in
``WORKDIR/config.json`` when it starts. A rerun in the same workdir resumes the run's
checkpoints, so it must be the same run: the rerun's config is compared with the recorded one
and any difference is refused, naming each differing key ``old -> new``. Only keys that do not
change what is computed may change freely (:data:`SAFE_TO_CHANGE`), ``num_epochs`` may
grow (a longer run, with its learning-rate schedule stretched to the new end), and a field
added to the toolkit after the run started may appear at its default.

What the config leaves to the machine is recorded beside it, under ``devices``: the mesh
the run resolved (``mesh = ""`` takes every device there is), so a rerun on another device
count is refused like any other change of what a step computes.

Passing ``allow_change=True`` (``jaxdist train --allow-config-change``) continues anyway; the
change is appended to ``WORKDIR/config_changes.jsonl`` and the recorded config becomes the new
one, so the workdir says which steps ran under which settings.
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path
from typing import Any

import ml_collections

from jaxdist.run.checkpoint import newest_config_record
from jaxdist.run.config import ConfigError, base_config
from jaxdist.run.hooks import Hook

__all__ = [
    "ConfigChangedError",
    "check_rerun",
    "config_record",
    "record_note",
    "recorded_config",
]

CONFIG_FILE = "config.json"
CHANGES_FILE = "config_changes.jsonl"
# How long to train, how often to log, evaluate and checkpoint, what summaries and MLPerf
# submission fields are written, how the input is read, how long a stuck process is waited for
# and whether non-finite steps are skipped (a finite step computes the same either way): none
# of them changes the numbers a step computes.
SAFE_TO_CHANGE = (
    "max_steps",
    "skip_nonfinite_steps",
    "watchdog_s",
    "tensorboard",
    "log_every_steps",
    "eval_every_epochs",
    "checkpoint.every_steps",
    "checkpoint.keep",
    "checkpoint.async_save",
    "data.worker_count",
    "data.read_threads",
    "data.dali_threads",
    "data.prefetch_batches",
    "mlperf.org",
    "mlperf.platform",
    "mlperf.division",
    "mlperf.status",
    "mlperf.benchmark",
    "mlperf.cache_cleared",
)
MAY_GROW = ("num_epochs",)
RESOLVED = "devices"  # config.json's section for what the run resolved on its machine
MISSING = "<missing>"  # the value of a key that one of two configs does not have

Difference = tuple[str, Any, Any]  # (dotted key, recorded value, new value)


class ConfigChangedError(ConfigError):
    """A rerun's config differs from the one its workdir was started with."""


def flatten(config: ml_collections.ConfigDict | dict) -> dict[str, Any]:
    """Dotted key -> JSON value (tuples as lists) for every leaf of ``config``."""
    tree = config.to_dict() if isinstance(config, ml_collections.ConfigDict) else config
    tree = json.loads(json.dumps(tree))  # what config.json holds: tuples become lists

    def walk(node: dict, prefix: str) -> dict[str, Any]:
        leaves = {}
        for key, value in node.items():
            if isinstance(value, dict):
                leaves.update(walk(value, f"{prefix}{key}."))
            else:
                leaves[f"{prefix}{key}"] = value
        return leaves

    return walk(tree, "")


def differences(recorded: dict[str, Any], new: dict[str, Any]) -> list[Difference]:
    """Every key whose value differs (a key on one side only counts, as :data:`MISSING`)."""
    keys = sorted(set(recorded) | set(new))
    return [
        (k, recorded.get(k, MISSING), new.get(k, MISSING))
        for k in keys
        if recorded.get(k, MISSING) != new.get(k, MISSING)
    ]


def _as_recorded_now(recorded: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """A record of an older version, in what its fields mean now. ``data.num_classes`` was
    1000 whatever a dataset on disk held (the model took the dataset's count, as it does
    now); it now records that count. ``optimizer.eps`` was 0.0 unless set, which is what an
    unset eps (``None``) gives LARS now; SGD does not read it, and AdamW refused 0."""
    if recorded.get("optimizer.eps") == 0.0 and new.get("optimizer.eps") is None:
        recorded = {**recorded, "optimizer.eps": None}
    old_default = recorded.get("data.num_classes") == 1000
    if old_default and recorded.get("data.source") not in ("synthetic", None):
        return {**recorded, "data.num_classes": new.get("data.num_classes", 1000)}
    return recorded


def _is_safe(difference: Difference) -> bool:
    key, old, new = difference
    if key in SAFE_TO_CHANGE or _added_at_its_default(difference):
        return True
    numbers = isinstance(old, int | float) and isinstance(new, int | float)
    return key in MAY_GROW and numbers and new >= old


def _added_at_its_default(difference: Difference) -> bool:
    """A field the toolkit added after the run started, at its default: the run already did
    what the default says (its value was built in before it became a field)."""
    key, old, new = difference
    if old == MISSING and key.startswith(RESOLVED + "."):
        return True  # recorded by a toolkit that did not record it yet: nothing to compare
    defaults = _defaults()
    return old == MISSING and key in defaults and new == defaults[key]


@functools.cache
def _defaults() -> dict[str, Any]:
    return flatten(base_config())


def _describe(diffs: list[Difference]) -> str:
    return "; ".join(f"{key}: {old!r} -> {new!r}" for key, old, new in diffs)


def _has_progress(workdir: Path) -> bool:
    """Whether a run got far enough to leave checkpoints or metrics behind."""
    checkpoints = workdir / "checkpoints"
    has_checkpoints = checkpoints.is_dir() and any(checkpoints.iterdir())
    metrics = workdir / "metrics.jsonl"
    return has_checkpoints or (metrics.exists() and metrics.stat().st_size > 0)


def recorded_devices(workdir: str | Path) -> dict[str, Any]:
    """What a run in ``workdir`` resolved on its machine (config.json's ``devices``); empty
    when the workdir holds no run yet or its record is unreadable (checked later)."""
    path = Path(workdir) / CONFIG_FILE
    if not (path.exists() and _has_progress(Path(workdir))):
        return {}
    try:
        return dict(json.loads(path.read_text()).get(RESOLVED, {}))
    except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
        return {}


def config_record(config: ml_collections.ConfigDict, devices: dict[str, Any] | None) -> dict:
    """What ``config.json`` holds: the config, and the ``devices`` the run resolved."""
    return {**config.to_dict(), **({RESOLVED: dict(devices)} if devices else {})}


def recorded_config(workdir: str | Path) -> dict[str, Any] | None:
    """``config.json`` of ``workdir`` flattened, or ``None`` when it is missing or is not
    a config jaxdist wrote."""
    return _read_record(Path(workdir) / CONFIG_FILE)[0]


def _read_record(path: Path) -> tuple[dict[str, Any] | None, str]:
    """``(the record at path flattened, "")``, or ``(None, what was wrong with it)``: it was
    missing, damaged (cut short, overwritten) or not a config jaxdist wrote."""
    try:
        return flatten(json.loads(path.read_text())), ""
    except FileNotFoundError:
        return None, "was missing"
    except json.JSONDecodeError as err:
        return None, f"was damaged (not valid JSON: {err.msg} at line {err.lineno})"
    except UnicodeDecodeError:
        return None, "was damaged (not text)"
    except AttributeError:
        return None, "was not a config jaxdist wrote"


def record_note(workdir: str | Path, trained_with: dict[str, Any], step: int) -> str | None:
    """The line to print when ``config.json`` is missing or unreadable, or differs from the
    record the checkpoint of ``step`` was trained with in more than what a rerun may change
    (and so is rewritten from it), else ``None``."""
    found, why = _read_record(Path(workdir) / CONFIG_FILE)
    if found is not None and all(map(_is_safe, differences(flatten(trained_with), found))):
        return None
    what = why or "differed from what the checkpoints were trained with"
    return f"{CONFIG_FILE} {what}; compared with the checkpoint of step {step} and written from it"


def check_rerun(
    workdir: str | Path,
    config: ml_collections.ConfigDict,
    *,
    allow_change: bool = False,
    write: bool = True,
    devices: dict[str, Any] | None = None,
    trained_with: dict[str, Any] | None = None,
) -> list[Difference]:
    """Record ``config`` in a new workdir, or check it against the recorded one.

    Returns the differences that were accepted (empty on a first start or an unchanged
    rerun). Raises :class:`ConfigChangedError` for a difference outside
    :data:`SAFE_TO_CHANGE` and :data:`MAY_GROW` unless ``allow_change``. A workdir without
    checkpoints or metrics holds no run yet, so its recorded config is simply replaced.
    ``write=False`` checks without writing (the processes other than 0). ``devices`` is what
    the run resolved on this machine (``{"mesh": "data=8"}``), recorded and compared as the
    ``devices`` section.

    ``trained_with`` is the record saved in the workdir's newest checkpoint (:func:`config_record`):
    when given, ``config`` is compared against it rather than against ``config.json``, and a
    ``config.json`` that is missing or says otherwise is rewritten (:func:`record_note`
    says so in one line).
    """
    workdir = Path(workdir)
    path = workdir / CONFIG_FILE
    record = config_record(config, devices)
    new = flatten(record)
    accepted: list[Difference] = []
    compared = path.exists() and _has_progress(workdir)
    if trained_with is not None:
        recorded, compared = flatten(trained_with), True
    elif compared:
        try:
            recorded = flatten(json.loads(path.read_text()))
        except (json.JSONDecodeError, AttributeError) as err:
            raise ConfigChangedError(
                f"{path} is not a config written by jaxdist ({err}); move it aside to record "
                "this run's config afresh"
            ) from err
    if compared:
        accepted = differences(_as_recorded_now(recorded, new), new)
        refused = [d for d in accepted if not _is_safe(d)]
        if refused and not allow_change:
            holder = (
                f"the checkpoints in {workdir} were trained with"
                if trained_with is not None
                else f"{workdir} holds a run started with"
            )
            raise ConfigChangedError(
                f"{holder} another config ({_describe(refused)}); "
                "resuming would mix the two: use a new --workdir, or pass "
                "--allow-config-change to continue and record the change"
            )
    stale = trained_with is not None and recorded_config(workdir) != new
    if write and (accepted or not compared or stale):  # an unchanged rerun leaves it as it is
        workdir.mkdir(parents=True, exist_ok=True)
        if accepted:
            change = {
                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "changes": [{"key": k, "old": old, "new": v} for k, old, v in accepted],
            }
            with open(workdir / CHANGES_FILE, "a") as changes:
                changes.write(json.dumps(change) + "\n")
        tmp = path.with_suffix(".json.tmp")
        try:
            tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
            tmp.replace(path)
        except OSError as err:  # a failed write names the file (write() alone does not)
            raise OSError(err.errno, err.strerror, str(path)) from err
        finally:  # a failed write (no space, a file-size limit) leaves no partial file
            tmp.unlink(missing_ok=True)
    return accepted


class RerunCheck(Hook):
    """The rerun comparison as a hook of the training loop: before anything is read or written,
    the config is compared with what the workdir's newest checkpoint was trained with (else its
    ``config.json``) and a refused change stops the run (:func:`check_rerun`); once the
    checkpoint is read, the config is recorded (on process 0) and the accepted changes are
    printed and put in ``loop.config_changes`` for the event log.

    ``devices`` returns what the run resolved on this machine (the mesh, a pipeline's cut);
    ``progress`` prints one line.
    """

    def __init__(
        self,
        workdir: str | Path,
        config: ml_collections.ConfigDict,
        *,
        allow_change: bool,
        devices: Any,
        progress: Any,
        write: bool,
    ) -> None:
        self.workdir = Path(workdir)
        self.config = config
        self.allow_change = allow_change
        self.devices = devices
        self.progress = progress
        self.write = write
        self.changes: list[Difference] = []

    def _check(self, write: bool, trained_with: dict | None) -> list[Difference]:
        return check_rerun(
            self.workdir,
            self.config,
            allow_change=self.allow_change,
            write=write,
            devices=self.devices(),
            trained_with=trained_with,
        )

    def __enter__(self) -> RerunCheck:
        trained_with = newest_config_record(self.workdir / "checkpoints")
        self.changes = self._check(write=False, trained_with=trained_with)
        return self

    def resumed(self, loop: Any, meta: dict) -> None:
        trained_with = meta.get("config")  # absent from checkpoints of older versions
        note = trained_with and record_note(self.workdir, trained_with, loop.step)
        self._check(write=self.write, trained_with=trained_with)
        if note:
            self.progress(note, final=True)
        loop.config_changes = list(self.changes)

    def run_started(self, loop: Any) -> None:
        for key, old, new in self.changes:
            self.progress(f"config changed: {key} {old!r} -> {new!r}", final=True)

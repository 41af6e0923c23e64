"""The run's MLPerf event log, ``WORKDIR/events.log``: ``:::MLLOG`` lines in the format of
``mlperf_logging.mllog`` (written here, so a run does not need the package; its compliance
checker, ``pip install mlperf-logging``, reads them).

One run is one ``run_start`` ... ``run_stop``, however often it is resumed, so the log of an
uninterrupted ResNet-50 run passes the MLPerf compliance checker (ruleset 4.0.0, the last with
ResNet)::

    python -m mlperf_logging.compliance_checker --usage training --ruleset 4.0.0 WORKDIR/events.log

* When a workdir's run first starts: ``cache_clear``, ``init_start`` (when the trainer began
  building the run), the ``submission_*`` keys (``mlperf.*`` config fields), ``seed``,
  ``global_batch_size``, ``train_samples``, ``eval_samples``,
  ``gradient_accumulation_steps``, ``model_bn_span``, ``opt_name`` and the optimizer's
  ``lars_opt_*`` or ``sgd_opt_*`` keys, then ``init_stop`` and ``run_start``. Compiling
  happens at the first step, inside the timed run.
* A resumed run logs ``run_resumed`` with its step instead (not an MLPerf key: the checker
  skips it), then each accepted ``config_change``.
* Per epoch ``epoch_start`` and ``epoch_stop`` (``epoch_num`` 1-based); per evaluation
  ``eval_start``, ``eval_stop`` and ``eval_accuracy`` (``epoch_num`` fractional).
* ``run_stop`` with ``status`` ``success`` once top-1 reached ``target_accuracy``, otherwise
  ``aborted`` with a ``reason`` (the target missed, SIGTERM, or the error that stopped it).
"""

from __future__ import annotations

import inspect
import json
import math
import time
from pathlib import Path
from typing import Any

import jax

from jaxdist.run.from_config import optimizer_arguments
from jaxdist.run.hooks import Hook

__all__ = ["EventLog", "MlperfLog", "epoch_events", "now_ms"]


class keys:
    """The MLPerf keys and values this log writes (``mlperf_logging.mllog.constants``)."""

    CACHE_CLEAR = "cache_clear"
    INIT_START = "init_start"
    INIT_STOP = "init_stop"
    RUN_START = "run_start"
    RUN_STOP = "run_stop"
    EPOCH_START = "epoch_start"
    EPOCH_STOP = "epoch_stop"
    SUBMISSION_BENCHMARK = "submission_benchmark"
    SUBMISSION_ORG = "submission_org"
    SUBMISSION_DIVISION = "submission_division"
    SUBMISSION_STATUS = "submission_status"
    SUBMISSION_PLATFORM = "submission_platform"
    SEED = "seed"
    GLOBAL_BATCH_SIZE = "global_batch_size"
    TRAIN_SAMPLES = "train_samples"
    EVAL_SAMPLES = "eval_samples"
    GRADIENT_ACCUMULATION_STEPS = "gradient_accumulation_steps"
    MODEL_BN_SPAN = "model_bn_span"
    OPT_NAME = "opt_name"
    OPT_LR_WARMUP_EPOCHS = "opt_learning_rate_warmup_epochs"
    LARS_EPSILON = "lars_epsilon"
    LARS_OPT_LEARNING_RATE_WARMUP_EPOCHS = "lars_opt_learning_rate_warmup_epochs"
    EVAL_START = "eval_start"
    EVAL_STOP = "eval_stop"
    EVAL_ACCURACY = "eval_accuracy"
    RESNET = "resnet"
    SUCCESS = "success"
    ABORTED = "aborted"


_ROOT = Path(__file__).resolve().parents[2]  # call sites are recorded relative to it


def now_ms() -> int:
    """The event log's clock: milliseconds since the epoch."""
    return int(time.time() * 1000)


class EventLog:
    """Appends ``:::MLLOG`` lines to ``path``, one per event, flushed as written.
    ``started`` says whether the file already holds a ``run_start``: this workdir's run began
    before."""

    def __init__(self, path: Path) -> None:
        self.started = _has_run_start(path)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 -- open until close()

    def log(self, key: str, value: Any = None, time_ms: int | None = None, **metadata) -> None:
        """One event; ``*_start`` keys open an interval and ``*_stop`` keys close it. The
        metadata records the call site of ``MlperfLog.event``'s caller, as mllog does."""
        if key.endswith("_start"):
            event_type = "INTERVAL_START"
        elif key.endswith("_stop"):
            event_type = "INTERVAL_END"
        else:
            event_type = "POINT_IN_TIME"
        record = {
            "namespace": "",
            "time_ms": now_ms() if time_ms is None else time_ms,
            "event_type": event_type,
            "key": key,
            "value": value,
            "metadata": {**_call_site(), **metadata},
        }
        self._file.write(f":::MLLOG {json.dumps(record, default=_plain)}\n")
        self._file.flush()
        if key == keys.RUN_START:
            self.started = True

    def close(self) -> None:
        self._file.close()


def _call_site() -> dict[str, Any]:
    """File (relative to the repository) and line of the code that logged the event: three
    frames up, through :meth:`EventLog.log` and :meth:`MlperfLog.event`."""
    frame = inspect.currentframe()
    for _ in range(3):
        frame = frame.f_back if frame.f_back is not None else frame
    path = Path(frame.f_code.co_filename).resolve()
    if path.is_relative_to(_ROOT):
        path = path.relative_to(_ROOT)
    return {"file": str(path), "lineno": frame.f_lineno}


def _plain(value: Any) -> Any:
    """NumPy and JAX scalars and arrays as JSON values."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _has_run_start(path: Path) -> bool:
    if not path.is_file():
        return False
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if '"key": "run_start"' in line:
                try:
                    return json.loads(line.split(" ", 1)[1])["key"] == keys.RUN_START
                except (ValueError, KeyError, IndexError):
                    continue  # a line cut short by a kill
    return False


class MlperfLog(Hook):
    """``WORKDIR/events.log`` as a hook of the training loop (on process 0; a no-op elsewhere).

    ``parts`` is the run (:class:`~jaxdist.run.build.RunParts`), read for its workdir, for
    what it resolved (dataset sizes, the batch plan, the schedule, the task's headline metric,
    the target), for the recorded config of the header and for when building it began
    (MLPerf's ``init_start``).
    """

    def __init__(self, parts: Any, *, enabled: bool) -> None:
        self.parts = parts
        self.path = Path(parts.workdir) / "events.log"
        self.enabled = enabled
        self.running = False  # between run_start (or run_resumed) and run_stop
        self._log: EventLog | None = None
        self._target_logged = False

    def event(self, key: str, value: Any = None, time_ms: int | None = None, **metadata) -> None:
        """One event, stamped now unless ``time_ms`` says when it happened."""
        if self._log is None:
            return
        self._log.log(key, value, time_ms=time_ms, **metadata)
        if key in (keys.RUN_START, "run_resumed", keys.RUN_STOP):
            self.running = key != keys.RUN_STOP

    def __enter__(self) -> MlperfLog:
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            end_with_newline(self.path)  # after a kill mid-line
            self._log = EventLog(self.path)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.running:  # the event log never ends inside a run
            self.event(keys.RUN_STOP, status=keys.ABORTED, reason="stopped")
        if self._log is not None:
            self._log.close()
            self._log = None

    def run_started(self, loop: Any) -> None:
        """The events that open a run (its first start) or continue it (a resume), then each
        accepted ``config_change``."""
        if self._log is None:
            return
        if self._log.started:
            self.event("run_resumed", step=loop.step)
        else:
            for key, value, metadata in header_events(self.parts):
                self.event(key, value, **metadata)
            self.event(keys.INIT_STOP)
            self.event(keys.RUN_START)
        for key, old, new in loop.config_changes:
            self.event("config_change", key, old=old, new=new)

    def step_starting(self, loop: Any) -> None:
        epoch_events(self, self.parts.schedule, loop.step, loop.total_steps)

    def evaluating(self, loop: Any) -> None:
        self.event(keys.EVAL_START, epoch_num=loop.epoch)

    def evaluated(self, loop: Any) -> None:
        headline = loop.last_eval[self.parts.task.headline]
        self.event(keys.EVAL_STOP, epoch_num=loop.epoch)
        self.event(keys.EVAL_ACCURACY, headline, epoch_num=loop.epoch, step=loop.step)
        if loop.reached_target and not self._target_logged:
            self._target_logged = True
            self.event("target_reached", headline, epoch_num=loop.epoch)

    def run_ended(self, loop: Any, failure: str | None) -> None:
        """``run_stop``: ``aborted`` with the error that stopped the run, or the signal that
        preempted it; else, after the last ``epoch_stop``, ``success`` if the headline metric
        reached the target at an evaluation, otherwise ``aborted`` (MLPerf's status for a run
        that did not converge) naming the shortfall."""
        if not self.running:
            return
        where = {"step": loop.step, "epoch": loop.epoch}
        if failure is not None:
            self.event(keys.RUN_STOP, status=keys.ABORTED, reason=failure, **where)
            return
        if loop.stopped_by:
            reason = f"preempted ({loop.stopped_by})"
            self.event(keys.RUN_STOP, status=keys.ABORTED, reason=reason, **where)
            return
        epoch_events(self, self.parts.schedule, loop.step, loop.total_steps)
        if loop.reached_target:
            self.event(keys.RUN_STOP, status=keys.SUCCESS, **where)
            return
        task = self.parts.task
        side = "below" if task.higher_is_better else "above"
        target = self.parts.settings.target_accuracy
        shortfall = f"{task.headline} stayed {side} target_accuracy {target}"
        self.event(keys.RUN_STOP, status=keys.ABORTED, reason=shortfall, **where)


def end_with_newline(path: Path) -> None:
    """Finish a line cut short by a killed run, so the next record starts on its own line."""
    if path.exists() and path.stat().st_size:
        with open(path, "rb+") as f:
            f.seek(-1, 2)
            if f.read(1) != b"\n":
                f.write(b"\n")


def header_events(parts: Any) -> list[tuple[str, Any, dict]]:
    """``(key, value, metadata)`` of every event between ``cache_clear`` and ``init_stop``:
    the recorded config of ``parts`` (:class:`~jaxdist.run.build.RunParts`) and what it
    resolved; ``init_start`` is when building it began."""
    cfg, init_ms = parts.config, parts.init_ms
    final = parts.plans[-1]  # the plan of the recipe's batch_size
    group = cfg.model.get("bn_group_size") or parts.num_replicas
    events = [
        (keys.CACHE_CLEAR, bool(cfg.mlperf.cache_cleared), {"time_ms": init_ms}),
        (keys.INIT_START, None, {"time_ms": init_ms}),
        (keys.SUBMISSION_BENCHMARK, cfg.mlperf.benchmark or _benchmark(parts.task.name), {}),
        (keys.SUBMISSION_ORG, cfg.mlperf.org, {}),
        (keys.SUBMISSION_DIVISION, cfg.mlperf.division, {}),
        (keys.SUBMISSION_STATUS, cfg.mlperf.status, {}),
        (keys.SUBMISSION_PLATFORM, cfg.mlperf.platform or _platform(), {}),
        (keys.SEED, cfg.seed, {}),
        (keys.GLOBAL_BATCH_SIZE, cfg.batch_size, {"batch_ramp": [list(r) for r in cfg.batch_ramp]}),
        (keys.TRAIN_SAMPLES, parts.data.num_train_examples, {}),
        (keys.EVAL_SAMPLES, parts.data.num_eval_examples, {}),
        (keys.GRADIENT_ACCUMULATION_STEPS, final.accumulation_steps, {}),
        (keys.MODEL_BN_SPAN, final.per_device_batch * group, {}),
        (keys.OPT_NAME, cfg.optimizer.name, {}),
    ]
    # The schedule decays over epochs, whatever max_steps cuts off.
    steps_at = parts.schedule.steps_for_epochs
    decay_steps = steps_at(cfg.num_epochs) - steps_at(min(cfg.lr.warmup_epochs, cfg.num_epochs))
    events += [(k, v, {}) for k, v in _optimizer_keys(cfg, decay_steps)]
    return events


def _optimizer_keys(cfg: Any, decay_steps: int) -> list[tuple[str, Any]]:
    """The MLPerf hyperparameter keys of the recipe's optimizer; the polynomial-decay ones
    only when the schedule is one."""
    opt, lr = cfg.optimizer, cfg.lr
    if opt.name == "lars":
        prefix = "lars_opt"
        named = [
            (keys.LARS_EPSILON, float(optimizer_arguments(opt)["eps"])),
            (keys.LARS_OPT_LEARNING_RATE_WARMUP_EPOCHS, float(lr.warmup_epochs)),
        ]
    else:
        prefix = f"{opt.name}_opt"
        named = [(keys.OPT_LR_WARMUP_EPOCHS, float(lr.warmup_epochs))]
    named += [
        (f"{prefix}_base_learning_rate", float(lr.peak)),
        (f"{prefix}_momentum", float(opt.momentum)),
        (f"{prefix}_weight_decay", float(opt.weight_decay)),
    ]
    if lr.kind == "poly":
        named += [
            (f"{prefix}_end_learning_rate", float(lr.end_lr)),
            (f"{prefix}_learning_rate_decay_poly_power", float(lr.power)),
            (f"{prefix}_learning_rate_decay_steps", int(decay_steps)),
        ]
    return named


def _benchmark(model_name: str) -> str:
    """MLPerf's name for the task: ``resnet`` is ResNet-50 (on ImageNet); anything else is
    named by its model."""
    return keys.RESNET if model_name == "resnet50" else model_name


def _platform() -> str:
    """``<devices>x<device kind>``, e.g. ``256xTPU v5 lite``."""
    return f"{jax.device_count()}x{jax.devices()[0].device_kind}"


def epoch_events(log: Any, schedule: Any, step: int, total_steps: int) -> None:
    """At the start of (0-based) ``step``, and with ``step == total_steps`` at the end:
    ``epoch_stop`` for each epoch the previous step completed, then ``epoch_start`` for the
    epoch this step begins. A resumed run calls it for its first step, so an epoch is closed
    once even when the run stopped right after the step that completed it."""
    now = schedule.epoch_at(step)
    before = schedule.epoch_at(step - 1) if step > 0 else -1.0
    for ended in range(max(math.floor(before), 0), math.floor(now)):
        log.event(keys.EPOCH_STOP, epoch_num=ended + 1)
    if step < total_steps and math.floor(now) > math.floor(before):
        log.event(keys.EPOCH_START, epoch_num=math.floor(now) + 1)

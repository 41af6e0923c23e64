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

__all__ = ["EventLog", "epoch_events", "log_run_start", "log_run_stop", "now_ms"]


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
        metadata records the call site of ``RunLog.event``'s caller, as mllog does."""
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
    frames up, through this module's ``log`` and ``RunLog.event``."""
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


def log_run_start(log: Any, trainer: Any, step: int, changes: list, init_ms: int) -> None:
    """The events that open a run (its first start) or continue it (a resume from ``step``).

    ``log`` is the run's :class:`~jaxdist.run.log.RunLog`; ``trainer`` the
    :class:`~jaxdist.run.trainer.Trainer`, read for what it resolved (dataset sizes, the
    batch plan, the schedule); ``init_ms`` when it began building the run.
    """
    if log.resumes_run:
        log.event("run_resumed", step=step)
    else:
        for key, value, metadata in header_events(trainer, init_ms):
            log.event(key, value, **metadata)
        log.event(keys.INIT_STOP)
        log.event(keys.RUN_START)
    for key, old, new in changes:
        log.event("config_change", key, old=old, new=new)


def log_run_stop(log: Any, loop: Any, schedule: Any, total_steps: int, shortfall: str) -> None:
    """``run_stop`` of a run that ends without an error: ``aborted`` when SIGTERM stopped it;
    else, after the last ``epoch_stop``, ``success`` if the headline metric reached the target
    at an evaluation, otherwise ``aborted`` (MLPerf's status for a run that did not converge)
    with ``shortfall`` as the reason."""
    where = {"step": loop.step, "epoch": loop.epoch}
    if loop.preempted:
        reason = f"preempted ({loop.stopped_by or 'SIGTERM'})"
        log.event(keys.RUN_STOP, status=keys.ABORTED, reason=reason, **where)
        return
    epoch_events(log, schedule, loop.step, total_steps)
    if loop.reached_target:
        log.event(keys.RUN_STOP, status=keys.SUCCESS, **where)
    else:
        log.event(keys.RUN_STOP, status=keys.ABORTED, reason=shortfall, **where)


def header_events(trainer: Any, init_ms: int) -> list[tuple[str, Any, dict]]:
    """``(key, value, metadata)`` of every event between ``cache_clear`` and ``init_stop``."""
    cfg, final = trainer.config, trainer.plans[-1]  # the plan of the recipe's batch_size
    group = cfg.model.get("bn_group_size") or trainer.num_replicas
    events = [
        (keys.CACHE_CLEAR, bool(cfg.mlperf.cache_cleared), {"time_ms": init_ms}),
        (keys.INIT_START, None, {"time_ms": init_ms}),
        (keys.SUBMISSION_BENCHMARK, cfg.mlperf.benchmark or _benchmark(trainer.task.name), {}),
        (keys.SUBMISSION_ORG, cfg.mlperf.org, {}),
        (keys.SUBMISSION_DIVISION, cfg.mlperf.division, {}),
        (keys.SUBMISSION_STATUS, cfg.mlperf.status, {}),
        (keys.SUBMISSION_PLATFORM, cfg.mlperf.platform or _platform(), {}),
        (keys.SEED, cfg.seed, {}),
        (keys.GLOBAL_BATCH_SIZE, cfg.batch_size, {"batch_ramp": [list(r) for r in cfg.batch_ramp]}),
        (keys.TRAIN_SAMPLES, trainer.data.num_train_examples, {}),
        (keys.EVAL_SAMPLES, trainer.data.num_eval_examples, {}),
        (keys.GRADIENT_ACCUMULATION_STEPS, final.accumulation_steps, {}),
        (keys.MODEL_BN_SPAN, final.per_device_batch * group, {}),
        (keys.OPT_NAME, cfg.optimizer.name, {}),
    ]
    # The schedule decays over epochs, whatever max_steps cuts off.
    steps_at = trainer.schedule.steps_for_epochs
    decay_steps = steps_at(cfg.num_epochs) - steps_at(min(cfg.lr.warmup_epochs, cfg.num_epochs))
    events += [(k, v, {}) for k, v in _optimizer_keys(cfg, decay_steps)]
    return events


def _optimizer_keys(cfg: Any, decay_steps: int) -> list[tuple[str, Any]]:
    """The MLPerf hyperparameter keys of the recipe's optimizer; the polynomial-decay ones
    only when the schedule is one."""
    opt, lr = cfg.optimizer, cfg.lr
    if opt.name == "lars":
        prefix = "lars_opt"
        named = [(keys.LARS_EPSILON, float(opt.eps)),
                 (keys.LARS_OPT_LEARNING_RATE_WARMUP_EPOCHS, float(lr.warmup_epochs))]  # fmt: skip
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

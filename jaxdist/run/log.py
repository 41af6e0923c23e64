"""What a training run writes: ``metrics.jsonl``, the MLPerf ``events.log`` and progress
lines (rewritten in place on a terminal), on process 0 only."""

from __future__ import annotations

import errno
import json
import sys
from pathlib import Path
from typing import Any

from jaxdist.run.mlperf import EventLog
from jaxdist.run.tensorboard import SummaryWriter

__all__ = [
    "RunLog",
    "WorkdirError",
    "read_metrics",
]


class WorkdirError(RuntimeError):
    """The run's files cannot be created, read or written (permissions, a read-only or full
    file system, a file-size limit, a workdir that is a file): one line, exit 1."""

    exit_code = 1

    @classmethod
    def from_os_error(cls, err: OSError, workdir: Path) -> WorkdirError:
        """What failed, where, and the operating system's reason."""
        code = errno.errorcode.get(err.errno, "") if err.errno else ""
        reason = f"{err.strerror or err} [{code}]" if code else str(err.strerror or err)
        where = f"{err.filename}: " if err.filename else ""
        return cls(f"cannot use the workdir {workdir}: {where}{reason}")


def format_duration(seconds: float) -> str:
    """``3725`` -> ``"1h02m05s"``, ``65`` -> ``"1m05s"``, ``7.5`` -> ``"7s"``."""
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def describe_error(err: BaseException, limit: int | None = None) -> str:
    """``Type: first line of the message``, cut to ``limit`` characters if given (TensorStore's
    messages carry whole specs): the reason a log line gives."""
    lines = str(err).strip().splitlines()
    text = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
    return text if limit is None or len(text) <= limit else text[: limit - 3] + "..."


def read_metrics(workdir: str | Path) -> dict[str, list[dict]]:
    """``{"train": [...], "eval": [...]}`` records of a run's ``metrics.jsonl``, by step; for a
    step logged twice (a resumed run repeats the steps after its checkpoint) the later record
    wins. A line that is not a whole record is skipped with a warning on stderr."""
    path = Path(workdir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; expected the metrics of a `jaxdist train` run")
    by_kind: dict[str, dict[int, dict]] = {"train": {}, "eval": {}}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            by_kind.setdefault(record["kind"], {})[record["step"]] = record
        except (json.JSONDecodeError, KeyError, TypeError):
            print(
                f"jaxdist: warning: skipped {path}:{number}, not a whole metrics record "
                "(a run killed while writing leaves one)",
                file=sys.stderr,
            )
    return {kind: [records[s] for s in sorted(records)] for kind, records in by_kind.items()}


def last_eval(workdir: str | Path) -> dict[str, float]:
    """The last evaluation recorded in ``workdir``'s ``metrics.jsonl`` (empty if none)."""
    if not (Path(workdir) / "metrics.jsonl").is_file():
        return {}
    evals = read_metrics(workdir)["eval"]
    return {k: evals[-1][k] for k in ("top1", "top5") if k in evals[-1]} if evals else {}


def _end_with_newline(path: Path) -> None:
    """Finish a line cut short by a killed run, so the next record starts on its own line."""
    if path.exists() and path.stat().st_size:
        with open(path, "rb+") as f:
            f.seek(-1, 2)
            if f.read(1) != b"\n":
                f.write(b"\n")


class RunLog:
    """``metrics.jsonl``, ``events.log`` (MLPerf ``:::MLLOG`` lines, :mod:`jaxdist.run.mlperf`)
    and progress output; everything is a no-op on processes other than 0."""

    def __init__(self, workdir: Path, enabled: bool, tensorboard: str = "auto") -> None:
        self.enabled = enabled
        self.tty = sys.stdout.isatty()
        self.running = False  # between run_start and run_stop
        self._metrics = self._events = self._tensorboard = None
        if enabled:
            workdir.mkdir(parents=True, exist_ok=True)
            _end_with_newline(workdir / "metrics.jsonl")  # after a kill mid-line
            _end_with_newline(workdir / "events.log")
            self._metrics = open(workdir / "metrics.jsonl", "a")  # noqa: SIM115
            self._events = EventLog(workdir / "events.log")
            # JSONL is the record; TensorBoard's summaries are a view of it.
            self._tensorboard = SummaryWriter(workdir / "tensorboard", tensorboard)

    @property
    def resumes_run(self) -> bool:
        """Whether the workdir's event log already holds this run's ``run_start``."""
        return self._events is not None and self._events.started

    def event(
        self, key: str, value: Any = None, time_ms: int | None = None, **metadata: Any
    ) -> None:
        """One MLPerf event (:class:`~jaxdist.run.mlperf.EventLog`), stamped now unless
        ``time_ms`` says when it happened."""
        if not self.enabled:
            return
        self._events.log(key, value, time_ms=time_ms, **metadata)
        if key in ("run_start", "run_resumed", "run_stop"):
            self.running = key != "run_stop"

    def metrics(self, record: dict) -> None:
        if not self.enabled:
            return
        self._metrics.write(json.dumps(record) + "\n")
        self._metrics.flush()
        self._tensorboard.scalars(record)

    def hyperparameters(self, config: dict[str, Any]) -> None:
        """The run's flattened config, for TensorBoard's HParams dashboard."""
        if self.enabled:
            self._tensorboard.hyperparameters(config)

    def progress(self, line: str, final: bool = False) -> None:
        """One status line: rewritten in place on a terminal, appended otherwise."""
        if not self.enabled:
            return
        if self.tty:
            print("\r" + line.ljust(110), end="\n" if final else "", flush=True)
        else:
            print(line, flush=True)

    def close(self, aborted_by: str | None = None) -> None:
        """Close the files; a run still open gets its ``run_stop`` with status ``aborted`` and
        the reason, so the event log never ends inside a run."""
        if self.running:
            self.event("run_stop", status="aborted", reason=aborted_by or "stopped")
        for f in (self._metrics, self._events):
            if f is not None:
                f.close()
        if self._tensorboard is not None:
            self._tensorboard.close()

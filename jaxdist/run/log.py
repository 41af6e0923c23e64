"""What a training run writes itself: ``metrics.jsonl`` and progress lines (rewritten in place
on a terminal), on process 0 only. The event log and TensorBoard's summaries are hooks of the
loop (:mod:`jaxdist.run.hooks`)."""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path

from jaxdist.run.mlperf import end_with_newline

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
    """The task's metrics at the last evaluation recorded in ``workdir``'s ``metrics.jsonl``
    (empty if none)."""
    if not (Path(workdir) / "metrics.jsonl").is_file():
        return {}
    evals = read_metrics(workdir)["eval"]
    bookkeeping = ("kind", "step", "epoch")
    return {k: v for k, v in evals[-1].items() if k not in bookkeeping} if evals else {}


class RunLog:
    """``metrics.jsonl`` and progress output; everything is a no-op on processes other than 0.
    Files are opened by :meth:`open`, once the run's hooks have checked the workdir."""

    def __init__(self, workdir: Path, enabled: bool) -> None:
        self.workdir = workdir
        self.enabled = enabled
        # mpirun (Open MPI) gives its processes a terminal even when its own output goes to
        # a file, where lines rewritten in place would run together: append there.
        self.tty = sys.stdout.isatty() and "OMPI_COMM_WORLD_SIZE" not in os.environ
        self._metrics = None

    def open(self) -> None:
        if self.enabled:
            self.workdir.mkdir(parents=True, exist_ok=True)
            end_with_newline(self.workdir / "metrics.jsonl")  # after a kill mid-line
            self._metrics = open(self.workdir / "metrics.jsonl", "a")  # noqa: SIM115

    def metrics(self, record: dict) -> None:
        if self._metrics is not None:
            self._metrics.write(json.dumps(record) + "\n")
            self._metrics.flush()

    def progress(self, line: str, final: bool = False) -> None:
        """One status line: rewritten in place on a terminal, appended otherwise."""
        if not self.enabled:
            return
        if self.tty:
            print("\r" + line.ljust(110), end="\n" if final else "", flush=True)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None

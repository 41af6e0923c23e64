"""What a training run writes: ``metrics.jsonl``, an MLPerf-style ``events.log`` and progress
lines (rewritten in place on a terminal), on process 0 only."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["RunLog", "format_duration", "last_eval"]


def format_duration(seconds: float) -> str:
    """``3725`` -> ``"1h02m05s"``, ``65`` -> ``"1m05s"``, ``7.5`` -> ``"7s"``."""
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def last_eval(workdir: Path) -> dict[str, float]:
    """The last evaluation recorded in ``workdir``'s ``metrics.jsonl`` (empty if none)."""
    path = Path(workdir) / "metrics.jsonl"
    found: dict[str, float] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line) if line.strip() else {}
            except json.JSONDecodeError:
                continue  # a line cut short by a killed run
            if record.get("kind") == "eval":
                found = {k: record[k] for k in ("top1", "top5") if k in record}
    return found


def _end_with_newline(path: Path) -> None:
    """Finish a line cut short by a killed run, so the next record starts on its own line."""
    if path.exists() and path.stat().st_size:
        with open(path, "rb+") as f:
            f.seek(-1, 2)
            if f.read(1) != b"\n":
                f.write(b"\n")


class RunLog:
    """``metrics.jsonl``, ``events.log`` (MLPerf ``:::MLLOG`` lines) and progress output;
    everything is a no-op on processes other than 0."""

    def __init__(self, workdir: Path, enabled: bool) -> None:
        self.enabled = enabled
        self.tty = sys.stdout.isatty()
        self.running = False  # between run_start and run_stop
        self._metrics = self._events = self._tensorboard = None
        if enabled:
            workdir.mkdir(parents=True, exist_ok=True)
            _end_with_newline(workdir / "metrics.jsonl")  # after a kill mid-line
            _end_with_newline(workdir / "events.log")
            self._metrics = open(workdir / "metrics.jsonl", "a")  # noqa: SIM115
            self._events = open(workdir / "events.log", "a")  # noqa: SIM115
            try:  # TensorBoard only if a writer is installed; JSONL is the record either way.
                from tensorboardX import SummaryWriter

                self._tensorboard = SummaryWriter(str(workdir / "tensorboard"))
            except ImportError:
                pass

    def event(self, key: str, value: Any = None, **metadata: Any) -> None:
        """One MLPerf-style event line with a millisecond timestamp."""
        if not self.enabled:
            return
        kind = "INTERVAL_START" if key.endswith("_start") else "POINT_IN_TIME"
        if key.endswith("_stop"):
            kind = "INTERVAL_END"
        record = {
            "namespace": "",
            "time_ms": int(time.time() * 1000),
            "event_type": kind,
            "key": key,
            "value": value,
            "metadata": metadata,
        }
        self._events.write(":::MLLOG " + json.dumps(record) + "\n")
        self._events.flush()
        if key in ("run_start", "run_stop"):
            self.running = key == "run_start"

    def metrics(self, record: dict) -> None:
        if not self.enabled:
            return
        self._metrics.write(json.dumps(record) + "\n")
        self._metrics.flush()
        if self._tensorboard is not None:
            for key, value in record.items():
                if key not in ("kind", "step") and isinstance(value, float | int):
                    self._tensorboard.add_scalar(f"{record['kind']}/{key}", value, record["step"])

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

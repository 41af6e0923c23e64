"""TensorBoard summaries of a run, beside its ``metrics.jsonl``: ``WORKDIR/tensorboard``.

Per logged step the train record's scalars (``train/loss``, ``train/accuracy``, ``train/lr``,
``train/batch_size``, ``train/<unit>_per_sec``, ...) and per evaluation the task's metrics
(``eval/top1``, ``eval/top5`` for image classification), at their step; once per run start the
resolved config as hyperparameters (the HParams dashboard, against the headline metric). The writer is ``tensorboardX``, installed by ``pip install
'jaxdist[tensorboard]'``. The config's ``tensorboard`` field chooses: ``"auto"`` writes when
the writer is installed, ``"on"`` requires it, ``"off"`` never writes.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from jaxdist.run.config import ConfigError
from jaxdist.run.hooks import Hook

__all__ = ["SummaryWriter", "TensorBoard", "check_mode"]

MODES = ("auto", "on", "off")
EXTRA = "pip install 'jaxdist[tensorboard]'"


def _installed() -> bool:
    return importlib.util.find_spec("tensorboardX") is not None


def check_mode(mode: str) -> None:
    """Refuse a mode other than :data:`MODES`, or ``"on"`` without the writer installed."""
    if mode not in MODES:
        raise ConfigError(f"tensorboard must be one of {MODES}, got {mode!r}")
    if mode == "on" and not _installed():
        raise ConfigError(
            f"tensorboard='on' needs the TensorBoard writer (tensorboardX), which is not "
            f"installed: {EXTRA}"
        )


class SummaryWriter:
    """Scalars and hyperparameters into ``directory``; a no-op when ``mode`` says not to
    write or (``"auto"``) the writer is not installed."""

    def __init__(self, directory: Path, mode: str = "auto") -> None:
        check_mode(mode)
        self._writer = None
        if mode == "on" or (mode == "auto" and _installed()):
            from tensorboardX import SummaryWriter as Writer

            self._writer = Writer(str(directory))

    def scalars(self, record: dict[str, Any]) -> None:
        """Every number of a ``metrics.jsonl`` record, as ``<kind>/<key>`` at its step."""
        if self._writer is None:
            return
        for key, value in record.items():
            if key not in ("kind", "step") and isinstance(value, int | float | bool):
                self._writer.add_scalar(f"{record['kind']}/{key}", float(value), record["step"])

    def hyperparameters(self, config: dict[str, Any], metric: str = "eval/top1") -> None:
        """The flattened config (dotted keys) for the HParams dashboard, against ``metric``;
        values other than numbers, strings and booleans are written as their text."""
        if self._writer is None:
            return
        from tensorboardX.summary import hparams

        values = {
            k: v if isinstance(v, int | float | str | bool) else repr(v) for k, v in config.items()
        }
        for summary in hparams(values, {metric: 0.0}):
            self._writer.file_writer.add_summary(summary)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


class TensorBoard(Hook):
    """The summaries as a hook of the training loop: every ``metrics.jsonl`` record as scalars,
    the flattened ``config`` as hyperparameters at the run's start, against ``eval/<headline>``.
    Writes nothing unless ``enabled`` (process 0)."""

    @classmethod
    def check_settings(
        cls, config: Any, total_steps: int, profile_steps: tuple[int, int] | None
    ) -> None:
        check_mode(config.tensorboard)

    def __init__(
        self, workdir: Path, mode: str, *, enabled: bool, config: dict[str, Any], headline: str
    ) -> None:
        check_mode(mode)
        self.directory = Path(workdir) / "tensorboard"
        self.mode = mode if enabled else "off"
        self.config = config
        self.headline = headline
        self.writer: SummaryWriter | None = None

    def __enter__(self) -> TensorBoard:
        self.writer = SummaryWriter(self.directory, self.mode)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.writer is not None:
            self.writer.close()

    def run_started(self, loop: Any) -> None:
        self.writer.hyperparameters(self.config, f"eval/{self.headline}")

    def recorded(self, loop: Any, record: dict) -> None:
        self.writer.scalars(record)

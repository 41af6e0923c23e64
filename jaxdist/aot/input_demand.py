"""What a plan's training step asks of a host's input pipeline, in images per second.

``jaxdist data bench --plan PLAN.json`` sets a loader's measured rate against it: how many of
a host's accelerators that rate keeps busy at the step time ``jaxdist plan`` predicts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from jaxdist.aot.chips import CHIPS

__all__ = ["Demand", "demand_of_plan"]


@dataclass(frozen=True)
class Demand:
    """What a plan's training step asks of one host's input pipeline."""

    chip: str
    chips_per_host: int
    per_chip_batch: int
    step_seconds: float

    @property
    def images_per_s_per_chip(self) -> float:
        return self.per_chip_batch / self.step_seconds

    def chips_fed(self, images_per_s: float) -> float:
        """How many chips ``images_per_s`` keeps busy (at most the host's)."""
        return min(self.chips_per_host, images_per_s / self.images_per_s_per_chip)


def demand_of_plan(path: str | Path) -> Demand:
    """The last batch stage of a ``jaxdist plan --json`` output (the one most steps run)."""
    try:
        plan = json.loads(Path(path).read_text())
        stage = plan["stages"][-1]
        chip_name = plan["chip"]
        per_chip, step = int(stage["per_chip_batch"]), float(stage["step_seconds"]["total"])
    except FileNotFoundError as err:
        raise ValueError(f"plan file {path} not found") from err
    except (json.JSONDecodeError, KeyError, IndexError, TypeError) as err:
        raise ValueError(
            f"{path} is not the output of `jaxdist plan --json` (expected chip, stages[-1] "
            f"with per_chip_batch and step_seconds.total; {type(err).__name__}: {err})"
        ) from err
    chips = [chip for chip in CHIPS.values() if chip.name == chip_name]
    if not chips:
        raise ValueError(f"{path}: chip {chip_name!r} is not in jaxdist's chip table")
    return Demand(chip_name, chips[0].chips_per_host, per_chip, step)

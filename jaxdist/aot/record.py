"""The published MLPerf ResNet-50 record as a planner reads it, and the time model fitted on it.

``benchmarks/mlperf_record.py`` turns the result logs into a table of scored submissions
(:func:`generation_of` names each system's accelerator generation);
``benchmarks/plan_validation.py`` fits :class:`RecordFit` on it, scores it leave-one-out, and
keeps the fit beside this module, where ``jaxdist plan`` reads it (:func:`record_time`) to
say what the record predicts for a ResNet-50 recipe on the chips it plans for.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from jaxdist.aot import rcp
from jaxdist.aot.rcp import IMAGENET_TRAIN_IMAGES

__all__ = [
    "Generation",
    "RecordFit",
    "fit",
    "fittable",
    "generation_of",
    "record_time",
    "reference_epochs",
    "stored_fit",
    "why_unusable",
]

# (pattern in the accelerator's described name, generation), first match wins: the form
# factor is part of the generation where it changes the chip's power and links (an A100 on
# PCIe runs at 250-300 W without NVSwitch).
_GENERATIONS = (
    (r"h100.*pcie", "h100-pcie"),
    (r"h100", "h100"),
    (r"a100.*pcie", "a100-pcie"),
    (r"a100", "a100"),
    (r"v100", "v100"),
    (r"a30", "a30"),
    (r"l40s", "l40s"),
    (r"l40", "l40"),
    (r"\bl4\b", "l4"),
    (r"a40", "a40"),
    (r"a10g", "a10g"),
    (r"a5000", "rtx-a5000"),
    (r"gaudi ?2", "gaudi2"),
    (r"gaudi", "gaudi"),
    (r"bow", "ipu-bow"),
    (r"ipu|gc200", "ipu"),
    (r"ascend ?910", "ascend910"),
    (r"tpu[- ]?v?3", "v3"),
    (r"tpu[- ]?v?4", "v4"),
)


def generation_of(accelerator: str, system: str = "") -> str:
    """The generation of an accelerator as a system description names it (``"NVIDIA
    A100-SXM4-80GB (400W)"`` -> ``"a100"``). A bare ``"TPU"`` takes its version from the
    system's name (``tpu-v4-512-TF``). An unknown name is returned lower-cased."""
    name = accelerator.lower()
    if name.strip() in ("tpu", ""):
        name = f"{name} {system.lower()}"
    for pattern, generation in _GENERATIONS:
        if re.search(pattern, name):
            return generation
    return name.strip()


def host_network_of(description: str) -> str:
    """The class of the network between hosts, from a description's ``host_networking``:
    ``infiniband``, ``omni-path``, ``ethernet``, or ``""`` when it does not say."""
    text = description.lower()
    if re.search(r"\bib\b|infiniband|hdr|edr|ndr", text):
        return "infiniband"
    if "omni-path" in text:
        return "omni-path"
    if re.search(r"ethernet|gbe|\d+g\b", text):
        return "ethernet"
    return ""


# ---------------------------------------------------------------------------------------------
# The time model fitted on the record.

# A generation is fitted only with at least this many scored submissions: two numbers of its
# own, and one held out at a time, need a few more than two.
MIN_SUBMISSIONS = 5
FIT_FILE = Path(__file__).with_name("data") / "mlperf_record_fit.json"


@dataclass(frozen=True)
class Generation:
    """One generation's fitted figures and the part of the record behind them."""

    images_per_second: float  # per chip, at a per-chip batch large enough to hide overheads
    step_overhead: float  # seconds each step costs whatever its batch
    submissions: int
    chips: tuple[int, int]  # the smallest and largest system fitted on
    per_chip_batch: tuple[float, float]


@dataclass(frozen=True)
class RecordFit:
    """The time model fitted on scored MLPerf ResNet-50 submissions::

        seconds = epochs x ceil(1,281,167 / global batch)
                  x (per-chip batch / images_per_second + step_overhead)

    ``epochs`` is what a planner knows before the run: MLPerf's reference epochs at the
    global batch (:func:`jaxdist.aot.rcp.epochs_to_converge`). A step is the per-chip batch
    at the generation's steady rate plus a fixed cost (launches, synchronisation and the
    gradients' exposed all-reduce, which do not shrink with the batch). Evaluations and a
    run's warm-up are inside these two figures: a fixed time per run fitted beside them came
    out at zero.
    """

    generations: dict[str, Generation]
    source: str  # what it was fitted on

    def seconds(self, generation: str, chips: int, global_batch: int, epochs: float) -> float:
        fitted = self.generations[generation]
        return float(
            _seconds(epochs, chips, global_batch, fitted.images_per_second, fitted.step_overhead)
        )

    def predict(self, submission: dict) -> float:
        """A submission's time (a row of ``benchmarks/mlperf_record.py``'s table) at MLPerf's
        reference epochs at its batch."""
        batch = submission["global_batch"]
        return self.seconds(
            submission["generation"], submission["chips"], batch, reference_epochs(batch)
        )

    def to_json(self) -> dict:
        return {
            "source": self.source,
            "generations": {name: asdict(g) for name, g in self.generations.items()},
        }

    @classmethod
    def from_json(cls, data: dict) -> RecordFit:
        generations = {
            name: Generation(
                **{**g, "chips": tuple(g["chips"]), "per_chip_batch": tuple(g["per_chip_batch"])}
            )
            for name, g in data["generations"].items()
        }
        return cls(generations, data["source"])


def _seconds(epochs, chips, global_batch, images_per_second, step_overhead):
    """The model's formula (:class:`RecordFit`), on numbers or numpy arrays alike."""
    steps = epochs * np.ceil(IMAGENET_TRAIN_IMAGES / global_batch)
    return steps * (global_batch / chips / images_per_second + step_overhead)


def reference_epochs(global_batch: int) -> float | None:
    """MLPerf's reference epochs at ``global_batch``; None beyond the table's largest batch."""
    return rcp.epochs_to_converge(int(global_batch)).epochs


def why_unusable(submission: dict) -> str:
    """Why no fit can use or predict ``submission``, whatever its generation; ``""`` when
    one can: closed division, scored, with reference epochs at its batch."""
    if submission["division"] != "closed":
        return f"{submission['division']} division (its own model or epochs)"
    if submission["scored_seconds"] is None:
        return (
            f"no score ({submission['runs']} runs, {submission['successful_runs']} "
            "reached the target; MLPerf keeps the middle three of five)"
        )
    if reference_epochs(submission["global_batch"]) is None:
        return f"global batch {submission['global_batch']:,} beyond the reference points"
    return ""


def fittable(submissions: Sequence[dict]) -> list[dict]:
    """The submissions a fit can use (:func:`why_unusable`), of a generation with at least
    :data:`MIN_SUBMISSIONS` of them."""
    usable = [s for s in submissions if not why_unusable(s)]
    counts: dict[str, int] = {}
    for s in usable:
        counts[s["generation"]] = counts.get(s["generation"], 0) + 1
    return [s for s in usable if counts[s["generation"]] >= MIN_SUBMISSIONS]


def fit(submissions: Sequence[dict], source: str = "") -> RecordFit:
    """Least squares of log(predicted / scored time) over ``submissions`` (each a row of
    ``benchmarks/mlperf_record.py``'s table: generation, chips, global_batch,
    scored_seconds): two figures per generation."""
    from scipy.optimize import least_squares

    names = sorted({s["generation"] for s in submissions})
    index = np.array([names.index(s["generation"]) for s in submissions])
    chips = np.array([s["chips"] for s in submissions], dtype=float)
    batch = np.array([s["global_batch"] for s in submissions], dtype=float)
    epochs = np.array([reference_epochs(b) for b in batch])
    scored = np.array([s["scored_seconds"] for s in submissions], dtype=float)
    g = len(names)

    def log_ratio(p: np.ndarray) -> np.ndarray:
        rate, overhead = np.exp(p[:g]), np.exp(p[g:])
        return np.log(_seconds(epochs, chips, batch, rate[index], overhead[index]) / scored)

    start = np.concatenate([np.full(g, math.log(2000.0)), np.full(g, math.log(3e-3))])
    p = least_squares(log_ratio, start).x
    generations = {}
    for i, name in enumerate(names):
        mine = [s for s in submissions if s["generation"] == name]
        generations[name] = Generation(
            images_per_second=float(math.exp(p[i])),
            step_overhead=float(math.exp(p[g + i])),
            submissions=len(mine),
            chips=(min(s["chips"] for s in mine), max(s["chips"] for s in mine)),
            per_chip_batch=(
                min(s["global_batch"] / s["chips"] for s in mine),
                max(s["global_batch"] / s["chips"] for s in mine),
            ),
        )
    return RecordFit(generations, source)


def stored_fit() -> RecordFit | None:
    """The fit ``benchmarks/plan_validation.py`` keeps beside this module; None if absent."""
    try:
        return RecordFit.from_json(json.loads(FIT_FILE.read_text()))
    except FileNotFoundError:
        return None


def record_time(generation: str, chips: int, global_batch: int) -> dict:
    """What the record says of a ResNet-50 run: the stored fit's time at MLPerf's reference
    epochs, the generation's figures behind it, and ``outside``: why the run lies beyond
    what the record covers (empty when it does not). ``seconds`` is None when the fit has
    nothing for ``generation`` or the batch has no reference epochs."""
    record = stored_fit()
    epochs = reference_epochs(global_batch)
    answer = {"generation": generation, "epochs": epochs, "seconds": None, "outside": []}
    if record is None:
        answer["outside"].append(f"no fit at {FIT_FILE}: run python benchmarks/plan_validation.py")
        return answer
    answer["source"] = record.source
    fitted = record.generations.get(generation)
    if fitted is None:
        answer["outside"].append(
            f"no scored MLPerf submission of {generation} "
            f"(fitted: {', '.join(sorted(record.generations))})"
        )
        return answer
    answer["fitted"] = asdict(fitted)
    if epochs is None:
        answer["outside"].append(
            f"global batch {global_batch:,} is beyond MLPerf's reference points"
        )
        return answer
    low, high = fitted.chips
    if not low <= chips <= high:
        answer["outside"].append(
            f"{chips:,} chips: the {generation} submissions run {low:,} to {high:,}"
        )
    per_chip = global_batch / chips
    if not fitted.per_chip_batch[0] <= per_chip <= fitted.per_chip_batch[1]:
        answer["outside"].append(
            f"{per_chip:g} images per chip: the {generation} submissions "
            f"run {fitted.per_chip_batch[0]:g} to "
            f"{fitted.per_chip_batch[1]:g}"
        )
    answer["seconds"] = record.seconds(generation, chips, global_batch, epochs)
    return answer

"""Published ResNet-50 training runs, and the time model set against them.

The time model (:mod:`jaxdist.aot.predict`) has one free number, the share of peak FLOP/s a
step reaches, and it differs between chip generations. Each generation with MLPerf runs gets
its own, fitted on them (:func:`fit_by_generation`); a generation without any uses the one
calibrated on :data:`CALIBRATION_RUN`. ``python benchmarks/plan_validation.py --published`` fits both,
writes the calibration this module reads (``calibration.json`` beside it), and prints the
tables of docs/planning.md: every run predicted, and the MLPerf runs scored leave-one-out.

A run is predicted by the same step rule as a plan (:func:`jaxdist.aot.predict.step_time`)
from ResNet-50's own figures, read from a compiled step (:class:`ModelFacts`: FLOPs per
image, the gradient buckets, the share of their communication time the wait-free step hides
behind compute, :mod:`jaxdist.aot.timeline`),
the chip's peak, and each bucket's all-reduce as the run made it, on the run's links: the TPU
compiler's over the torus, NCCL's ring or tree between GPU hosts, or the schedule a paper
describes. MLPerf times run from the start of training to the evaluation that reaches
75.9% top-1 (evaluations included, start-up not); the papers' times are training time as
they define it. The model counts steps only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from jaxdist.aot.chips import CHIPS, network_for
from jaxdist.aot.predict import communication_seconds, step_time
from jaxdist.aot.rcp import IMAGENET_TRAIN_IMAGES

__all__ = [
    "PUBLISHED_RUNS",
    "PublishedRun",
    "calibrate",
    "fit_by_generation",
    "fit_efficiency",
    "gradient_bucket_seconds",
    "leave_one_out",
    "leave_one_out_by_generation",
    "predict_run",
]

# All-reduces a run made with the compiler's or the vendor's own collective, not a schedule of
# jaxdist's family: the TPU compiler's on the torus, and NVIDIA's NCCL.
LIBRARY_ALLREDUCES = ("xla", "nccl")
CALIBRATION_FILE = Path(__file__).with_name("calibration.json")
_MLPERF = "https://github.com/mlcommons/training_results_v"
_GBIT = 1e9 / 8


@dataclass(frozen=True)
class PublishedRun:
    """One published run: who, on what, how big a batch, how long.

    ``batches`` is ``((until_epoch, global_batch), ...)``: one entry for a fixed batch, more
    for batch-size control. ``inner`` chips share the fast links (a node's NVLink, or a row
    of a TPU torus); the ``chips // inner`` groups talk over ``host_network`` bytes/s per
    chip (None: the fast links, as in a TPU pod). ``allreduce`` is how the gradients were
    averaged: ``"xla"`` (the TPU compiler's all-reduce on the torus), ``"nccl"`` (NVIDIA's
    library), or the schedule of jaxdist's family that the paper describes. ``precision`` is
    ``"16-bit"`` (bf16 or fp16 compute, 16-bit gradients on the wire for GPU runs) or
    ``"fp32"``.
    """

    name: str
    chip: str
    chips: int
    batches: tuple[tuple[float, int], ...]
    seconds: float
    inner: int
    allreduce: str
    host_network: float | None
    precision: str
    source: str

    @property
    def epochs(self) -> float:
        return self.batches[-1][0]

    @property
    def gradient_itemsize(self) -> int:
        gpu_half = self.precision == "16-bit" and not CHIPS[self.chip].torus_dims
        return 2 if gpu_half else 4


@dataclass(frozen=True)
class ModelFacts:
    """What a compiled ResNet-50 step says, per image and per chip."""

    flops_per_image: float
    gradient_bytes: float  # float32 gradients of every parameter
    bucket_bytes: tuple[float, ...]  # the same, as the step's gradient buckets
    # Share of the gradient communication's time the walked step hid behind compute.
    gradient_hidden_fraction: float
    measured_on: str


def _mlperf(version: str, path: str) -> str:
    return f"{_MLPERF}{version}/tree/master/{path}"


PUBLISHED_RUNS: tuple[PublishedRun, ...] = (
    PublishedRun(
        "Goyal et al. 2017",
        "p100",
        256,
        ((90, 8192),),
        3600,
        8,
        "hierarchical",
        50 / 8 * _GBIT,
        "fp32",
        "https://arxiv.org/abs/1706.02677",
    ),
    PublishedRun(
        "Mikami et al. 2018 (v1)",
        "v100",
        2176,
        ((5, 34816), (90, 69632)),
        224,
        4,
        "torus2d",
        50 * _GBIT,
        "16-bit",
        "https://arxiv.org/abs/1811.05233v1",
    ),
    PublishedRun(
        "MLPerf v0.6 Google TPU v3",
        "v3",
        1024,
        ((72, 32768),),
        76.9,
        32,
        "xla",
        None,
        "16-bit",
        _mlperf("0.6", "Google/results/tpu-v3-2048/resnet"),
    ),
    PublishedRun(
        "MLPerf v0.6 NVIDIA DGX-2H",
        "v100",
        1536,
        ((90, 59904),),
        79.9,
        16,
        "nccl",
        1000 / 16 * _GBIT,
        "16-bit",
        _mlperf("0.6", "NVIDIA/results/dgx2h_n96_ngc19.05_mxnet/resnet"),
    ),
    PublishedRun(
        "MLPerf v0.7 Google TPU v3 (JAX)",
        "v3",
        4096,
        ((92, 65536),),
        28.3,
        32,
        "xla",
        None,
        "16-bit",
        _mlperf("0.7", "Google/results/tpu-v3-8192-JAX/resnet"),
    ),
    PublishedRun(
        "MLPerf v0.7 Google TPU v4",
        "v4",
        256,
        ((44, 8192),),
        109.2,
        16,
        "xla",
        None,
        "16-bit",
        _mlperf("0.7", "Google/results/tpu-v4-512-TF/resnet"),
    ),
    PublishedRun(
        "MLPerf v0.7 NVIDIA DGX A100",
        "a100",
        768,
        ((59, 34560),),
        63.5,
        8,
        "nccl",
        200 * _GBIT,
        "16-bit",
        _mlperf("0.7", "NVIDIA/results/dgxa100_n96_ngc20.06_mxnet/resnet"),
    ),
    PublishedRun(
        "MLPerf v1.0 Google TPU v4",
        "v4",
        3456,
        ((78, 55296),),
        13.7,
        24,
        "xla",
        None,
        "16-bit",
        _mlperf("1.0", "Google/results/tpu-v4-6912-TF/resnet"),
    ),
    PublishedRun(
        "MLPerf v2.0 Google TPU v4",
        "v4",
        4096,
        ((60, 32768),),
        11.4,
        16,
        "xla",
        None,
        "16-bit",
        _mlperf("2.0", "Google/results/cloud-tpu-v4-8192-TF/resnet"),
    ),
    PublishedRun(
        "MLPerf v2.0 NVIDIA DGX A100",
        "a100",
        4216,
        ((86, 67456),),
        19.1,
        8,
        "nccl",
        200 * _GBIT,
        "16-bit",
        _mlperf("2.0", "NVIDIA/results/dgxa100_n527_ngc22.04_mxnet/resnet"),
    ),
    PublishedRun(
        "MLPerf v3.0 NVIDIA DGX H100",
        "h100",
        64,
        ((35, 3200),),
        159.8,
        8,
        "nccl",
        400 * _GBIT,
        "16-bit",
        _mlperf("3.0", "NVIDIA/results/dgxh100_n8_ngc23.04_mxnet/resnet"),
    ),
    PublishedRun(
        "MLPerf v3.0 CoreWeave HGX H100",
        "h100",
        3584,
        ((77, 57344),),
        11.0,
        8,
        "nccl",
        400 * _GBIT,
        "16-bit",
        _mlperf("3.0", "NVIDIA_CoreWeave/results/coreweave_hgxh100_n448_ngc23.04_mxnet/resnet"),
    ),
    PublishedRun(
        "MLPerf v4.0 NVIDIA DGX H100",
        "h100",
        2528,
        ((68, 40448),),
        13.7,
        8,
        "nccl",
        400 * _GBIT,
        "16-bit",
        _mlperf("4.0", "NVIDIA/results/eos_n316_ngc24.04_mxnet/resnet"),
    ),
)
# A TPU run at a moderate per-chip batch (32 images), verified from its result logs.
CALIBRATION_RUN = "MLPerf v0.7 Google TPU v4"
# The runs scored leave-one-out: every MLPerf closed result above (the papers are shown
# beside them, unscored), and the temporal split's first rounds.
MLPERF_RUNS = tuple(run.name for run in PUBLISHED_RUNS if run.name.startswith("MLPerf"))
EARLY_ROUNDS = ("MLPerf v0.6", "MLPerf v0.7", "MLPerf v1.0")


def predict_run(run: PublishedRun, facts: ModelFacts, efficiency: float) -> dict:
    """The time model's step time, images/s and time-to-train for ``run``: per batch stage,
    :func:`~jaxdist.aot.predict.step_time` of compute at ``efficiency`` of peak and the
    compiled step's gradient buckets, each an all-reduce as the run made it
    (:func:`gradient_bucket_seconds`)."""
    chip = CHIPS[run.chip]
    peak = chip.peak_flops_fp32 if run.precision == "fp32" else chip.peak_flops
    per_bucket = gradient_bucket_seconds(run, facts)
    seconds = steps = 0.0
    start = 0.0
    stages = []
    for until, batch in run.batches:
        compute = facts.flops_per_image * batch / run.chips / (peak * efficiency)
        step = step_time(compute, per_bucket, facts.gradient_hidden_fraction, efficiency)
        stage_steps = math.ceil((until - start) * IMAGENET_TRAIN_IMAGES / batch)
        stages.append(
            {
                "batch": batch,
                "steps": stage_steps,
                "step_seconds": step.total,
                "compute_seconds": compute,
                "exposed_seconds": step.exposed,
            }
        )
        seconds += stage_steps * step.total
        steps += stage_steps
        start = until
    last = stages[-1]
    return {
        "seconds": seconds,
        "steps": steps,
        "step_seconds": last["step_seconds"],
        "images_per_second_per_chip": last["batch"] / run.chips / last["step_seconds"],
        "exposed_communication_share": last["exposed_seconds"] / last["step_seconds"],
        "stages": stages,
    }


def gradient_bucket_seconds(run: PublishedRun, facts: ModelFacts) -> list[float]:
    """Seconds of each gradient bucket's all-reduce in ``run``: the compiled step's buckets in
    the run's gradient precision, over its chips and links, by its own all-reduce ("xla" and
    "nccl": :func:`~jaxdist.aot.predict.library_allreduce_seconds`; a schedule the paper
    describes: the cost model's)."""
    chip = CHIPS[run.chip]
    network = network_for(chip, host_network=run.host_network)
    buckets = [b * run.gradient_itemsize / 4 for b in facts.bucket_bytes]
    # A library's all-reduce is priced as a plan prices a native step's.
    algorithm = "native" if run.allreduce in LIBRARY_ALLREDUCES else run.allreduce
    return communication_seconds(
        buckets,
        algorithm,
        [run.chips // run.inner, run.inner],
        network,
        per_host=run.inner,
        torus_dims=chip.torus_dims,
    )


def calibrate(run: PublishedRun, facts: ModelFacts) -> float:
    """The efficiency at which the time model gives ``run``'s published time (bisection:
    predicted time falls as efficiency rises)."""
    if predict_run(run, facts, 1.0)["seconds"] > run.seconds:
        raise ValueError(f"{run.name}: even at peak FLOP/s the model is slower than published")
    low, high = 1e-4, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        too_slow = predict_run(run, facts, middle)["seconds"] > run.seconds
        low, high = (middle, high) if too_slow else (low, middle)
    return (low + high) / 2


def fit_efficiency(runs: Sequence[PublishedRun], facts: ModelFacts) -> float:
    """The one efficiency that fits ``runs`` best: least squares of the log of predicted over
    published time (a ratio counts the same whichever way it errs). A grid over 0.01-1,
    then golden-section search around its best point."""
    if not runs:
        raise ValueError("fit_efficiency needs at least one run")

    def loss(efficiency: float) -> float:
        return sum(
            math.log(predict_run(run, facts, efficiency)["seconds"] / run.seconds) ** 2
            for run in runs
        )

    grid = [10 ** (-2 + 2 * i / 200) for i in range(201)]
    best = min(range(len(grid)), key=lambda i: loss(grid[i]))
    low, high = grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(60):
        a, b = high - ratio * (high - low), low + ratio * (high - low)
        low, high = (low, b) if loss(a) < loss(b) else (a, high)
    return (low + high) / 2


def leave_one_out(runs: Sequence[PublishedRun], facts: ModelFacts) -> list[dict]:
    """Each run predicted with the efficiency fitted on the others (:func:`fit_efficiency`)."""
    return [_held_out(run, [other for other in runs if other is not run], facts) for run in runs]


def _held_out(run: PublishedRun, others: Sequence[PublishedRun], facts: ModelFacts) -> dict:
    """``run`` predicted with the efficiency fitted on ``others``."""
    efficiency = fit_efficiency(others, facts)
    seconds = predict_run(run, facts, efficiency)["seconds"]
    return {
        "run": run.name,
        "efficiency": efficiency,
        "predicted_seconds": seconds,
        "error": seconds / run.seconds - 1,
    }


def fit_by_generation(facts: ModelFacts) -> dict[str, dict]:
    """Each chip generation's efficiency, fitted on its MLPerf runs (:func:`fit_efficiency`):
    ``{generation: {"efficiency": ..., "runs": [names]}}``. The share of peak a step reaches
    differs between generations (their compilers, libraries and memory), so a plan for a
    generation with published runs uses its own."""
    by_chip: dict[str, list[PublishedRun]] = {}
    for run in _mlperf_runs():
        by_chip.setdefault(run.chip, []).append(run)
    return {
        chip: {"efficiency": fit_efficiency(runs, facts), "runs": [r.name for r in runs]}
        for chip, runs in sorted(by_chip.items())
    }


def leave_one_out_by_generation(facts: ModelFacts) -> list[dict]:
    """Each MLPerf run predicted with its generation's efficiency fitted on that generation's
    other runs; a run that is its generation's only one is reported, unscored."""
    rows = []
    runs = _mlperf_runs()
    for run in runs:
        others = [o for o in runs if o.chip == run.chip and o is not run]
        if not others:
            rows.append(
                {
                    "run": run.name,
                    "efficiency": None,
                    "error": None,
                    "why": f"no other MLPerf run of {run.chip}",
                }
            )
            continue
        rows.append({**_held_out(run, others, facts), "fitted_on": [o.name for o in others]})
    return rows


def _mlperf_runs() -> list[PublishedRun]:
    return [run for run in PUBLISHED_RUNS if run.name in MLPERF_RUNS]


def write_calibration(
    run: PublishedRun, facts: ModelFacts, efficiency: float, by_generation: dict[str, dict]
) -> None:
    """Keep the calibrated efficiencies where :func:`calibrated_efficiency` reads them."""
    record = {
        "efficiency": efficiency,
        "run": run.name,
        "by_generation": by_generation,
        "facts": asdict(facts),
    }
    CALIBRATION_FILE.write_text(json.dumps(record, indent=2) + "\n")


class CalibrationMissing(FileNotFoundError):
    """No calibration file, and no efficiency given."""

    exit_code = 2


def calibrated_efficiency(generation: str | None = None) -> tuple[float, str]:
    """The calibrated efficiency for a chip ``generation`` and a line saying where it comes
    from: the generation's own, fitted on its MLPerf runs, or (a generation without any) the
    one calibrated on :data:`CALIBRATION_RUN`."""
    try:
        data = json.loads(CALIBRATION_FILE.read_text())
    except FileNotFoundError as err:
        raise CalibrationMissing(
            f"no calibration at {CALIBRATION_FILE}: run python benchmarks/plan_validation.py --published "
            "or pass --efficiency"
        ) from err
    own = data.get("by_generation", {}).get(generation)
    if own is not None:
        runs = len(own["runs"])
        return own["efficiency"], (
            f"{own['efficiency']:.3f} of peak, fitted on the {runs} MLPerf run"
            f"{'s' if runs > 1 else ''} of {generation} (docs/planning.md; --efficiency to change)"
        )
    without = f"; no MLPerf run of {generation} to fit on" if generation else ""
    return data["efficiency"], (
        f"{data['efficiency']:.3f} of peak, calibrated on {data['run']}{without} "
        "(docs/planning.md; --efficiency to change)"
    )

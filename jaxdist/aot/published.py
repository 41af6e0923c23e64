"""Published ResNet-50 training runs, and the time model set against them.

The time model (:mod:`jaxdist.aot.predict`) has one free number, the share of peak FLOP/s a
step reaches. It is calibrated on one published run (:data:`CALIBRATION_RUN`) and then
predicts the others; ``python benchmarks/plan_validation.py`` does both, writes the
calibration this module reads (``calibration.json`` beside it) and the table of predicted
against published times in docs/planning.md.

A run is predicted from ResNet-50's own figures, read from a compiled step
(:class:`ModelFacts`: FLOPs per image, gradient bytes, the share of backward that runs
while gradients are in flight), the chip's peak, and the cost model on the run's links with
its allreduce. MLPerf times run from the start of training to the evaluation that reaches
75.9% top-1 (evaluations included, start-up not); the papers' times are training time as
they define it. The model counts steps only.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from jaxdist.aot.chips import CHIPS, network_for
from jaxdist.aot.predict import BACKWARD_SHARE
from jaxdist.comm import cost_model

__all__ = [
    "PUBLISHED_RUNS",
    "PublishedRun",
    "calibrate",
    "predict_run",
]

IMAGENET_TRAIN_IMAGES = 1_281_167
CALIBRATION_FILE = Path(__file__).with_name("calibration.json")
_MLPERF = "https://github.com/mlcommons/training_results_v"
_GBIT = 1e9 / 8


@dataclass(frozen=True)
class PublishedRun:
    """One published run: who, on what, how big a batch, how long.

    ``batches`` is ``((until_epoch, global_batch), ...)``: one entry for a fixed batch, more
    for batch-size control. ``inner`` chips share the fast links (a node's NVLink, or a row
    of a TPU torus); the ``chips // inner`` groups talk over ``host_network`` bytes/s per
    chip (None: the fast links, as in a TPU pod). ``precision`` is ``"16-bit"`` (bf16 or
    fp16 compute, 16-bit gradients on the wire for GPU runs) or ``"fp32"``.
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
    overlapped_backward_fraction: float
    measured_on: str


def _mlperf(version: str, path: str) -> str:
    return f"{_MLPERF}{version}/tree/master/{path}"


PUBLISHED_RUNS: tuple[PublishedRun, ...] = (
    PublishedRun(
        "Goyal et al. 2017", "p100", 256, ((90, 8192),), 3600, 8, "hierarchical",
        50 / 8 * _GBIT, "fp32", "https://arxiv.org/abs/1706.02677",
    ),
    PublishedRun(
        "Mikami et al. 2018 (v1)", "v100", 2176, ((5, 34816), (90, 69632)), 224, 4,
        "torus2d", 50 * _GBIT, "16-bit", "https://arxiv.org/abs/1811.05233v1",
    ),
    PublishedRun(
        "MLPerf v0.6 Google TPU v3", "v3", 1024, ((72, 32768),), 76.9, 32, "torus2d", None,
        "16-bit", _mlperf("0.6", "Google/results/tpu-v3-2048/resnet"),
    ),
    PublishedRun(
        "MLPerf v0.6 NVIDIA DGX-2H", "v100", 1536, ((90, 59904),), 79.9, 16, "hierarchical",
        1000 / 16 * _GBIT, "16-bit", _mlperf("0.6", "NVIDIA/results/dgx2h_n96_ngc19.05_mxnet/resnet"),
    ),
    PublishedRun(
        "MLPerf v0.7 Google TPU v3 (JAX)", "v3", 4096, ((92, 65536),), 28.3, 32, "torus2d",
        None, "16-bit", _mlperf("0.7", "Google/results/tpu-v3-8192-JAX/resnet"),
    ),
    PublishedRun(
        "MLPerf v0.7 Google TPU v4", "v4", 256, ((44, 8192),), 109.2, 16, "torus2d", None,
        "16-bit", _mlperf("0.7", "Google/results/tpu-v4-512-TF/resnet"),
    ),
    PublishedRun(
        "MLPerf v0.7 NVIDIA DGX A100", "a100", 768, ((59, 34560),), 63.5, 8, "hierarchical",
        200 * _GBIT, "16-bit", _mlperf("0.7", "NVIDIA/results/dgxa100_n96_ngc20.06_mxnet/resnet"),
    ),
    PublishedRun(
        "MLPerf v1.0 Google TPU v4", "v4", 3456, ((78, 55296),), 13.7, 24, "torus2d", None,
        "16-bit", _mlperf("1.0", "Google/results/tpu-v4-6912-TF/resnet"),
    ),
    PublishedRun(
        "MLPerf v2.0 Google TPU v4", "v4", 4096, ((60, 32768),), 11.4, 16, "torus2d", None,
        "16-bit", _mlperf("2.0", "Google/results/cloud-tpu-v4-8192-TF/resnet"),
    ),
    PublishedRun(
        "MLPerf v2.0 NVIDIA DGX A100", "a100", 4216, ((86, 67456),), 19.1, 8, "hierarchical",
        200 * _GBIT, "16-bit", _mlperf("2.0", "NVIDIA/results/dgxa100_n527_ngc22.04_mxnet/resnet"),
    ),
    PublishedRun(
        "MLPerf v3.0 NVIDIA DGX H100", "h100", 64, ((35, 3200),), 159.8, 8, "hierarchical",
        400 * _GBIT, "16-bit", _mlperf("3.0", "NVIDIA/results/dgxh100_n8_ngc23.04_mxnet/resnet"),
    ),
    PublishedRun(
        "MLPerf v3.0 CoreWeave HGX H100", "h100", 3584, ((77, 57344),), 11.0, 8,
        "hierarchical", 400 * _GBIT, "16-bit",
        _mlperf("3.0", "NVIDIA_CoreWeave/results/coreweave_hgxh100_n448_ngc23.04_mxnet/resnet"),
    ),
    PublishedRun(
        "MLPerf v4.0 NVIDIA DGX H100", "h100", 2528, ((68, 40448),), 13.7, 8, "hierarchical",
        400 * _GBIT, "16-bit", _mlperf("4.0", "NVIDIA/results/eos_n316_ngc24.04_mxnet/resnet"),
    ),
)  # fmt: skip
# A TPU run at a moderate per-chip batch (32 images), verified from its result logs.
CALIBRATION_RUN = "MLPerf v0.7 Google TPU v4"


def predict_run(run: PublishedRun, facts: ModelFacts, efficiency: float) -> dict:
    """The time model's step time, images/s and time-to-train for ``run``; per batch stage
    the step is compute at ``efficiency`` of peak plus the allreduce of all gradients that
    backward cannot hide."""
    chip = CHIPS[run.chip]
    peak = chip.peak_flops_fp32 if run.precision == "fp32" else chip.peak_flops
    network = network_for(chip, host_network=run.host_network)
    axis_sizes = [run.chips // run.inner, run.inner]
    nbytes = facts.gradient_bytes * run.gradient_itemsize / 4
    communication = cost_model.predict(run.allreduce, nbytes, axis_sizes, network)
    seconds = steps = 0.0
    start = 0.0
    stages = []
    for until, batch in run.batches:
        compute = facts.flops_per_image * batch / run.chips / (peak * efficiency)
        hidden = min(communication, compute * BACKWARD_SHARE * facts.overlapped_backward_fraction)
        step = compute + communication - hidden
        stage_steps = math.ceil((until - start) * IMAGENET_TRAIN_IMAGES / batch)
        stages.append({"batch": batch, "steps": stage_steps, "step_seconds": step,
                       "compute_seconds": compute, "exposed_seconds": communication - hidden})  # fmt: skip
        seconds += stage_steps * step
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


def write_calibration(run: PublishedRun, facts: ModelFacts, efficiency: float) -> None:
    """Keep the calibrated efficiency where :func:`calibrated_efficiency` reads it."""
    record = {"efficiency": efficiency, "run": run.name, "facts": asdict(facts)}
    CALIBRATION_FILE.write_text(json.dumps(record, indent=2) + "\n")


class CalibrationMissing(FileNotFoundError):
    """No calibration file, and no efficiency given."""

    exit_code = 2


def calibrated_efficiency() -> tuple[float, str]:
    """The calibrated efficiency and a line saying where it comes from."""
    try:
        data = json.loads(CALIBRATION_FILE.read_text())
    except FileNotFoundError as err:
        raise CalibrationMissing(
            f"no calibration at {CALIBRATION_FILE}: run python benchmarks/plan_validation.py "
            "or pass --efficiency"
        ) from err
    return data["efficiency"], (
        f"{data['efficiency']:.3f} of peak, calibrated on {data['run']} "
        "(docs/planning.md; --efficiency to change)"
    )

"""What share of peak a transformer's training step reaches, from published runs.

ResNet-50's calibration (:mod:`jaxdist.aot.published`) prices every step at the share of peak
FLOP/s one MLPerf run reached; a transformer's large matrix products reach far more. This
module reads the published transformer runs shipped with the package
(``data/transformer_runs.json``: MaxText's tables for TPU v4, v5p and v6e, torchtitan's for
H100, one H200 run of ours; sources in ``benchmarks/results/NOTES_transformer_runs.md``) and
puts them on one footing: **model FLOPs utilization** as MaxText defines it today,

    training FLOPs per token = 6 x (parameters of the matrix products, the unembedding's
    included) + 6 x layers x query heads x head_dim x context

(the attention's scores and their use over a causal mask, half of a full square), per chip
per second, over the chip's dense bfloat16 peak (:data:`jaxdist.aot.chips.CHIPS`). Each run's throughput is recovered from
what it published (tokens per second, or TFLOP/s per chip under its own source's count,
:data:`CONVENTIONS`), then re-expressed under that one count.

The fit is the median utilization per chip generation and software stack over the bfloat16
runs (float8 runs reach past the bfloat16 peak and are left out). The stack matters as much as
the chip: on the same H100s MaxText's XLA programs reach 0.38-0.50 and torchtitan's PyTorch
0.23-0.35. A plan compiles an XLA program, so it takes XLA's runs (:data:`PLAN_STACK`); a
generation without runs of that stack takes its runs of the other, and one with no runs at all
the median of every TPU (or GPU) run of the stack. MaxText's v5e table is kept out of the fit
on purpose: it scores the predictions (``benchmarks/transformer_efficiency.py``).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

from jaxdist.aot.chips import CHIPS
from jaxdist.models.transformer_flops import TransformerShape

__all__ = [
    "CONVENTIONS",
    "HELD_OUT",
    "Efficiency",
    "fitted_efficiency",
    "runs",
    "software",
    "utilization",
]

# Generations whose runs never enter the fit: they score it.
HELD_OUT = ("v5e",)
TPU_GENERATIONS = ("v4", "v5e", "v5p", "v6e")

# Each source (by the first word of a run's ``source``): who published it, and the software
# its programs ran on; and the stack a plan's program runs on.
SOURCES = {
    "maxtext": ("MaxText", "XLA"),
    "jaxdist": ("jaxdist", "XLA"),
    "torchtitan": ("torchtitan", "PyTorch"),
}
PLAN_STACK = "XLA"


# Each source's own training FLOPs per token, under which its TFLOP/s per chip was published.
# MaxText's 2023 models tie their embedding to the unembedding, so "every parameter" counts
# its matrix once, as the matrix products' parameters do.
CONVENTIONS: dict[str, Callable[[TransformerShape], float]] = {
    "maxtext_2023a": lambda s: 6.0 * s.matmul_parameters,
    "maxtext_2023b": lambda s: 6.0 * s.matmul_parameters + 12.0 * s.attention_per_token,
    "maxtext_2023c": lambda s: 6.0 * s.matmul_parameters + 6.0 * s.attention_per_token,
    "maxtext_2024": lambda s: 6.0 * s.matmul_parameters + 12.0 * s.attention_per_token,
    "torchtitan": lambda s: 6.0 * s.matmul_parameters + 12.0 * s.attention_per_token,
}


def _convention(run: Mapping[str, Any]) -> str | None:
    label = run["flops_convention"].split(":")[0]
    return label if label in CONVENTIONS else None


def runs() -> list[dict]:
    """The published runs shipped with the package (one dict each, as recorded)."""
    text = resources.files("jaxdist.aot").joinpath("data", "transformer_runs.json").read_text()
    return json.loads(text)


def utilization(run: Mapping[str, Any]) -> float | None:
    """A run's model FLOPs utilization under MaxText's current count (None where neither its
    tokens per second nor its TFLOP/s under a known count were published)."""
    shape = TransformerShape.of_run(run)
    peak = CHIPS[run["generation"]].peak_flops  # every run over the same table's peak
    if run["tokens_per_s_per_chip"]:
        tokens = run["tokens_per_s_per_chip"]
    elif run["measured_tflops_per_chip"] and _convention(run):
        tokens = run["measured_tflops_per_chip"] * 1e12 / CONVENTIONS[_convention(run)](shape)
    else:
        return None
    return tokens * shape.training_flops_per_token() / peak


def source(run: Mapping[str, Any]) -> str:
    """The project a run was published by (the first word of its ``source``)."""
    return run["source"].split()[0]


def software(run: Mapping[str, Any]) -> str:
    """The software stack a run's program ran on (:data:`SOURCES`)."""
    return SOURCES[source(run)][1]


def _fitted(run: Mapping[str, Any]) -> bool:
    return run["dtype"] == "bfloat16" and run["generation"] not in HELD_OUT


@dataclass(frozen=True)
class Efficiency:
    """A generation's fitted model FLOPs utilization and the runs it rests on."""

    generation: str
    value: float
    runs: int  # how many runs the median is over
    stack: str  # the software those runs ran on ("XLA", or "PyTorch and XLA" where mixed)
    sources: tuple[str, ...]  # who published them
    pooled: str = ""  # "TPU" or "GPU" where the generation had no run of its own

    def describe(self) -> str:
        """One line for a plan: the value and what it rests on."""
        runs = "run" if self.runs == 1 else "runs"
        where = f"{self.generation} transformer {runs}"
        if self.pooled:
            where = f"{self.pooled} transformer {runs} (none of {self.generation})"
        return (
            f"{self.value:.3f} model FLOPs utilization, the median of {self.runs} published "
            f"{where} on {self.stack} ({', '.join(self.sources)})"
        )


def fitted_efficiency(
    generation: str,
    table: list[dict] | None = None,
    leave_out: Mapping[str, Any] | None = None,
    stack: str = PLAN_STACK,
) -> Efficiency:
    """The fitted utilization of ``generation`` for programs on ``stack`` (see the module
    docstring); ``leave_out``: a run kept out of the fit, to score it against the others."""
    table = runs() if table is None else table
    fitted = [
        (r, u)
        for r in table
        if _fitted(r) and r is not leave_out and (u := utilization(r)) is not None
    ]
    tpu = generation in TPU_GENERATIONS
    own = [(r, u) for r, u in fitted if r["generation"] == generation]
    kind = [(r, u) for r, u in fitted if (r["generation"] in TPU_GENERATIONS) == tpu]
    pooled = "" if own else ("TPU" if tpu else "GPU")
    candidates = own or kind
    chosen = [(r, u) for r, u in candidates if software(r) == stack] or candidates
    return Efficiency(
        generation,
        statistics.median(u for _, u in chosen),
        len(chosen),
        " and ".join(sorted({software(r) for r, _ in chosen})),
        tuple(sorted({SOURCES[source(r)][0] for r, _ in chosen})),
        pooled,
    )

"""The collective benchmark's report: the nccl-tests-style table, the JSON file and the busbw
plot of a :class:`~jaxdist.bench.allreduce.Result`."""

from __future__ import annotations

import json

from jaxdist.bench.allreduce import Result
from jaxdist.bench.sizes import format_size
from jaxdist.comm import collectives

__all__ = [
    "format_table",
]


def format_table(result: Result) -> str:
    """The nccl-tests-style table."""
    link = result.link
    lines = [
        f"# allreduce ({result.op}) on mesh {result.mesh or '?'} {result.axis_sizes} = "
        f"{result.devices} {result.platform} devices, dtype {result.dtype}, "
        f"{'in place (input donated)' if result.in_place else 'out of place'}",
        f"# fitted point-to-point link: alpha = {link.alpha * 1e6:.1f} us, "
        f"beta = 1/({link.bandwidth / 1e9:.2f} GB/s), {link.ports} port(s) per device",
    ]
    if result.axis_links is not None:
        outer, inner = result.axis_links.inter, result.axis_links.intra
        lines.append(
            f"# two-level schedules priced on the links along each axis: inner alpha = "
            f"{inner.alpha * 1e6:.1f} us, {inner.bandwidth / 1e9:.2f} GB/s; outer alpha = "
            f"{outer.alpha * 1e6:.1f} us, {outer.bandwidth / 1e9:.2f} GB/s"
        )
    share = result.link_rate is not None
    if share:
        lines.append(
            f"# link rate {result.link_rate / 1e6:g} MB/s per direction; link% = busbw / link rate"
        )
    lines.append(
        f"{'size':>8s} {'algorithm':<20s} {'time(us)':>11s} {'algbw(GB/s)':>11s} "
        f"{'busbw(GB/s)':>11s}{'  link%' if share else ''} {'x psum':>7s} {'max err':>9s} "
        f"{'model(us)':>10s} {'compile(s)':>10s}"
    )
    for row in sorted(
        result.rows, key=lambda r: (r.nbytes, collectives.ALGORITHMS.index(r.algorithm))
    ):
        link_share = f" {row.link_share * 100:5.1f}%" if row.link_share is not None else ""
        lines.append(
            f"{format_size(row.nbytes):>8s} {row.algorithm:<20s} {row.seconds * 1e6:11.1f} "
            f"{row.algbw / 1e9:11.3f} {row.busbw / 1e9:11.3f}{link_share} {row.vs_psum:7.2f} "
            f"{row.max_error:9.2e} {row.predicted_seconds * 1e6:10.1f} {row.compile_seconds:10.2f}"
        )
    for algorithm, reason in result.skipped.items():
        lines.append(f"# skipped {algorithm}: {reason}")
    return "\n".join(lines)


def save_json(result: Result, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result.to_json(), f, indent=2)


def plot(result: Result, path: str) -> None:
    """busbw against size, one line per algorithm."""
    from jaxdist.checks import pyplot

    plt = pyplot("the allreduce benchmark's figure")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for algorithm in collectives.ALGORITHMS:
        rows = sorted((r for r in result.rows if r.algorithm == algorithm), key=lambda r: r.nbytes)
        if rows:
            ax.plot(
                [r.nbytes for r in rows], [r.busbw / 1e9 for r in rows], marker="o", label=algorithm
            )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes per device")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(
        f"allreduce on {result.mesh or result.axis_sizes} ({result.devices} {result.platform} devices)"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

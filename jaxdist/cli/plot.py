"""``jaxdist plot WORKDIR [WORKDIR ...] [--out PNG]``: training curves against epochs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxdist.run.log import read_metrics

# The command line is the interface; nothing here is for import.
__all__: list[str] = []


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plot",
        help="draw loss, accuracy, learning rate and batch size against epochs",
        description="Read WORKDIR/metrics.jsonl of one or more runs and draw four panels "
        "(train loss, eval top-1, learning rate, global batch size) against epochs.",
    )
    p.add_argument("workdirs", nargs="+", metavar="WORKDIR", help="run directories")
    p.add_argument("--out", default=None, help="PNG path (default WORKDIR/curves.png)")
    p.add_argument("--title", default=None, help="figure title")
    p.set_defaults(func=run_plot, joins_process_group=False)


def plot_runs(workdirs: list[str | Path], out: str | Path, title: str | None = None) -> Path:
    """Draw the runs' curves into ``out`` (PNG) and return its path."""
    from jaxdist.checks import pyplot

    plt = pyplot("jaxdist plot")

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    panels = [
        (axes[0, 0], "train", "loss", "train loss"),
        (axes[0, 1], "eval", "top1", "eval top-1"),
        (axes[1, 0], "train", "lr", "learning rate"),
        (axes[1, 1], "train", "batch_size", "global batch size"),
    ]
    for workdir in workdirs:
        runs = read_metrics(workdir)
        for ax, kind, key, label in panels:
            if kind == "eval":  # the task's first metric: top-1, bits per byte, ...
                key = label = _eval_metric(runs.get("eval", []))
            records = [r for r in runs.get(kind, []) if key in r]
            ax.plot(
                [r["epoch"] for r in records],
                [r[key] for r in records],
                marker="o" if kind == "eval" else None,
                drawstyle="steps-pre" if key == "batch_size" else "default",
                markersize=3,
                label=Path(workdir).name,
            )
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("epoch")
    axes[0, 0].set_yscale("log")
    axes[0, 1].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _eval_metric(records: list[dict]) -> str:
    """The metric an eval panel shows: top-1 for classification, else the first one a
    task reports."""
    names = [k for r in records[:1] for k in r if k not in ("kind", "step", "epoch")]
    return "top1" if "top1" in names or not names else names[0]


def run_plot(args: argparse.Namespace) -> int:
    out = args.out or Path(args.workdirs[0]) / "curves.png"
    try:
        path = plot_runs(args.workdirs, out, args.title)
    except FileNotFoundError as err:
        print(f"jaxdist plot: {err}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0

"""The picture of docs/planning.md: one ResNet-50 step walked as the chip runs it, with the
gradient buckets' schedules left to the compiler and paced beside backward (wait-free).

    python benchmarks/overlap_timeline.py [--topology v5e:16x16] [--out docs/overlap_timeline.png]
        [--set KEY=VALUE ...] [--slices N]

Plans the MLPerf recipe (batch 32 per chip) twice with the TPU compiler, ``wait_free`` off
and on, walks each compiled program (jaxdist.aot.timeline) and draws both: the compute
stream, and each gradient transfer on the network, hidden where compute runs beside it.
``--save-hlo DIR`` keeps the two programs' text, ``--hlo-dir DIR`` draws from kept ones.
``--set`` overrides the recipe for both (e.g. ``mesh=torus-2x2x2 allreduce=torus3d`` on a v4
slice); ``--slices N`` also prints, for N equal slices of each step, the share of it the
compute stream is busy, stalled, and the network carries gradients: where the time goes.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import jax

RECIPE = "recipes/resnet50_imagenet_mlperf_lars.py"
VARIANTS = {"compiler's order": "wait_free=False", "wait-free": "wait_free=True"}


def program_text(topology: str, setting: str, sets: list[str]) -> tuple[str, float]:
    """A compiled step's text and its compute seconds (at the chip's calibrated share)."""
    from jaxdist.aot import published
    from jaxdist.aot.plan import plan_recipe
    from jaxdist.aot.topology import parse_topology
    from jaxdist.run import config as config_lib

    topo = parse_topology(topology)
    config = config_lib.load_recipe(RECIPE)
    config_lib.apply_overrides(config, [f"batch_size={32 * topo.num_chips}", *sets, setting])
    efficiency, _ = published.calibrated_efficiency(topo.generation)
    plan = plan_recipe(config, topo, efficiency=efficiency)
    return plan.stages[0].compiled.text, plan.stages[0].step_time.compute


def walk_text(text: str, compute: float, topology: str):
    from jaxdist.aot.chips import network_for
    from jaxdist.aot.predict import transfer_pricer
    from jaxdist.aot.timeline import walk
    from jaxdist.aot.topology import parse_topology

    topo = parse_topology(topology)
    price = transfer_pricer(network_for(topo.chip), math.inf, topo.chip.torus_dims)
    return walk(
        text,
        compute,
        price,
        peak_flops=topo.chip.peak_flops,
        hbm_bandwidth=topo.chip.hbm_bandwidth,
        num_devices=topo.num_chips,
    )


def draw(timelines: dict, out: Path, topology: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(timelines), 1, figsize=(10, 1.9 * len(timelines)), sharex=True)
    for ax, (name, t) in zip(axes, timelines.items()):
        ax.broken_barh([(a * 1e3, (b - a) * 1e3) for a, b in t.busy], (1.1, 0.8), color="0.6")
        grads = [(b, e) for role, b, e in t.transfers if role == "gradients"]
        ax.broken_barh([(b * 1e3, (e - b) * 1e3) for b, e in grads], (0.1, 0.8), color="tab:red")
        ax.set_yticks([0.5, 1.5], ["gradients\non the network", "compute"])
        ax.set_title(
            f"{name}: {t.gradient_hidden_fraction:.0%} of {t.gradient_seconds * 1e3:.1f} ms of "
            f"gradient communication hidden, step {t.step_seconds * 1e3:.1f} ms",
            fontsize=10,
            loc="left",
        )
    axes[-1].set_xlabel(f"ms into one ResNet-50 step on {topology} (32 images per chip)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}", file=sys.stderr)


def utilisation(timeline, slices: int) -> list[str]:
    """Per slice of the step: the share of it the compute stream is busy, stalled (waiting
    for a transfer or a synchronous collective) and the network carries gradients."""
    step = timeline.step_seconds
    grads = [(b, e) for role, b, e in timeline.transfers if role == "gradients"]
    stalls = [(e0, b1) for (_, e0), (b1, _) in zip(timeline.busy, timeline.busy[1:]) if b1 > e0]

    def share(intervals, lo, hi):
        return sum(max(0.0, min(e, hi) - max(b, lo)) for b, e in intervals) / (hi - lo)

    lines = ["| ms | compute busy | compute stalled | network (gradients) |", "|---|---|---|---|"]
    for k in range(slices):
        lo, hi = step * k / slices, step * (k + 1) / slices
        lines.append(
            f"| {lo * 1e3:.2f}-{hi * 1e3:.2f} | {share(timeline.busy, lo, hi):.0%} "
            f"| {share(stalls, lo, hi):.0%} | {share(grads, lo, hi):.0%} |"
        )
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default="v5e:16x16")
    parser.add_argument("--out", type=Path, default=Path("docs/overlap_timeline.png"))
    parser.add_argument("--save-hlo", type=Path, help="keep the compiled programs here")
    parser.add_argument("--hlo-dir", type=Path, help="draw from programs kept by --save-hlo")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override the recipe for both variants",
    )
    parser.add_argument("--slices", type=int, default=0, help="print where each step's time goes")
    args = parser.parse_args(argv)
    jax.config.update("jax_platforms", "cpu")
    timelines = {}
    for i, (name, setting) in enumerate(VARIANTS.items()):
        if args.hlo_dir:
            text = (args.hlo_dir / f"{i}.hlo").read_text()
            compute = float((args.hlo_dir / f"{i}.compute").read_text())
        else:
            text, compute = program_text(args.topology, setting, args.set)
        if args.save_hlo:
            args.save_hlo.mkdir(parents=True, exist_ok=True)
            (args.save_hlo / f"{i}.hlo").write_text(text)
            (args.save_hlo / f"{i}.compute").write_text(repr(compute))
        timelines[name] = walk_text(text, compute, args.topology)
        t = timelines[name]
        print(
            f"{name}: step {t.step_seconds * 1e3:.2f} ms, compute {t.compute_seconds * 1e3:.2f}"
            f" ms, gradients {t.gradient_seconds * 1e3:.2f} ms, hidden "
            f"{t.gradient_hidden_seconds * 1e3:.2f} ms ({t.gradient_hidden_fraction:.0%})"
        )
        if args.slices:
            print("\n".join(utilisation(t, args.slices)))
    draw(timelines, args.out, args.topology)
    return 0


if __name__ == "__main__":
    sys.exit(main())

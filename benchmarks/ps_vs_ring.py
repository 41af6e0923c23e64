"""The seed result: a parameter server's communication time grows with the hosts, a ring's not.

Two steps (the first needs root, for ``jaxdist cluster``)::

    sudo .venv/bin/python benchmarks/ps_vs_ring.py run     # 2, 4, 8 emulated hosts -> JSON
    .venv/bin/python benchmarks/ps_vs_ring.py plot         # JSON -> docs/ps_vs_ring.png

``run`` starts, one after the other, for each host count H::

    jaxdist cluster --hosts H --devices-per-host 1 --bandwidth 1gbit -- \\
        jaxdist bench allreduce --mesh ring-H --sizes 16M \\
        --algorithms ring,parameter_server --iters 3 --warmup 1 \\
        --json benchmarks/results/ps_vs_ring_hH.json

(``bench`` always measures gloo's own ``psum`` too, as ``native``; it is drawn for scale.)
``plot`` reads those files and draws the median allreduce time against H, next to the two
cost models at the link rate: a ring's 2(p-1)/p * S / B (near flat) and a server's
2(p-1) * S / B (every worker's buffer in and the sum out again over the server's one link).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
HOSTS = (2, 4, 8)
LINK_BITS_PER_S = 10**9


def result_path(hosts: int) -> Path:
    return RESULTS / f"ps_vs_ring_h{hosts}.json"


def command(hosts: int, size: str) -> list[str]:
    """The cluster command for ``hosts`` hosts (the exact one documented above)."""
    jaxdist = [sys.executable, "-m", "jaxdist"]
    return [
        *jaxdist,
        "cluster",
        "--hosts",
        str(hosts),
        "--devices-per-host",
        "1",
        "--bandwidth",
        "1gbit",
        "--timeout",
        "900",
        "--",
        *jaxdist,
        "bench",
        "allreduce",
        "--mesh",
        f"ring-{hosts}",
        "--sizes",
        size,
        "--algorithms",
        "ring,parameter_server",
        "--iters",
        "3",
        "--warmup",
        "1",
        "--quiet",
        "--json",
        str(result_path(hosts)),
    ]


def run(size: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    for hosts in HOSTS:  # one cluster at a time: they would share the same CPUs
        argv = command(hosts, size)
        print("+ " + " ".join(argv), flush=True)
        subprocess.run(argv, cwd=REPO, check=True)


def load() -> dict[int, dict]:
    """{hosts: bench JSON} for every host count that has a result file."""
    found = {}
    for hosts in HOSTS:
        path = result_path(hosts)
        if path.exists():
            found[hosts] = json.loads(path.read_text())
    if not found:
        raise SystemExit(f"no results in {RESULTS}: run `{sys.argv[0]} run` first (as root)")
    return found


def seconds_of(result: dict, algorithm: str) -> tuple[int, float]:
    """(bytes per device, median seconds) of ``algorithm``; ``native`` (psum) is not a row of
    its own unless asked for, but every row holds its time as a ratio to it."""
    rows = result["rows"]
    if algorithm == "native" and not any(r["algorithm"] == "native" for r in rows):
        return rows[0]["nbytes"], rows[0]["seconds"] / rows[0]["vs_psum"]
    (row,) = [r for r in rows if r["algorithm"] == algorithm]
    return row["nbytes"], row["seconds"]


def plot(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = load()
    hosts = sorted(results)
    beta = 8 / LINK_BITS_PER_S  # seconds per byte on one link
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    styles = {
        "parameter_server": ("tab:red", "parameter server"),
        "ring": ("tab:blue", "ring (ppermute)"),
        "native": ("tab:gray", "gloo psum (native)"),
    }
    nbytes = seconds_of(results[hosts[0]], "ring")[0]
    for algorithm, (color, label) in styles.items():
        times = [seconds_of(results[h], algorithm)[1] for h in hosts]
        ax.plot(hosts, times, marker="o", color=color, label=f"{label}, measured")
        # Label the server's points only: the ring's and psum's lie too close together.
        for h, t in zip(hosts, times if algorithm == "parameter_server" else [], strict=False):
            ax.annotate(f"{t:.2f}", (h, t), textcoords="offset points", xytext=(4, 4), fontsize=8)
    model_ps = [2 * (p - 1) * nbytes * beta for p in hosts]
    model_ring = [2 * (p - 1) / p * nbytes * beta for p in hosts]
    ax.plot(hosts, model_ps, ls="--", color="tab:red", alpha=0.6, label="server model 2(p-1)S/B")
    ax.plot(
        hosts, model_ring, ls="--", color="tab:blue", alpha=0.6, label="ring model 2(p-1)/p S/B"
    )
    ax.set_xticks(hosts)
    ax.set_xlabel("emulated hosts (1 device each, 1 Gbit/s links)")
    ax.set_ylabel("allreduce time (s)")
    ax.set_title(f"allreduce of {nbytes / 2**20:.0f} MiB per device: parameter server vs ring")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    print(f"wrote {out}")
    for h in hosts:
        ps, ring, native = (
            seconds_of(results[h], a)[1] for a in ("parameter_server", "ring", "native")
        )
        print(f"hosts={h}: parameter_server {ps:.3f} s, ring {ring:.3f} s, native {native:.3f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="step", required=True)
    run_p = sub.add_parser("run", help="run the 2/4/8-host cluster benchmarks (root)")
    run_p.add_argument("--size", default="16M", help="bytes per device (default 16M)")
    plot_p = sub.add_parser("plot", help="draw the figure from the JSON results")
    plot_p.add_argument("--out", type=Path, default=REPO / "docs" / "ps_vs_ring.png")
    args = parser.parse_args()
    if args.step == "run":
        run(args.size)
    else:
        plot(args.out)


if __name__ == "__main__":
    main()

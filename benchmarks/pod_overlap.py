"""Hidden communication, every collective and compile cost of ResNet-50 steps on the slices
users rent.

    python benchmarks/pod_overlap.py [--only NAME,...] [--timeout SECONDS]

Each target is a recipe planned with ``jaxdist plan --json`` on a topology, in a process of
its own (the TPU or GPU compiler, no accelerator), at a per-chip batch that fits without
accumulation, so every backward matrix product could run beside a gradient collective. The
table says, per target: compile seconds and the compiling process's peak memory, HBM per
chip, the gradient collectives (how many are asynchronous, how many inside a loop), the share
of their communication time the compute hides when the compiled order is walked
(jaxdist.aot.timeline), the backward matrix products inside a gradient collective's window (a
count, beside it), and the bytes per chip of every other collective by role (BatchNorm
statistics, running statistics, metrics). The ``-wait-free`` targets pace every bucket's
schedule beside backward (``wait_free=True``); the others leave the order to the compiler. ``benchmarks/results/pod_overlap.json`` keeps the
plans; a run with ``--only`` replaces those targets' rows and keeps the rest.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "pod_overlap.json"
MLPERF = "recipes/resnet50_imagenet_mlperf_lars.py"
MIKAMI = "recipes/resnet50_imagenet_mikami.py"

# name: (recipe, topology, --set overrides)
TARGETS = {
    "v5e-16x16-torus2d": (MLPERF, "v5e:16x16", ["batch_size=8192", "wait_free=False"]),
    "v5e-16x16-native": (
        MLPERF,
        "v5e:16x16",
        ["batch_size=8192", "allreduce=native", "wait_free=False"],
    ),
    "v5p-12x12x24-mikami": (MIKAMI, "v5p:12x12x24", ["unroll_limit=72", "wait_free=False"]),
    "v5p-12x12x24-mikami-native": (MIKAMI, "v5p:12x12x24", ["allreduce=native", "wait_free=False"]),
    "v4-8x8x16-torus2d": (MLPERF, "v4:8x8x16", ["unroll_limit=32", "wait_free=False"]),
    "h100-4x8-torus2d": (
        MLPERF,
        "h100:4x8",
        ["batch_size=4096", "max_per_device_batch=128", "wait_free=False"],
    ),
    # The same with smaller gradient buckets: more collectives for the scheduler to spread.
    "v5p-12x12x24-mikami-8mib": (
        MIKAMI,
        "v5p:12x12x24",
        ["unroll_limit=72", "bucket_bytes=8388608", "wait_free=False"],
    ),
    "h100-4x8-native-4mib": (
        MLPERF,
        "h100:4x8",
        [
            "batch_size=4096",
            "max_per_device_batch=128",
            "bucket_bytes=4194304",
            "allreduce=native",
            "wait_free=False",
        ],
    ),
    "h100-4x8-torus2d-4mib": (
        MLPERF,
        "h100:4x8",
        ["batch_size=4096", "max_per_device_batch=128", "bucket_bytes=4194304", "wait_free=False"],
    ),
    # Wait-free backprop: each bucket's steps paced beside the rest of backward.
    "v5e-16x16-torus2d-wait-free": (MLPERF, "v5e:16x16", ["batch_size=8192", "wait_free=True"]),
    "v5e-16x16-ring-wait-free": (
        MLPERF,
        "v5e:16x16",
        ["batch_size=8192", "mesh=", "allreduce=ring", "wait_free=True"],
    ),
    "v5p-12x12x24-mikami-wait-free": (MIKAMI, "v5p:12x12x24", ["wait_free=True"]),
    "v5p-12x12x24-mikami-ring-wait-free": (
        MIKAMI,
        "v5p:12x12x24",
        ["mesh=", "allreduce=ring", "wait_free=True"],
    ),
    "v4-8x8x16-torus2d-wait-free": (MLPERF, "v4:8x8x16", ["wait_free=True"]),
    "v4-8x8x16-ring-wait-free": (
        MLPERF,
        "v4:8x8x16",
        ["mesh=", "allreduce=ring", "wait_free=True"],
    ),
    # The 3-D torus over the slice's own three dimensions: chains of 2 (X + Y + Z - 3) steps.
    "v4-8x8x16-torus3d-wait-free": (
        MLPERF,
        "v4:8x8x16",
        ["mesh=torus-2x2x2", "allreduce=torus3d", "wait_free=True"],
    ),
    "v5p-12x12x24-mikami-torus3d-wait-free": (
        MIKAMI,
        "v5p:12x12x24",
        ["mesh=torus-2x2x2", "allreduce=torus3d", "wait_free=True"],
    ),
    "h100-4x8-torus2d-wait-free": (
        MLPERF,
        "h100:4x8",
        ["batch_size=4096", "max_per_device_batch=128", "wait_free=True"],
    ),
    "h100-4x8-ring-wait-free": (
        MLPERF,
        "h100:4x8",
        ["batch_size=4096", "max_per_device_batch=128", "allreduce=ring", "wait_free=True"],
    ),
}


def run(name: str, timeout: float) -> dict:
    """Plan one target in a child process; its plan, wall time and peak memory."""
    recipe, topology, sets = TARGETS[name]
    command = [
        sys.executable,
        __file__,
        "--child",
        "plan",
        recipe,
        "--topology",
        topology,
        "--efficiency",
        "0.2",
        "--json",
    ]
    for item in sets:
        command += ["--set", item]
    started = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"name": name, "topology": topology, "timed_out": timeout}
    seconds = time.perf_counter() - started
    said = [line for line in done.stderr.splitlines() if not line.startswith("peak_rss_mib=")]
    if done.returncode:
        return {"name": name, "topology": topology, "error": said[-1] if said else "failed"}
    plan = json.loads(done.stdout)
    peak = [line for line in done.stderr.splitlines() if line.startswith("peak_rss_mib=")]
    return {
        "name": name,
        "recipe": recipe,
        "topology": topology,
        "sets": sets,
        "wall_seconds": seconds,
        "peak_rss_mib": float(peak[-1].split("=")[1]),
        "plan": plan,
    }


def _row(result: dict) -> list[str]:
    if "plan" not in result:
        why = result.get("error") or f"over {result['timed_out']:.0f} s"
        return [f"| {result['name']} | {result['topology']} | {why} |"]
    lines = []
    for stage in result["plan"]["stages"]:
        grads = [r for r in stage["collectives"] if r["role"] == "gradients"]
        others = {}
        for r in stage["collectives"]:
            if r["role"] != "gradients":
                others[r["role"]] = others.get(r["role"], 0) + r["bytes"]
        other_text = ", ".join(f"{role} {b / 2**20:.2f}" for role, b in others.items()) or "-"
        lines.append(
            f"| {result['name']} | {stage['global_batch']:,} ({stage['per_chip_batch']}/chip) "
            f"| {stage['compile_seconds']:.0f} | {result['peak_rss_mib'] / 1024:.1f} "
            f"| {stage['memory_bytes']['total'] / 2**30:.2f} "
            f"| {sum(r['count'] for r in grads)} ({sum(r['async'] for r in grads)} async, "
            f"{sum(r['in_loop'] for r in grads)} in loops) "
            f"| {_hidden(stage)} | {stage['overlapped_backward_fraction']:.0%} | {other_text} |"
        )
    return lines


def _hidden(stage: dict) -> str:
    """The gradients' communication time hidden behind compute, of their whole time."""
    seconds = stage["step_seconds"]
    if "gradient_hidden_fraction" not in stage:  # a plan made before the time was walked
        return "-"
    return (
        f"{stage['gradient_hidden_fraction']:.0%} ({seconds['hidden'] * 1e3:.1f} of "
        f"{seconds['communication'] * 1e3:.1f} ms)"
    )


def child(argv: list[str]) -> int:
    """Run ``jaxdist`` with ``argv`` in this process, then say its peak memory."""
    from jaxdist.cli import main as jaxdist_main

    code = jaxdist_main(argv)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak_rss_mib={peak:.0f}", file=sys.stderr)
    return code


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(TARGETS), help="targets, comma-separated")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per target")
    args = parser.parse_args(argv)
    names = args.only.split(",")
    unknown = sorted(set(names) - set(TARGETS))
    if unknown:
        parser.error(f"unknown targets {unknown}; choose from {sorted(TARGETS)}")
    print(
        "| target | batch | compile (s) | peak memory (GiB) | HBM per chip (GiB) "
        "| gradient collectives | gradient time hidden | backward matmuls in a gradient window "
        "| other collectives (MiB per chip) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    results = []
    for name in names:
        result = run(name, args.timeout)
        results.append(result)
        print("\n".join(_row(result)), flush=True)
    # Targets run here replace their earlier rows; the others' rows stay (each target may
    # need its own environment: the GPU one needs JAX's CUDA plugin).
    kept = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    done = {r["name"] for r in results}
    rows = [r for r in kept if r["name"] not in done] + results
    rows.sort(key=lambda r: list(TARGETS).index(r["name"]) if r["name"] in TARGETS else 99)
    RESULTS.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {RESULTS}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

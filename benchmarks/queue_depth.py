"""How deep a queue of collective programs XLA:CPU survives, and what a shallow one costs.

    python benchmarks/queue_depth.py --json benchmarks/results/queue_depth_cpu.json

A Python loop that never reads a result queues jitted calls ahead of the one running. On 8
forced CPU devices in one process a deep enough queue of programs with collectives hangs
XLA:CPU's in-process rendezvous, which is why :class:`jaxdist.runtime.dispatch.InFlightWindow` limits
``TrainStep`` and ``EvalStep`` on CPU meshes (docs/collectives.md). For each program and each
queue depth this script runs ``--calls`` unblocked calls in a fresh process (a hang aborts the
process, so each run needs its own) with XLA's collective timeouts cut to ``--timeout``
seconds, and reports whether the loop finished and its milliseconds per call:

* ``ppermute``: a shard_map'ed ``lax.ppermute`` shift of 4 KiB per device;
* ``psum``: a shard_map'ed ``lax.psum`` of 4 KiB per device;
* ``train_step``: ``jaxdist.training.train_step.TrainStep`` with the ring allreduce on ``torus-4x2``
  (a linear model: the step is all dispatch and collectives).

Depth ``none`` is no limit (``max_in_flight=None``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PROGRAMS = ("ppermute", "psum", "train_step")


def child(program: str, depth: int | None, calls: int) -> None:
    """Run ``calls`` unblocked calls at queue ``depth``; print ms per call."""
    import jax
    import numpy as np
    import optax
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxdist import meshes
    from jaxdist.runtime import dispatch
    from jaxdist.training import train_step as ts
    from jaxdist.training.step_options import Communication

    if program == "train_step":

        def loss_fn(params, model_state, batch, rng):
            loss = ((batch["x"] @ params["w"] - batch["y"]) ** 2).mean()
            return loss, (model_state, {})

        step = ts.TrainStep(
            loss_fn,
            optax.sgd(0.01),
            meshes.build("torus-4x2"),
            communication=Communication("ring"),
            max_in_flight=depth,
        )
        state = step.init({"w": np.zeros((4, 1), np.float32)})
        batch = {"x": np.ones((16, 4), np.float32), "y": np.ones((16, 1), np.float32)}
        rng = jax.random.key(0)
        state, _ = step(state, step.shard_batch(batch), rng)  # compile
        jax.block_until_ready(state)
        start = time.perf_counter()
        for _ in range(calls):
            state, _ = step(state, step.shard_batch(batch), rng)
        jax.block_until_ready(state)
    else:
        mesh = meshes.ring(jax.device_count())
        p = mesh.size
        shift = [(i, (i + 1) % p) for i in range(p)]
        body = {
            "ppermute": lambda v: lax.ppermute(v, "x", shift),
            "psum": lambda v: lax.psum(v, "x"),
        }[program]
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        x = jax.device_put(np.ones((p, 1024), np.float32), NamedSharding(mesh, P("x")))
        x = jax.block_until_ready(fn(x))  # compile
        window = dispatch.InFlightWindow(depth)
        start = time.perf_counter()
        for _ in range(calls):
            window.make_room()
            x = fn(x)
            window.add(x)
        jax.block_until_ready(x)
    print(f"MS_PER_CALL {(time.perf_counter() - start) / calls * 1e3:.4f}", flush=True)


def run_one(program: str, depth: str, calls: int, timeout: int, devices: int) -> dict:
    """One fresh process; ``finished`` is False when it hung (or failed)."""
    flags = (
        f"--xla_force_host_platform_device_count={devices}"
        " --xla_cpu_collective_call_warn_stuck_timeout_seconds=5"
        f" --xla_cpu_collective_call_terminate_timeout_seconds={timeout}"
    )
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    argv = [sys.executable, __file__, "child", program, depth, str(calls)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout + 120)
        output, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as err:
        output, code = str(err.stdout or "") + str(err.stderr or ""), None
    ms = [float(line.split()[1]) for line in output.splitlines() if line.startswith("MS_PER_CALL")]
    hung = "Expected" in output and "rendezvous" in output
    return {
        "program": program,
        "depth": depth,
        "calls": calls,
        "finished": code == 0 and bool(ms),
        "rendezvous_hang": hung,
        "ms_per_call": ms[0] if ms else None,
        "seconds": round(time.perf_counter() - start, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", default=",".join(PROGRAMS))
    parser.add_argument("--depths", default="none,32,16,4,1", help="'none' = no limit")
    parser.add_argument("--calls", type=int, default=2000, help="unblocked calls per run")
    parser.add_argument("--repeats", type=int, default=2, help="fresh processes per cell")
    parser.add_argument("--devices", type=int, default=8, help="forced CPU devices")
    parser.add_argument("--timeout", type=int, default=15, help="XLA's collective timeout, s")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = []
    print(f"# {args.calls} unblocked calls per run on {args.devices} CPU devices", flush=True)
    print(f"{'program':>10s} {'depth':>5s}  {'finished':>8s}  ms/call", flush=True)
    for program in args.programs.split(","):
        if program not in PROGRAMS:
            raise SystemExit(f"queue_depth.py: unknown program {program!r}; one of {PROGRAMS}")
        for depth in args.depths.split(","):
            runs = [
                run_one(program, depth, args.calls, args.timeout, args.devices)
                for _ in range(args.repeats)
            ]
            rows += runs
            done = sum(r["finished"] for r in runs)
            times = ", ".join(f"{r['ms_per_call']:.3f}" for r in runs if r["finished"]) or "-"
            print(f"{program:>10s} {depth:>5s}  {done:>4d}/{len(runs):<3d}  {times}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"devices": args.devices, "rows": rows}, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        _, _, program, depth, calls = sys.argv
        child(program, None if depth == "none" else int(depth), int(calls))
    else:
        main()

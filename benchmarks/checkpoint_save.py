"""How long a checkpoint save of a replicated ResNet-50 train state takes in one process, with
orbax's replica-parallel writing and without it (what jaxdist's checkpointer uses in one
process), and what the digest of every array that jaxdist's checkpointer saves with it adds.

    python benchmarks/checkpoint_save.py [--rounds 3] [--devices 8] [--saves 3]

Each round starts one fresh process per setting, in alternating order, because the first save
is the one that pays for compiling: the process builds ResNet-50's parameters, a momentum
copy and the BatchNorm statistics, replicated over ``--devices`` CPU devices, and saves them
``--saves`` times to a new folder. The table gives the median over rounds of the first save
and of the later ones, and the ratio of the two settings; ``--json`` keeps every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# name -> (replica-parallel writing, digests computed before the save)
SETTINGS = {
    "replica-parallel": (True, False),
    "one writer per array": (False, False),
    "one writer per array, with digests": (False, True),
}


def child(replica_parallel: bool, digests: bool, devices: int, saves: int) -> list[float]:
    """Seconds of each of ``saves`` saves of the state, in this (fresh) process."""
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import time

    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxdist.models import init_variables, resnet50
    from jaxdist.run.checkpoint import state_type_handlers
    from jaxdist.run.checkpoint_digest import array_digests

    model = resnet50(num_classes=1000)
    variables = init_variables(model, jax.random.key(0), np.zeros((1, 224, 224, 3), np.float32))
    replicated = NamedSharding(jax.make_mesh((devices,), ("data",)), PartitionSpec())
    params = jax.device_put(variables["params"], replicated)
    state = {
        "params": params,
        "momentum": jax.tree.map(lambda x: x * 0.5, params),
        "batch_stats": jax.device_put(variables["batch_stats"], replicated),
    }
    jax.block_until_ready(state)
    handler = ocp.PyTreeCheckpointHandler(
        type_handler_registry=state_type_handlers(replica_parallel)
    )
    seconds = []
    with tempfile.TemporaryDirectory() as folder, ocp.Checkpointer(handler) as checkpointer:
        for i in range(saves):
            start = time.perf_counter()
            if digests:
                array_digests(state)
            checkpointer.save(Path(folder) / str(i), args=ocp.args.PyTreeSave(state))
            seconds.append(time.perf_counter() - start)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write every figure to this file")
    parser.add_argument("--child", choices=list(SETTINGS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*SETTINGS[args.child], args.devices, args.saves)))
        return 0

    runs: dict[str, list[list[float]]] = {name: [] for name in SETTINGS}
    for r in range(args.rounds):
        order = list(SETTINGS) if r % 2 == 0 else list(reversed(SETTINGS))
        for name in order:
            command = [
                sys.executable,
                __file__,
                "--child",
                name,
                "--devices",
                str(args.devices),
                "--saves",
                str(args.saves),
            ]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                print(f"the {name} process failed:\n{done.stderr[-2000:]}", file=sys.stderr)
                return 1
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1}: {name}: {runs[name][-1]}", file=sys.stderr)

    def medians(name: str) -> tuple[float, float]:
        first = statistics.median(s[0] for s in runs[name])
        later = statistics.median(x for s in runs[name] for x in s[1:])
        return first, later

    base = medians("one writer per array")
    print(
        f"ResNet-50 train state replicated over {args.devices} CPU devices, one process, "
        f"median of {args.rounds} rounds"
    )
    print("| writing | first save (s) | later saves (s) | against one writer per array |")
    print("|---|---|---|---|")
    for name in SETTINGS:
        first, later = medians(name)
        print(
            f"| {name} | {first:.2f} | {later:.2f} | "
            f"{first / base[0]:.2f}x / {later / base[1]:.2f}x |"
        )
    if args.json:
        record = {"devices": args.devices, "rounds": args.rounds, "seconds": runs}
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

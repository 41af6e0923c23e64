"""Write the lowered program of every allreduce schedule, in every form it takes, to a folder.

A refactor of the collectives must not change what they compile to. Run this before and
after and compare the two folders::

    python benchmarks/lowered_programs.py /tmp/before
    # ... change the code ...
    python benchmarks/lowered_programs.py /tmp/after
    python benchmarks/lowered_programs.py --compare /tmp/before /tmp/after

Each file is the StableHLO text of one ``jax.jit(shard_map(allreduce))`` on 8 forced CPU
devices: every algorithm and option that selects a different code path (unrolled and looped
rings, the inner pair and the crossed exchange of the two-level schedules, every outer
schedule of ``hierarchical``, messages in pieces, bf16 transfer, the mean), on 1-D and 2-D
meshes, at three sizes (one that divides, a prime, and one smaller than the windows), plus
the public ``reduce_scatter``, ``all_gather`` and ``permute``.

``--steps`` adds the train steps the trainer builds from recipes (data parallel with each
gradient route, accumulation, a batch ramp, and the pipeline schedules), lowered from their
abstract state: a refactor of the steps or the trainer must not change them either.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

SIZES = (1 << 16, 10007, 5)


def _cases():
    """``(name, mesh axes, axis_name, body)`` for every form of every schedule."""
    import jax.numpy as jnp

    from jaxdist.comm import collectives

    one_d = ("native", "ring", "bidirectional_ring", "halving_doubling", "parameter_server")
    cases = []
    for algorithm in one_d:
        cases.append((f"{algorithm}_ring8", (("x", 8),), "x", algorithm, {}))
        cases.append((f"{algorithm}_ring2", (("x", 2),), "x", algorithm, {}))
        cases.append((f"{algorithm}_flat4x2", (("y", 4), ("x", 2)), ("y", "x"), algorithm, {}))
    cases += [
        ("ring_ring8_loop", (("x", 8),), "x", "ring", {"unroll_limit": 2}),
        (
            "bidirectional_ring_ring8_loop",
            (("x", 8),),
            "x",
            "bidirectional_ring",
            {"unroll_limit": 2},
        ),
        ("ring_ring8_pieces", (("x", 8),), "x", "ring", {"exchange_piece_bytes": 4096}),
        (
            "bidirectional_ring_ring8_pieces",
            (("x", 8),),
            "x",
            "bidirectional_ring",
            {"exchange_piece_bytes": 4096},
        ),
        ("ring_ring2_pieces", (("x", 2),), "x", "ring", {"exchange_piece_bytes": 4096}),
        ("parameter_server_ring8_server3", (("x", 8),), "x", "parameter_server", {"server": 3}),
    ]
    for mesh_name, axes in (
        ("4x2", (("y", 4), ("x", 2))),
        ("2x4", (("y", 2), ("x", 4))),
        ("3x2", (("y", 3), ("x", 2))),
        ("1x8", (("y", 1), ("x", 8))),
    ):
        for algorithm in ("torus2d", "hierarchical"):
            cases.append((f"{algorithm}_{mesh_name}", axes, ("y", "x"), algorithm, {}))
            cases.append(
                (
                    f"{algorithm}_{mesh_name}_crossed",
                    axes,
                    ("y", "x"),
                    algorithm,
                    {"crossed_exchange": True},
                )
            )
            cases.append(
                (f"{algorithm}_{mesh_name}_loop", axes, ("y", "x"), algorithm, {"unroll_limit": 1})
            )
        for inter in one_d:
            cases.append(
                (
                    f"hierarchical_{mesh_name}_inter_{inter}",
                    axes,
                    ("y", "x"),
                    "hierarchical",
                    {"inter_algorithm": inter},
                )
            )
    cases.append(
        (
            "torus2d_4x2_pieces",
            (("y", 4), ("x", 2)),
            ("y", "x"),
            "torus2d",
            {"exchange_piece_bytes": 4096},
        )
    )

    def allreduce_body(axis_name, algorithm, options, op, transfer_dtype):
        def body(v):
            return collectives.allreduce(
                v, axis_name, algorithm, op=op, transfer_dtype=transfer_dtype, **options
            )

        return body

    out = []
    for name, axes, axis_name, algorithm, options in cases:
        if algorithm == "halving_doubling" and "3x2" in name:
            continue
        if "inter_halving_doubling" in name and "3x2" in name:
            continue
        for op, dtype, suffix in (
            ("sum", None, ""),
            ("mean", None, "_mean"),
            ("sum", jnp.bfloat16, "_bf16"),
        ):
            if suffix and ("_loop" in name or "_pieces" in name or "inter_" in name):
                continue
            body = allreduce_body(axis_name, algorithm, options, op, dtype)
            out.append((name + suffix, axes, body))
    out.append(("reduce_scatter_ring8", (("x", 8),), lambda v: collectives.reduce_scatter(v, "x")))
    out.append(
        ("all_gather_ring8", (("x", 8),), lambda v: collectives.all_gather(v[: v.size // 8], "x"))
    )
    out.append(
        ("all_gather_ring2", (("x", 2),), lambda v: collectives.all_gather(v[: v.size // 2], "x"))
    )
    out.append(
        (
            "permute_swap_pieces",
            (("x", 8),),
            lambda v: collectives.permute(
                v, "x", [(j, j ^ 1) for j in range(8)], exchange_piece_bytes=1024
            ),
        )
    )
    return out


def write(folder: Path) -> int:
    """Lower every case at every size into ``folder``; return how many programs were written."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    folder.mkdir(parents=True, exist_ok=True)
    written = 0
    for name, axes, body in _cases():
        names = tuple(a for a, _ in axes)
        shape = [s for _, s in axes]
        count = int(np.prod(shape))
        mesh = Mesh(np.array(jax.devices()[:count]).reshape(shape), names)
        spec = P(names)
        fn = jax.shard_map(
            lambda v, body=body: body(v[0])[None],
            mesh=mesh,
            in_specs=spec,
            out_specs=spec,
            check_vma=False,
        )
        for size in SIZES:
            x = jax.ShapeDtypeStruct((count, size), np.float32, sharding=NamedSharding(mesh, spec))
            text = jax.jit(fn).lower(x).as_text()
            (folder / f"{name}_{size}.mlir").write_text(text)
            written += 1
    return written


# (name, recipe, overrides) of every train step --steps lowers: each changes the program.
STEP_RECIPES = (
    ("dp_native", "mnist_small_batch", ()),
    ("dp_torus2d", "mnist_small_batch", ("mesh=torus-4x2", "allreduce=torus2d")),
    ("dp_auto_sfb", "mnist_small_batch", ("allreduce=auto", "sfb_layers=all", "links=10us:1GB/s")),
    ("dp_ramp", "mnist_large_batch_ramp", ()),
    ("dp_accumulation", "mnist_small_batch", ("max_per_device_batch=2",)),
    (
        "dp_auto_sfb_accumulation",
        "mnist_small_batch",
        ("allreduce=auto", "sfb_layers=all", "links=10us:1GB/s", "max_per_device_batch=2"),
    ),
    ("pipeline_1f1b", "mnist_pipeline", ()),
    ("pipeline_gpipe_ring", "mnist_pipeline", ("pipeline.schedule=gpipe", "allreduce=ring")),
    (
        "pipeline_interleaved",
        "mnist_pipeline",
        (
            "pipeline.schedule=interleaved",
            "pipeline.chunks=2",
            "pipeline.boundaries=(0, 2, 3, 4, 5, 6, 7, 8)",
        ),
    ),
)


def _trainer_api():
    """The recipe loader and trainer, wherever this checkout keeps them."""
    try:
        from jaxdist.run.config import apply_overrides, load_recipe
        from jaxdist.run.trainer import Trainer
    except ImportError:
        from jaxdist.training.config import apply_overrides, load_recipe
        from jaxdist.training.trainer import Trainer
    return load_recipe, apply_overrides, Trainer


def write_steps(folder: Path) -> int:
    """Lower the train step of every batch stage of every :data:`STEP_RECIPES` entry."""
    import tempfile

    import jax
    import numpy as np

    load_recipe, apply_overrides, trainer_class = _trainer_api()
    folder.mkdir(parents=True, exist_ok=True)
    written = 0
    for name, recipe, overrides in STEP_RECIPES:
        config = apply_overrides(load_recipe(recipe), overrides)
        with tempfile.TemporaryDirectory() as workdir:
            trainer = trainer_class(config, workdir)
            state = trainer.initial_state()
            for stage, plan in enumerate(trainer.parts.plans):
                step = trainer.train_step_for(stage)
                spec = trainer.parts.task.batch_spec(plan.global_batch_size)
                batch = {k: np.zeros(v.shape, v.dtype) for k, v in spec.items()}
                lowered = step.lower(state, step.shard_batch(batch), jax.random.PRNGKey(0))
                (folder / f"step_{name}_stage{stage}.mlir").write_text(lowered.as_text())
                written += 1
    return written


def compare(before: Path, after: Path) -> int:
    """Print every program that differs or is missing; return the number of differences."""
    names = sorted({p.name for p in before.glob("*.mlir")} | {p.name for p in after.glob("*.mlir")})
    differ = 0
    for name in names:
        a, b = before / name, after / name
        if not (a.exists() and b.exists()):
            print(f"only in {'before' if a.exists() else 'after'}: {name}")
            differ += 1
        elif hashlib.sha256(a.read_bytes()).digest() != hashlib.sha256(b.read_bytes()).digest():
            print(f"differs: {name}")
            differ += 1
    print(f"{len(names) - differ} of {len(names)} programs identical")
    return differ


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path, help="output folder, or two to compare")
    parser.add_argument("--compare", action="store_true", help="compare two folders written before")
    parser.add_argument(
        "--steps", action="store_true", help="also the train steps the trainer builds"
    )
    args = parser.parse_args(argv)
    if args.compare:
        if len(args.folders) != 2:
            parser.error("--compare takes two folders")
        return 1 if compare(*args.folders) else 0
    if len(args.folders) != 1:
        parser.error("give one output folder")
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )
    written = write(args.folders[0])
    if args.steps:
        written += write_steps(args.folders[0])
    print(f"{written} programs written to {args.folders[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tensor parallelism's step time on 8 CPU devices: each schedule beside the replicated step.

    python benchmarks/tensor_parallel.py --json benchmarks/results/tensor_parallel_cpu.json

The transformer language model (synthetic tokens, AdamW) trained by
``jaxdist.training.train_step.TrainStep`` in three ways on the same 8 devices and the same
global batch, timed in interleaved rounds (``jaxdist.bench.timing``):

* ``replicated``: one data axis of 8;
* ``tensor native``: ``data=2,tensor=4``, the partial products summed by XLA's all-reduce;
* ``tensor collective_matmul``: the same mesh, summed by the ppermute collective matmul.

On CPU the devices share the host's cores and memory, so tensor parallelism cannot win here:
the figure says what the schedules cost in dispatch and copies, and that both run. Their
communication hidden on accelerators is what ``jaxdist plan`` walks (docs/sharding.md).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import json
import statistics
from pathlib import Path

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from jaxdist.bench.timing import interleaved_rounds, warm_up
from jaxdist.comm.tensor_parallel import TensorParallel
from jaxdist.run.config import load_recipe
from jaxdist.tasks import Replicas
from jaxdist.tasks.language_model import LanguageModel
from jaxdist.training import logical_axes
from jaxdist.training.step_options import Communication
from jaxdist.training.train_step import TrainStep


def _task(layers: int, width: int, seq_len: int) -> LanguageModel:
    config = load_recipe("recipes/transformer_lm.py")
    config.model.num_layers, config.model.d_model, config.model.num_heads = layers, width, 8
    config.model.mlp, config.model.norm, config.model.positions = "swiglu", "rmsnorm", "rotary"
    config.model.vocab_size = 1024
    config.data.source, config.data.seq_len = "synthetic", seq_len
    config.data.synthetic_train_windows = 256
    return LanguageModel(config, Replicas("data", 8))


def _step(task: LanguageModel, mesh: Mesh, data_axes: str, schedule: str | None) -> TrainStep:
    tensor = None
    if schedule is not None:
        shapes, _ = jax.eval_shape(task.init_variables, jax.random.key(0))
        dims = logical_axes.split_dims(
            task.logical_axes().names,
            logical_axes.DEFAULT_RULES,
            "tensor",
            shapes,
            mesh.shape["tensor"],
        )
        tensor = TensorParallel(dims, schedule=schedule)
    return TrainStep(
        task.loss,
        optax.adamw(1e-3),
        mesh,
        data_axes=data_axes,
        communication=Communication("native"),
        tensor=tensor,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    task = _task(args.layers, args.width, args.seq_len)
    devices = np.array(jax.devices()[:8])
    variants = {
        "replicated": (Mesh(devices, ("data",)), "data", None),
        "tensor native": (Mesh(devices.reshape(2, 4), ("data", "tensor")), "data", "native"),
        "tensor collective_matmul": (
            Mesh(devices.reshape(2, 4), ("data", "tensor")),
            "data",
            "collective_matmul",
        ),
    }
    params, model_state = task.init_variables(jax.random.key(0))
    iterator = task.data.train_iterator(args.batch)
    batch = next(iterator)
    iterator.close()
    runners, losses = {}, {}
    for name, (mesh, data_axes, schedule) in variants.items():
        step = _step(task, mesh, data_axes, schedule)
        box = {"state": step.init(params, model_state)}
        placed = step.shard_batch(batch)

        def run(step=step, box=box, placed=placed):
            box["state"], metrics = step(box["state"], placed, jax.random.key(1))
            return metrics["loss"]

        runners[name] = run
        losses[name] = float(run())
    compile_seconds = warm_up(runners, warmup=1)
    seconds = interleaved_rounds(runners, args.steps, args.rounds)
    median = {name: statistics.median(s) for name, s in seconds.items()}
    base = median["replicated"]
    print(
        f"{args.layers} layers x {args.width}, sequences of {args.seq_len}, global batch "
        f"{args.batch}, 8 CPU devices; median of {args.rounds} rounds of {args.steps} steps"
    )
    for name, value in median.items():
        print(
            f"  {name:<26} {value * 1e3:8.1f} ms/step  {value / base:5.2f}x replicated  "
            f"(first loss {losses[name]:.5f})"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "config": vars(args) | {"json": str(args.json)},
                    "median_seconds": median,
                    "seconds": seconds,
                    "ratio_to_replicated": {k: v / base for k, v in median.items()},
                    "first_loss": losses,
                    "compile_seconds": compile_seconds,
                    "devices": jax.device_count(),
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()

"""Step time of a pipeline against data parallelism on the same devices, across hosts.

    sudo jaxdist cluster --hosts 8 --bandwidth 1gbit -- \\
        python benchmarks/pipeline_vs_data_parallel.py --json results.json

One device per process. The model is of large dense layers (a 6272-wide input, seven
1024-wide layers, a 1000-way output: 13.7M parameters, 52 MiB), the global batch the same for
every variant. Data parallelism runs over all devices (ring allreduce); the pipeline over
``pipeline-2x4`` (2 replicas x 4 stages, 8 micro-batches per replica, GPipe and 1F1B) with its
stage gradients ring-allreduced over the 2 replicas, and 1F1B under FSDP (each stage's state
split over the 2 replicas: its parameters ring-gathered before the first tick, its gradients
ring-reduce-scattered after the last). Each variant also runs without its gradient allreduce
(FSDP: against 1F1B without one); the difference is what its collectives add to a step. Variants are timed in
interleaved rounds (:func:`jaxdist.bench.timing.interleaved_rounds`). Beside each, the bytes
each device sends per step (for the pipeline: the largest stage's devices) and the cost
model's communication time on the cluster's links (``JAXDIST_LINK_*``, or ``--link``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np

INPUT, WIDTHS = 6272, (1024,) * 7 + (1000,)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=16, help="examples per micro-batch")
    parser.add_argument("--iters", type=int, default=5, help="timed rounds")
    parser.add_argument("--link", default=None, help="LATENCY:BANDWIDTH (default: the cluster's)")
    parser.add_argument("--json", default=None, help="write the rows here (process 0)")
    args = parser.parse_args(argv)

    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    from jaxdist import meshes
    from jaxdist.bench import timing
    from jaxdist.comm import cost_model
    from jaxdist.pipeline import stages as pipeline_stages
    from jaxdist.pipeline.step import PipelineStep
    from jaxdist.runtime import distributed
    from jaxdist.training.batches import local_rows
    from jaxdist.training.step_options import NO_ALLREDUCE, Communication, StateSharding
    from jaxdist.training.train_step import TrainStep

    distributed.initialize()
    if jax.device_count() != 8:
        raise SystemExit(
            f"pipeline_vs_data_parallel.py: needs 8 devices, found {jax.device_count()}"
        )

    class Dense(nn.Module):
        features: int

        @nn.compact
        def __call__(self, x, *, train=True):
            return nn.relu(nn.Dense(self.features)(x))

    layers = [Dense(w) for w in WIDTHS]
    modules = [pipeline_stages.Chain(g) for g in pipeline_stages.cut(layers, stages=4)]
    whole = pipeline_stages.Chain(layers)
    example = jnp.zeros((1, INPUT))
    whole_params = whole.init(jax.random.key(0), example, train=False)["params"]
    stage_params, _ = pipeline_stages.init_flax_stages(modules, jax.random.key(0), example)

    replicas, M, b = 2, args.microbatches, args.micro_batch
    batch_size = replicas * M * b
    rng = np.random.default_rng(0)
    host_batch = {
        "x": rng.normal(size=(batch_size, INPUT)).astype(np.float32),
        "label": rng.integers(0, WIDTHS[-1], size=(batch_size,)).astype(np.int32),
    }

    def cross_entropy(logits, batch):
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return loss, {}

    def whole_loss(params, model_state, batch, rng):
        logits = whole.apply({"params": params}, batch["x"], train=True)
        return cross_entropy(logits, batch)[0], (model_state, {})

    sgd = optax.sgd(0.01, 0.9)
    runners, steps = {}, {}
    data_mesh = meshes.ring(8, axis_name="data")
    for name, allreduce in (
        ("data parallel", "ring"),
        ("data parallel, no allreduce", NO_ALLREDUCE),
    ):
        step = TrainStep(whole_loss, sgd, data_mesh, communication=Communication(allreduce))
        state = step.init(whole_params)
        batch = step.shard_batch(local_rows(host_batch, data_mesh, step.data_axes))
        runners[name] = _runner(step, state, batch, jax)
        steps[name] = step
    pipeline_mesh = meshes.build("pipeline-2x4")
    pipelines = [
        (schedule, suffix, allreduce, "replicated")
        for schedule in ("gpipe", "1f1b")
        for suffix, allreduce in (("", "ring"), (", no allreduce", NO_ALLREDUCE))
    ]
    pipelines.append(("1f1b", ", fsdp", "ring", "fsdp"))
    for schedule, suffix, allreduce, sharding in pipelines:
        step = PipelineStep(
            pipeline_stages.flax_stages(modules),
            cross_entropy,
            sgd,
            pipeline_mesh,
            microbatches=M,
            schedule=schedule,
            communication=Communication(allreduce),
            sharding=StateSharding(sharding),
            inputs=lambda batch: batch["x"],
        )
        state = step.init(stage_params)
        batch = step.shard_batch(local_rows(host_batch, pipeline_mesh, step.data_axes))
        runners[f"pipeline {schedule}{suffix}"] = _runner(step, state, batch, jax)
        steps[f"pipeline {schedule}{suffix}"] = step

    link = _link(args.link)  # before timing: a bad link fails at once
    timing.warm_up(runners, warmup=1)
    seconds = timing.interleaved_rounds(runners, steps=1, rounds=args.iters)
    if jax.process_index() != 0:
        return 0

    model_bytes = sum(4 * x.size for x in jax.tree.leaves(whole_params))
    rows = []
    for name, times in seconds.items():
        row = {"variant": name, "step_seconds": statistics.median(times)}
        if name == "data parallel":
            row["bytes_sent"] = 2 * 7 / 8 * model_bytes
            row["predicted_communication"] = cost_model.predict("ring", model_bytes, (8,), link)
        elif name.startswith("pipeline") and "no allreduce" not in name:
            # Over 2 replicas FSDP's gather and reduce-scatter send what the allreduce sends.
            sent = steps[name].bytes_per_step()
            gradient = sent["gradient_bytes"]
            row["bytes_sent"] = sent["messages"] * sent["message_bytes"] + gradient
            row["predicted_communication"] = sent["messages"] * (
                link.alpha + sent["message_bytes"] * link.beta
            ) + cost_model.predict("ring", gradient, (replicas,), link)
        rows.append(row)
    by_name = {r["variant"]: r for r in rows}
    print(
        f"# 8 devices, batch {batch_size}, model {model_bytes / 2**20:.0f} MiB; links "
        f"{link.alpha * 1e6:g} us, {link.bandwidth / 1e6:g} MB/s"
    )
    print(
        "| variant | step (s) | allreduce adds (s) | bytes sent per device | predicted communication (s) |"
    )
    print("|---|---|---|---|---|")
    for row in rows:
        without = row["variant"].replace(", fsdp", "")
        base = by_name.get(f"{without}, no allreduce")
        adds = f"{row['step_seconds'] - base['step_seconds']:.3f}" if base else ""
        sent = f"{row['bytes_sent'] / 2**20:.0f} MiB" if "bytes_sent" in row else ""
        predicted = f"{row['predicted_communication']:.3f}" if "bytes_sent" in row else ""
        print(f"| {row['variant']} | {row['step_seconds']:.3f} | {adds} | {sent} | {predicted} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "batch": batch_size,
                    "model_bytes": model_bytes,
                    "rows": rows,
                    "link": {"alpha": link.alpha, "beta": link.beta},
                },
                f,
                indent=1,
            )
    return 0


def _runner(step, state, batch, jax):
    holder = {"state": state}

    def run():
        holder["state"], metrics = step(holder["state"], batch, jax.random.key(0))
        return metrics

    return run


def _link(text):
    """``--link``, else the link ``jaxdist cluster`` capped every host at."""
    from jaxdist.comm import hybrid
    from jaxdist.comm.emulated_link import link_rate_from_environment

    if not text and link_rate_from_environment() is None:
        raise SystemExit("pipeline_vs_data_parallel.py: give --link, or run under jaxdist cluster")
    return hybrid.resolve_links(text or None, (8,)).flat


if __name__ == "__main__":
    sys.exit(main())

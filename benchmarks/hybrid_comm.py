"""Sufficient factors and allreduce="auto" against the ring, across hosts.

    jaxdist cluster --hosts 4 --bandwidth 1gbit -- \\
        env JAX_PLATFORMS=cpu python benchmarks/hybrid_comm.py --model vgg-head --json out.json

One device per process (or forced CPU devices in one process, with ``--link``). Two parts:

1. Each candidate dense layer's communication alone: a ring allreduce of its ``m x n`` float32
   gradient, against a ring all-gather of its factors (``rows x (m + n)``), and against that
   all-gather plus the matrix product that rebuilds the mean gradient.
2. Whole train steps (plain SGD) with the ring for every gradient, with every candidate layer
   as factors (the rest by the ring), and with ``allreduce="auto"``; each beside the same step
   with no gradient averaging at all, so that ``step - no averaging`` is what the averaging
   adds (the rebuild's matrix product included, the local kernel gradient it replaces taken
   off).

Beside every figure: the bytes each device sends and the cost model's prediction on the
cluster's links (``JAXDIST_LINK_*``) or ``--link``. Models: ``vgg-head`` (25088 -> 4096 ->
4096 -> 1000, Poseidon's showcase) and ``resnet50`` (only its 2048 x 1000 classifier is a
candidate; ``--image-size`` keeps its convolutions affordable on a CPU, and does not change
any gradient's size).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys

import numpy as np


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("vgg-head", "resnet50"), default="vgg-head")
    parser.add_argument("--per-device", type=int, default=32, help="examples per device")
    parser.add_argument("--image-size", type=int, default=64, help="resnet50 input size")
    parser.add_argument("--iters", type=int, default=3, help="timed rounds")
    parser.add_argument("--link", default=None, help="LATENCY:BANDWIDTH (default: the cluster's)")
    parser.add_argument(
        "--flops",
        type=float,
        default=None,
        help="a device's matrix-product rate for pricing the rebuild (default: "
        "measured here, all devices at once; 0: leave the rebuild out)",
    )
    parser.add_argument("--json", default=None, help="write the results here (process 0)")
    args = parser.parse_args(argv)

    import jax

    from jaxdist import meshes
    from jaxdist.bench import timing
    from jaxdist.comm import hybrid
    from jaxdist.runtime import distributed

    distributed.initialize()
    devices = jax.device_count()
    mesh = meshes.ring(devices, axis_name="data")
    init, example, loss_fn, layers = _model(args)
    links = hybrid.resolve_links(args.link, (devices,))
    if args.flops is None:
        largest = max(layers, key=lambda layer: layer[1] * layer[2])
        flops = _matmul_rate(mesh, largest, args.per_device, timing)
    else:
        flops = args.flops or None
    links = dataclasses.replace(links, flops=flops)
    params, model_state = init()
    batch = _batch(args, example, devices)
    say = print if jax.process_index() == 0 else (lambda *a, **k: None)
    say(
        f"# {args.model}, {devices} devices, {args.per_device} examples per device; links "
        f"{links.flat.alpha * 1e6:g} us, {links.flat.bandwidth / 1e6:g} MB/s ({links.source}); "
        f"matrix products {flops / 1e9 if flops else 0:.1f} GFLOP/s per device"
    )

    layer_rows = _layer_communication(mesh, layers, args.per_device, links, args.iters, timing)
    say("\n| layer | path | bytes sent per device | measured (s) | predicted (s) |")
    say("|---|---|---|---|---|")
    for row in layer_rows:
        say(
            f"| {row['layer']} | {row['path']} | {row['bytes_sent'] / 2**20:.2f} MiB | "
            f"{row['seconds']:.3f} | {row['predicted']:.3f} |"
        )

    step_rows = _steps(
        mesh, loss_fn, (params, model_state), batch, layers, links, args.iters, timing
    )
    say("\n| variant | step (s) | averaging adds (s) | bytes sent per device | predicted (s) |")
    say("|---|---|---|---|---|")
    for row in step_rows:
        say(
            f"| {row['variant']} | {row['step']:.3f} | {row['adds']:.3f} | "
            f"{row['bytes_sent'] / 2**20:.1f} MiB | {row['predicted']:.3f} |"
        )
    if args.json and jax.process_index() == 0:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "model": args.model,
                    "devices": devices,
                    "per_device": args.per_device,
                    "link": {"alpha": links.flat.alpha, "beta": links.flat.beta},
                    "flops": links.flops,
                    "layers": layer_rows,
                    "steps": step_rows,
                },
                f,
                indent=1,
            )
        print(f"wrote {args.json}")
    return 0


def _model(args):
    """(init -> (params, model_state), example inputs, loss_fn, candidate layers as
    (path, m, n))."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from jaxdist.training.classifier_loss import classifier_loss

    if args.model == "vgg-head":

        class VGGHead(nn.Module):
            @nn.compact
            def __call__(self, x, train=True):
                x = nn.relu(nn.Dense(4096, name="fc6")(x))
                x = nn.relu(nn.Dense(4096, name="fc7")(x))
                return nn.Dense(1000, name="fc8")(x)

        model = VGGHead()
        example = jnp.zeros((1, 25088), jnp.float32)
        layers = [("fc6", 25088, 4096), ("fc7", 4096, 4096), ("fc8", 4096, 1000)]
    else:
        from jaxdist.models import resnet50

        model = resnet50(num_classes=1000)  # BatchNorm statistics per device, averaged
        example = jnp.zeros((1, args.image_size, args.image_size, 3), jnp.float32)
        layers = [("head", 2048, 1000)]

    def init():
        variables = dict(model.init(jax.random.key(0), example, train=False))
        return variables.pop("params"), variables

    return init, example, classifier_loss(model, num_classes=1000), layers


def _batch(args, example, devices):
    rng = np.random.default_rng(0)
    n = args.per_device * devices
    x = rng.standard_normal((n, *example.shape[1:])).astype(np.float32)
    return {"image": x, "label": rng.integers(0, 1000, n).astype(np.int32)}


def _matmul_rate(mesh, layer, rows, timing) -> float:
    """FLOP/s of one device forming ``X^T G`` for ``layer`` from every device's ``rows`` rows,
    with all devices computing at once (as they do in a step)."""
    import jax.numpy as jnp

    from jaxdist.bench.allreduce import make_input, per_device

    _, m, n = layer
    total_rows = mesh.size * rows

    def product(flat):
        factors = flat.reshape(total_rows, m + n)
        return (factors[:, :m].T @ factors[:, m:]).reshape(-1)

    fn, x = per_device(mesh, product), make_input(mesh, total_rows * (m + n), jnp.float32, 0)
    runners = {"product": lambda: fn(x)}
    timing.warm_up(runners, warmup=1)
    seconds = statistics.median(timing.interleaved_rounds(runners, steps=1, rounds=3)["product"])
    return 2 * total_rows * m * n / seconds


def _layer_communication(mesh, layers, rows, links, iters, timing):
    """Part 1: ring allreduce of each layer's gradient against its factors' all-gather."""
    import jax.numpy as jnp

    from jaxdist.bench.allreduce import make_input, per_device
    from jaxdist.comm import collectives, cost_model, hybrid
    from jaxdist.comm.sufficient_factors import mean_gradient_from_factors

    devices = mesh.size
    runners, meta = {}, {}
    for path, m, n in layers:

        def gather(flat, m=m):
            return collectives.all_gather(flat, "data")

        def rebuild(flat, m=m, n=n):
            factors = flat.reshape(rows, m + n)
            return mean_gradient_from_factors(factors[:, :m], factors[:, m:], "data").reshape(-1)

        def ring(flat):
            return collectives.allreduce(flat, "data", "ring", op="mean")

        factor_bytes, kernel_bytes = rows * (m + n) * 4, m * n * 4
        gather_seconds = hybrid.predict_factor_gather(factor_bytes, (devices,), links)
        for label, body, count, predicted, sent in (
            (
                "ring allreduce",
                ring,
                m * n,
                cost_model.predict("ring", kernel_bytes, (devices,), links.flat),
                2 * (devices - 1) / devices * kernel_bytes,
            ),
            (
                "factors: all-gather",
                gather,
                rows * (m + n),
                gather_seconds,
                (devices - 1) * factor_bytes,
            ),
            (
                "factors: all-gather + rebuild",
                rebuild,
                rows * (m + n),
                gather_seconds + (2 * devices * rows * m * n / links.flops if links.flops else 0),
                (devices - 1) * factor_bytes,
            ),
        ):
            name = f"{path} {m}x{n}: {label}"
            fn, x = per_device(mesh, body), make_input(mesh, count, jnp.float32, seed=0)
            runners[name] = lambda fn=fn, x=x: fn(x)
            meta[name] = {
                "layer": f"{path} {m}x{n}",
                "path": label,
                "bytes_sent": sent,
                "predicted": predicted,
            }
    timing.warm_up(runners, warmup=1)
    seconds = timing.interleaved_rounds(runners, steps=1, rounds=iters)
    return [{**meta[name], "seconds": statistics.median(times)} for name, times in seconds.items()]


def _steps(mesh, loss_fn, variables, batch, layers, links, iters, timing):
    """Part 2: whole steps, each beside the same step without gradient averaging."""
    import jax
    import optax

    from jaxdist.training.batches import local_rows
    from jaxdist.training.step_options import NO_ALLREDUCE, Communication
    from jaxdist.training.train_step import TrainStep

    candidates = [path for path, _, _ in layers]
    variants = {
        "ring": Communication("ring", links=links),
        "factors for " + ", ".join(candidates): Communication(
            "ring", sfb_layers=candidates, links=links
        ),
        "auto": Communication("auto", sfb_layers=candidates, links=links),
        "no averaging": Communication(NO_ALLREDUCE, links=links),
    }
    runners, steps = {}, {}
    holder = {}
    for name, communication in variants.items():
        step = TrainStep(loss_fn, optax.sgd(1e-4), mesh, communication=communication)
        if "state" not in holder:  # one state for all: they share its structure and memory
            holder["state"] = step.init(*variables)
        sharded = step.shard_batch(local_rows(batch, mesh, "data"))

        def run(step=step, sharded=sharded):
            holder["state"], metrics = step(holder["state"], sharded, jax.random.key(0))
            return metrics

        runners[name], steps[name] = run, step
    timing.warm_up(runners, warmup=1)
    seconds = timing.interleaved_rounds(runners, steps=1, rounds=iters)
    base = statistics.median(seconds["no averaging"])
    rows = []
    for name, times in seconds.items():
        if name == "no averaging":
            continue
        routes = [r for r in steps[name].plan().routes if r.in_total]
        rows.append(
            {
                "variant": name,
                "step": statistics.median(times),
                "adds": statistics.median(times) - base,
                "bytes_sent": sum(r.sent_bytes for r in routes),
                "predicted": sum(r.seconds for r in routes),
                "plan": steps[name].plan().table(),
            }
        )
    rows.append(
        {
            "variant": "no averaging",
            "step": base,
            "adds": 0.0,
            "bytes_sent": 0.0,
            "predicted": 0.0,
            "plan": "",
        }
    )
    if jax.process_index() == 0:
        print("\n# auto's plan\n" + steps["auto"].plan().table())
    return rows


if __name__ == "__main__":
    sys.exit(main())

"""1x1 convolutions of ResNet-50 as ``nn.Conv`` against :class:`jaxdist.models.PointwiseConv`.

    python benchmarks/conv1x1.py [--batch 8] [--rounds 5] [--json PATH]

Finds every 1x1 convolution of ResNet-50 at 224x224 by tracing the model (bottleneck reduce
and expand convolutions, strided projection shortcuts), then times forward and forward +
backward (gradients for input and kernel) of each distinct shape both ways, on one device, in
interleaved rounds (`jaxdist.bench.timing`); medians are printed, and the totals weight each shape by how often the
model uses it. Explains the model's share of `jaxdist bench resnet` (docs/models.md,
docs/performance.md).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics


def resnet50_pointwise_shapes(batch: int) -> collections.Counter:
    """``(side, in channels, out channels, stride) -> count`` over ResNet-50's 1x1 convs."""
    import flax.linen as nn
    import jax

    from jaxdist import models
    from jaxdist.models import PointwiseConv

    found: collections.Counter = collections.Counter()

    def record(next_fun, args, kwargs, context):
        module = context.module
        if isinstance(module, PointwiseConv) and context.method_name == "__call__":
            _, side, _, channels = args[0].shape
            found[(side, channels, module.features, module.strides)] += 1
        return next_fun(*args, **kwargs)

    model = models.resnet50()
    images = jax.ShapeDtypeStruct((batch, 224, 224, 3), jax.numpy.float32)
    with nn.intercept_methods(record):
        jax.eval_shape(lambda x: model.init(jax.random.key(0), x, train=False), images)
    return found


def _cells(ms: dict[str, float]) -> str:
    """Forward and forward + backward: conv ms, matmul ms and their ratio."""
    fwd, both = "forward", "forward+backward"
    return (
        f"{ms[f'conv {fwd}']:>9.1f} {ms[f'matmul {fwd}']:>7.1f} "
        f"{ms[f'conv {fwd}'] / ms[f'matmul {fwd}']:>5.1f} | "
        f"{ms[f'conv {both}']:>13.1f} {ms[f'matmul {both}']:>7.1f} "
        f"{ms[f'conv {both}'] / ms[f'matmul {both}']:>5.1f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()

    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from jaxdist.bench import timing
    from jaxdist.models import PointwiseConv

    def compiled(module: nn.Module, x: jax.Array):
        variables = module.init(jax.random.key(0), x)

        def loss(variables, x):
            return jnp.sum(module.apply(variables, x) ** 2)

        forward = jax.jit(module.apply).lower(variables, x).compile()
        backward = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(variables, x).compile()
        return {
            "forward": lambda: forward(variables, x),
            "forward+backward": lambda: backward(variables, x),
        }

    shapes = resnet50_pointwise_shapes(args.batch)
    rows = []
    print(f"# {jax.devices()[0].device_kind}, batch {args.batch}, float32, ms (median)")
    print(
        f"{'input':>14} {'out':>5} {'s':>2} {'n':>2} | {'fwd conv':>9} {'matmul':>7} {'x':>5} | "
        f"{'fwd+bwd conv':>13} {'matmul':>7} {'x':>5}"
    )
    for (side, cin, cout, stride), count in sorted(
        shapes.items(), key=lambda kv: (-kv[0][0], kv[0][1:])
    ):
        x = jax.random.normal(jax.random.key(1), (args.batch, side, side, cin))
        conv = compiled(nn.Conv(cout, (1, 1), stride, "VALID", use_bias=False), x)
        matmul = compiled(PointwiseConv(cout, stride), x)
        runners = {
            f"{way} {kind}": fn
            for way, fns in (("conv", conv), ("matmul", matmul))
            for kind, fn in fns.items()
        }
        timing.warm_up(runners, warmup=0)
        seconds = timing.interleaved_rounds(runners, steps=1, rounds=args.rounds)
        ms = {key: statistics.median(times) * 1e3 for key, times in seconds.items()}
        row = {
            "input": [args.batch, side, side, cin],
            "features": cout,
            "stride": stride,
            "count": count,
            **{f"{key} ms": value for key, value in ms.items()},
        }
        rows.append(row)
        print(f"{f'{side}x{side}x{cin}':>14} {cout:>5} {stride:>2} {count:>2} | {_cells(ms)}")
    # Weighted by use: the time all of ResNet-50's 1x1 convolutions take in one step.
    total = {
        key: sum(r["count"] * r[f"{key} ms"] for r in rows)
        for key in (
            "conv forward",
            "matmul forward",
            "conv forward+backward",
            "matmul forward+backward",
        )
    }
    print(f"{'all 1x1 convs':>26} | {_cells(total)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch": args.batch, "rows": rows, "model_total_ms": total}, f, indent=2)


if __name__ == "__main__":
    main()

"""1x1 convolutions of ResNet-50 as ``nn.Conv`` against :class:`jaxdist.models.PointwiseConv`.

    python benchmarks/conv1x1.py [--batch 8] [--rounds 5] [--json PATH]

Times forward and forward + backward (gradients for input and kernel) of every distinct 1x1
convolution shape in a ResNet-50 bottleneck at 224x224 (the reduce and expand convolutions of
each stage and the strided projection shortcuts), both ways, on one device, in interleaved
rounds; medians are printed. Explains the model's share of `jaxdist bench resnet`
(docs/models.md, docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

# (input side, input channels, output channels, stride): ResNet-50's 1x1 convolutions.
SHAPES = [
    (56, 64, 64, 1),  # stage 1 block 1 reduce
    (56, 256, 64, 1),  # stage 1 reduce
    (56, 64, 256, 1),  # stage 1 expand / projection
    (56, 256, 512, 2),  # stage 2 projection shortcut
    (28, 512, 128, 1),  # stage 2 reduce
    (28, 128, 512, 1),  # stage 2 expand
    (14, 1024, 256, 1),  # stage 3 reduce
    (14, 256, 1024, 1),  # stage 3 expand
    (7, 2048, 512, 1),  # stage 4 reduce
    (7, 512, 2048, 1),  # stage 4 expand
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()

    import flax.linen as nn
    import jax
    import jax.numpy as jnp

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

    rows = []
    print(f"# {jax.devices()[0].device_kind}, batch {args.batch}, float32, ms (median)")
    print(f"{'input':>14} {'out':>5} {'s':>2} | {'fwd conv':>9} {'matmul':>7} {'x':>5} | "
          f"{'fwd+bwd conv':>13} {'matmul':>7} {'x':>5}")  # fmt: skip
    for side, cin, cout, stride in SHAPES:
        x = jax.random.normal(jax.random.key(1), (args.batch, side, side, cin))
        conv = compiled(nn.Conv(cout, (1, 1), stride, "VALID", use_bias=False), x)
        matmul = compiled(PointwiseConv(cout, stride), x)
        runners = {(way, kind): fn for way, fns in (("conv", conv), ("matmul", matmul))
                   for kind, fn in fns.items()}  # fmt: skip
        for fn in runners.values():
            jax.block_until_ready(fn())
        seconds: dict = {key: [] for key in runners}
        for _ in range(args.rounds):
            for key, fn in runners.items():
                start = time.perf_counter()
                jax.block_until_ready(fn())
                seconds[key].append(time.perf_counter() - start)
        ms = {key: statistics.median(times) * 1e3 for key, times in seconds.items()}
        row = {
            "input": [args.batch, side, side, cin],
            "features": cout,
            "stride": stride,
            **{f"{way} {kind} ms": value for (way, kind), value in ms.items()},
        }
        rows.append(row)
        fwd, both = "forward", "forward+backward"
        print(
            f"{f'{side}x{side}x{cin}':>14} {cout:>5} {stride:>2} | "
            f"{ms['conv', fwd]:>9.1f} {ms['matmul', fwd]:>7.1f} "
            f"{ms['conv', fwd] / ms['matmul', fwd]:>5.1f} | "
            f"{ms['conv', both]:>13.1f} {ms['matmul', both]:>7.1f} "
            f"{ms['conv', both] / ms['matmul', both]:>5.1f}"
        )
    total = {key: sum(r[f"{key} ms"] for r in rows) for key in
             ("conv forward", "matmul forward", "conv forward+backward", "matmul forward+backward")}  # fmt: skip
    print(
        f"{'sum':>23} | {total['conv forward']:>9.1f} {total['matmul forward']:>7.1f} "
        f"{total['conv forward'] / total['matmul forward']:>5.1f} | "
        f"{total['conv forward+backward']:>13.1f} {total['matmul forward+backward']:>7.1f} "
        f"{total['conv forward+backward'] / total['matmul forward+backward']:>5.1f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch": args.batch, "rows": rows, "sum_ms": total}, f, indent=2)


if __name__ == "__main__":
    main()

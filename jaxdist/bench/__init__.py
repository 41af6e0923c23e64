"""Benchmarks: the collective benchmark (:mod:`~jaxdist.bench.allreduce`), the train step
against a plain step (:mod:`~jaxdist.bench.train_step`), ResNet-50 against the flax example
(:mod:`~jaxdist.bench.resnet`), the input pipeline (:mod:`~jaxdist.bench.data`), and fair
timing on a noisy machine (:mod:`~jaxdist.bench.timing`)."""

__all__: list[str] = []

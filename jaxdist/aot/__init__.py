"""Ahead-of-time compilation for TPU slices and GPU hosts that are not here, and plans
built on it.

With the TPU compiler installed (``pip install 'jaxdist[tpu]'``), a train step compiles for a
named slice (``"v5e:16x16"``) on any machine, CPU-only ones included; with JAX's CUDA plugin,
for GPU hosts (``"h100:4x8"``):

* :mod:`~jaxdist.aot.topology`: slice and host names and their compile-only devices;
* :mod:`~jaxdist.aot.chips`: each chip's published peak, memory and links;
* :mod:`~jaxdist.aot.compile`: a step compiled from shapes alone, with memory per chip,
  FLOPs and the scheduled program;
* :mod:`~jaxdist.aot.schedule`: the collectives of a scheduled program and the backward
  compute placed between their start and done;
* :mod:`~jaxdist.aot.predict`: step time and time-to-train;
* :mod:`~jaxdist.aot.published`: published runs and the calibration of the time model;
* :mod:`~jaxdist.aot.plan`: all of it for a recipe, what ``jaxdist plan`` prints.
"""

__all__: list[str] = []

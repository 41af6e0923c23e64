"""jaxdist: a JAX/XLA-native sharded training toolkit.

The package is layered; each layer uses only those above it::

    meshes, ring_order      device meshes as data, rings laid over a TPU slice
    comm/                   collectives (the allreduce family), cost_model, buckets,
                            sufficient_factors, hybrid
    training/               train_step, batchnorm, loss_scale, optim, batch_schedule,
                            trainer, config, checkpoint
    pipeline/               schedules, stages, step: pipeline parallelism over a stage axis
    models/, data/          what the recipes train on
    runtime/                distributed, launch, cluster, dispatch   (beside the layers)
    bench/                  allreduce, train_step, resnet, data, timing (beside the layers)
    cli/                    the ``jaxdist`` command

The library's modules can be reached by their short names: ``import jaxdist;
jaxdist.collectives.allreduce`` or ``from jaxdist import collectives, meshes, train_step``.
They are imported lazily, on first access, so that ``import jaxdist`` never initialises a
JAX backend before a caller had the chance to set ``XLA_FLAGS``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__version__ = "0.1.0"

# Short name -> the module it stands for.
_MODULES = {
    "meshes": "jaxdist.meshes",
    "comm": "jaxdist.comm",
    "collectives": "jaxdist.comm.collectives",
    "cost_model": "jaxdist.comm.cost_model",
    "buckets": "jaxdist.comm.buckets",
    "hybrid": "jaxdist.comm.hybrid",
    "training": "jaxdist.training",
    "train_step": "jaxdist.training.train_step",
    "batchnorm": "jaxdist.training.batchnorm",
    "loss_scale": "jaxdist.training.loss_scale",
    "optim": "jaxdist.training.optim",
    "batch_schedule": "jaxdist.training.batch_schedule",
    "trainer": "jaxdist.training.trainer",
    "config": "jaxdist.training.config",
    "checkpoint": "jaxdist.training.checkpoint",
    "pipeline": "jaxdist.pipeline",
    "models": "jaxdist.models",
    "data": "jaxdist.data",
    "runtime": "jaxdist.runtime",
    "distributed": "jaxdist.runtime.distributed",
    "launch": "jaxdist.runtime.launch",
    "cluster": "jaxdist.runtime.cluster",
    "dispatch": "jaxdist.runtime.dispatch",
    "bench": "jaxdist.bench",
}

__all__ = ["__version__", *_MODULES]


def __getattr__(name: str) -> ModuleType:
    if name in _MODULES:
        module = importlib.import_module(_MODULES[name])
        globals()[name] = module  # later lookups skip this function
        return module
    raise AttributeError(f"module 'jaxdist' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULES})

"""jaxdist: a JAX/XLA-native sharded training toolkit.

The package is layered; a module imports only its own package and the layers listed below
it (docs/README.md draws them; tests/test_import_graph.py checks it)::

    cli/                    the ``jaxdist`` command
    aot/, bench/            plans for pods that are not here; benchmarks
    run/                    trainer, recipe config, checkpoints, run log: a recipe, run
    tasks/                  what a recipe trains: model, loss, evaluation, data
    pipeline/               schedules, stages, step: pipeline parallelism over a stage axis
    training/               the Step protocol, train_step, batchnorm, loss_scale, optim, ...
    models/, data/          what the recipes train on
    runtime/                distributed, launch, cluster, dispatch
    comm/                   collectives (the allreduce family), cost_model, buckets, hybrid
    meshes, ring_order      device meshes as data, rings laid over a TPU slice

The library's modules can be reached by their short names, in every form Python offers:
``jaxdist.collectives.allreduce``, ``from jaxdist import collectives``, ``import
jaxdist.distributed`` and ``from jaxdist.config import load_recipe`` all reach the module the
short name stands for. They are imported lazily, on first access, so that ``import jaxdist``
never initialises a JAX backend before a caller had the chance to set ``XLA_FLAGS``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
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
    "run": "jaxdist.run",
    "trainer": "jaxdist.run.trainer",
    "config": "jaxdist.run.config",
    "checkpoint": "jaxdist.run.checkpoint",
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


class _ShortNameFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import jaxdist.<short name>`` (and ``from jaxdist.<short name> import ...``): the
    module the short name stands for, the same object under both names. Consulted after the
    real modules, so a short name never hides one."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, short = fullname.partition(".")
        real = _MODULES.get(short) if package == __name__ else None
        if real is None or real == fullname:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return importlib.import_module(_MODULES[spec.name.partition(".")[2]])

    def exec_module(self, module):
        """Nothing to run: the real module ran when it was imported."""


if not any(isinstance(f, _ShortNameFinder) for f in sys.meta_path):
    sys.meta_path.append(_ShortNameFinder())

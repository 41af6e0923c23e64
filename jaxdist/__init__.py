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

Each module has one name, its path (``from jaxdist.comm import collectives``, ``from
jaxdist.training.train_step import TrainStep``); docs/api.md lists what each exports.
``import jaxdist`` imports nothing else, so it never initialises a JAX backend before a
caller had the chance to set ``XLA_FLAGS``.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]

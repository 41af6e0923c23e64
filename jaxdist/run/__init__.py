"""A recipe, run: the trainer and what it keeps around the steps.

:mod:`~jaxdist.run.trainer` (:class:`~jaxdist.run.trainer.Trainer`: the loop, evaluation,
logs, checkpoints), :mod:`~jaxdist.run.config` (recipes and ``--set`` overrides),
:mod:`~jaxdist.run.from_config` (the mesh, model and optimizer a config names),
:mod:`~jaxdist.run.steps` and :mod:`~jaxdist.run.pipeline_config` (the one choice between a
data-parallel and a pipeline step), :mod:`~jaxdist.run.checkpoint` (self-healing
checkpoints), :mod:`~jaxdist.run.log` (progress, ``metrics.jsonl``, the event log) and
:mod:`~jaxdist.run.rerun` (what a rerun in the same workdir may change). It sits above both
:mod:`jaxdist.training` and :mod:`jaxdist.pipeline` and uses only their step interface.
"""

__all__: list[str] = []

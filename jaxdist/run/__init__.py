"""A recipe, run: the trainer and what it keeps around the steps.

:mod:`~jaxdist.run.trainer` (:class:`~jaxdist.run.trainer.Trainer`: the loop, resume,
evaluation, progress, checkpoints), :mod:`~jaxdist.run.hooks` (what the loop calls for
everything else: the event log, TensorBoard, the profiler, the watchdog, the workdir lock, the
rerun comparison, preemption, the non-finite guard; each a module of its own),
:mod:`~jaxdist.run.config` (recipes and ``--set`` overrides), :mod:`~jaxdist.run.build`
(the config resolved once into what a run uses), :mod:`~jaxdist.run.from_config` (the config
read once: batches, learning rate, optimizer, step options), :mod:`~jaxdist.run.pipeline_config` (a recipe's
pipeline step), :mod:`~jaxdist.run.checkpoint` (self-healing checkpoints) and
:mod:`~jaxdist.run.log` (progress and ``metrics.jsonl``). It sits above both
:mod:`jaxdist.training` and :mod:`jaxdist.pipeline` and uses only their step interface.
"""

__all__: list[str] = []

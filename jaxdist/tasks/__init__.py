"""Tasks: what a recipe trains (model, loss, evaluation, data), behind one interface.

* :mod:`~jaxdist.tasks.task` -- :class:`Task`, :class:`Replicas`, :class:`Data`;
* :mod:`~jaxdist.tasks.image_classification` -- ResNet classification, every recipe's
  default;
* :mod:`~jaxdist.tasks.language_model` -- a byte-level causal language model (flax NNX).

See ``docs/tasks.md``.
"""

from jaxdist.tasks.task import Data, PipelineParts, Replicas, Task

__all__ = ["Data", "PipelineParts", "Replicas", "Task"]

"""Evaluation on the train step's own layout: the transformer's held-out sums under FSDP
(HSDP, scanned layers or not) and split over a tensor axis (with the positions split, and
FSDP beside) are those of the whole model on one device, each device is handed only its
own shards, and the compiled evaluation holds no more per device than the train step, and
never the whole model at once."""

import math

import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

from jaxdist.comm import tensor_parallel as tp
from jaxdist.tasks import Replicas
from jaxdist.tasks.language_model import LanguageModel
from jaxdist.training import logical_axes
from jaxdist.training.eval_step import EvalStep
from jaxdist.training.step_options import StateSharding
from jaxdist.training.train_step import TrainStep
from tests.test_tasks import corpus_root, lm_config  # noqa: F401  (the fixture)

SHAPE = {"model.num_layers": 2, "model.d_model": 128, "model.num_heads": 4, "model.mlp_dim": 512}


def _mesh(shape, names):
    return Mesh(np.array(jax.devices()[: math.prod(shape)]).reshape(shape), names)


def _task(corpus_root, scanned):  # noqa: F811
    config = lm_config(corpus_root, **SHAPE, **{"model.scan_layers": scanned})
    return LanguageModel(config, Replicas("data", 1))


def _step(task, mesh, data_axes, sharding=StateSharding(), sequence=False):
    tensor = None
    if "tensor" in mesh.axis_names:
        shapes, _ = jax.eval_shape(task.init_variables, jax.random.key(0))
        names = task.logical_axes().names
        rules = logical_axes.DEFAULT_RULES
        dims = logical_axes.split_dims(names, rules, "tensor", shapes, mesh.shape["tensor"])
        tensor = tp.TensorParallel(dims, sequence=sequence)
    return TrainStep(
        task.loss,
        optax.adam(1e-3),
        mesh,
        data_axes=data_axes,
        sharding=sharding,
        stacked_layers=task.stacked_layers(),
        tensor=tensor,
    )


def _evaluate(task, step):
    state = step.init(*task.init_variables(jax.random.key(0)))
    evaluation = EvalStep(task.eval_sums, step.mesh, data_axes=step.data_axes, layout=step)
    with task.data.eval_iterator(16) as batches:
        batch = step.shard_batch(next(batches))
    sums = {k: float(v) for k, v in evaluation(state, batch).items()}
    return sums, state, batch, evaluation


@pytest.fixture(scope="module")
def one_device(corpus_root):  # noqa: F811
    runs = {}
    for scanned in (False, True):
        task = _task(corpus_root, scanned)
        runs[scanned] = _evaluate(task, _step(task, _mesh((1,), ("data",)), "data"))[0]
    return runs


CASES = [
    # mesh, data axes, sharding, scanned, sequence parallelism
    ((("data", 2), ("fsdp", 4)), ("data", "fsdp"), StateSharding("fsdp", axes="fsdp"), True, False),
    (
        (("data", 2), ("fsdp", 4)),
        ("data", "fsdp"),
        StateSharding("fsdp", axes="fsdp"),
        False,
        False,
    ),
    ((("fsdp", 4), ("tensor", 2)), "fsdp", StateSharding("fsdp"), False, True),
    ((("data", 2), ("tensor", 4)), "data", StateSharding(), False, False),
]


@pytest.mark.parametrize(("axes", "data_axes", "sharding", "scanned", "sequence"), CASES)
def test_an_evaluation_on_the_steps_shards_sums_as_one_device(
    corpus_root,  # noqa: F811
    one_device,
    axes,
    data_axes,
    sharding,
    scanned,
    sequence,
):
    names, sizes = zip(*axes)
    task = _task(corpus_root, scanned)
    step = _step(task, _mesh(sizes, names), data_axes, sharding, sequence)
    sums, state, batch, evaluation = _evaluate(task, step)
    expected = one_device[scanned]
    assert sums["count"] == expected["count"]
    np.testing.assert_allclose(sums["nll"], expected["nll"], rtol=1e-5)

    # Each device is handed its own shards only, and the compiled evaluation's memory per
    # device (arguments, temporaries) is at most the train step's.
    compiled = evaluation._step.lower(state.params, state.model_state, batch).compile()
    params_bytes = sum(
        leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(state.params)
    )
    whole_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(state.params))
    assert params_bytes < 0.7 * whole_bytes  # split over 4 devices or more, the embeddings aside
    eval_memory = compiled.memory_analysis()
    train = step.lower(state, batch_for_training(task, step), jax.random.key(0)).compile()
    train_memory = train.memory_analysis()
    held = eval_memory.argument_size_in_bytes + eval_memory.temp_size_in_bytes
    batch_bytes = sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(batch))
    model_state_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(state.model_state))
    expected_args = params_bytes + batch_bytes + model_state_bytes
    assert eval_memory.argument_size_in_bytes == pytest.approx(expected_args, abs=1024)
    assert held <= train_memory.argument_size_in_bytes + train_memory.temp_size_in_bytes
    if not scanned:  # (XLA:CPU keeps a scan's stacked operands in its loop buffers)
        assert eval_memory.temp_size_in_bytes < whole_bytes  # never the whole model at once


def batch_for_training(task, step):
    iterator = task.data.train_iterator(16)
    try:
        return step.shard_batch(next(iterator))
    finally:
        iterator.close()

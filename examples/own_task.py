"""Bring your own model: a recipe that defines its task inline and trains with `jaxdist train`.

The task is a small regression written in plain JAX (parameters are a dict of arrays, no
framework): a two-layer MLP fits y = sin(3x) + noise. Everything but the four task methods
(mesh, allreduce, batch ramp, learning rate, resume, logs, checkpoints) is the toolkit's.

Command (2 CPU devices, a few seconds):
    jaxdist --cpu-devices 2 train examples/own_task.py --workdir runs/own_task
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist.data.records import ArrayRecords, RecordData
from jaxdist.run.config import base_config
from jaxdist.tasks import Task

HIDDEN = 64


def get_config():
    c = base_config()
    c.model.name = "sine_mlp"  # what the logs call the model; the task reads nothing else of it
    c.batch_size = 64
    c.num_epochs = 20.0
    c.optimizer.name = "adamw"
    c.optimizer.eps = 1e-8
    c.optimizer.weight_decay = 0.0
    c.lr.kind = "cosine"
    c.lr.peak = 1e-2
    c.lr.warmup_epochs = 1.0
    c.allreduce = "ring"
    c.eval_every_epochs = 5.0
    c.eval_batch_size = 256
    c.checkpoint.every_steps = 0
    c.log_every_steps = 100
    c.target_accuracy = 0.02  # mean squared error on the held-out points
    return c


def _points(count, seed):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, (count, 1)).astype(np.float32)
    y = np.sin(3 * x) + 0.05 * rng.standard_normal((count, 1)).astype(np.float32)
    return {"x": x, "y": y}


class SineRegression(Task):
    headline = "mse"
    higher_is_better = False

    def __init__(self, config, replicas):
        self.name = config.model.name
        self.data = RecordData(
            ArrayRecords(_points(4096, 0)), ArrayRecords(_points(512, 1)), seed=config.seed
        )

    def init_variables(self, rng):
        k1, k2 = jax.random.split(rng)
        params = {
            "w1": jax.random.normal(k1, (1, HIDDEN)) * 1.0,
            "b1": jnp.zeros(HIDDEN),
            "w2": jax.random.normal(k2, (HIDDEN, 1)) / jnp.sqrt(HIDDEN),
            "b2": jnp.zeros(1),
        }
        return params, {}  # no model state

    def _predict(self, params, x):
        return jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]

    def loss(self, params, model_state, batch, rng):
        mse = jnp.mean((self._predict(params, batch["x"]) - batch["y"]) ** 2)
        return mse, (model_state, {})

    def eval_sums(self, params, model_state, batch):
        errors = jnp.sum((self._predict(params, batch["x"]) - batch["y"]) ** 2, axis=-1)
        mask = batch["mask"].astype(jnp.float32)
        return {"mse": jnp.sum(errors * mask), "count": jnp.sum(mask)}


def get_task(config, replicas):
    return SineRegression(config, replicas)

"""The config resolved once (jaxdist.run.build): the parts a recipe builds, and a loop that
reads them, never the config, once the run is built."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from jaxdist.run.build import CheckpointSettings, LoopSettings, build_run
from jaxdist.run.config import ConfigError, load_recipe
from jaxdist.run.hooks import Hook
from jaxdist.run.log import read_metrics
from jaxdist.run.trainer import Trainer
from jaxdist.tasks.image_classification import ImageClassification
from tests.test_trainer import tiny_config


def test_the_mnist_recipe_resolves_into_parts_that_carry_its_settings(tmp_path):
    config = load_recipe("mnist_small_batch")
    config.max_steps = 3
    parts = build_run(config, tmp_path, task_factory=ImageClassification)

    assert parts.config is config  # kept as the run's record
    assert parts.settings == LoopSettings(
        seed=config.seed,
        log_every_steps=50,
        eval_every_epochs=1.0,
        eval_batch_size=1000,
        target_accuracy=0.98,
    )
    assert parts.checkpoint == CheckpointSettings(every_steps=0, keep=3, async_save=True)
    assert parts.total_steps == 3  # max_steps cuts the recipe's 10 epochs
    assert parts.num_replicas == 8 and parts.data_axes == "data"
    assert parts.resolved_devices() == {"mesh": "data=8"}
    assert parts.data is parts.task.data and parts.data.num_train_examples == 4000
    assert [p.global_batch_size for p in parts.plans] == [32]
    assert parts.train_step_for(0) is parts.train_steps[parts.plans[0].accumulation_steps]
    assert float(parts.lr_fn(1.0)) == pytest.approx(0.4 * 32 / 256)  # the peak, after warm-up
    assert not parts.shows_plans  # native all-reduce, no sufficient factors
    with pytest.raises(dataclasses.FrozenInstanceError):
        parts.settings.log_every_steps = 1


def test_a_bad_value_is_one_config_error_from_build_run(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"^the config cannot run here: eval_batch_size=100 "
        r"must be a multiple of the 8 data-parallel devices$",
    ):
        build_run(tiny_config(eval_batch_size=100), tmp_path, task_factory=ImageClassification)


class _FirstState(Hook):
    """The loop's state and RNG when it starts."""

    def resumed(self, loop, meta):
        self.params, self.base_rng = loop.state.params, loop.base_rng


def test_the_loop_reads_what_was_built_not_the_config(tmp_path):
    # 4 steps of 16 images; a report every 2 steps, a checkpoint every 2, one evaluation (at
    # the end), and a target the run cannot reach.
    config = tiny_config(
        max_steps=4,
        log_every_steps=2,
        target_accuracy=0.99,
        **{"checkpoint.every_steps": 2, "checkpoint.keep": 5},
    )
    first = _FirstState()
    trainer = Trainer(config, tmp_path, hooks=[first])
    # Changed after building: a loop that read the config now would report, evaluate and save
    # at every step, stop after one, keep one checkpoint, start from another seed, evaluate in
    # batches that do not split over the 8 devices and call the target reached.
    for key, value in {
        "log_every_steps": 1,
        "eval_every_epochs": 0.01,
        "max_steps": 1,
        "seed": 7,
        "eval_batch_size": 7,
        "target_accuracy": 0.0,
    }.items():
        config[key] = value
    config.checkpoint.every_steps, config.checkpoint.keep = 1, 1

    summary = trainer.run()
    assert summary["step"] == 4 and not summary["preempted"]
    metrics = read_metrics(tmp_path)
    assert [r["step"] for r in metrics["train"]] == [2, 4]
    assert [r["step"] for r in metrics["eval"]] == [4]
    saved = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert saved == [2, 4]
    assert np.array_equal(np.asarray(first.base_rng), np.asarray(jax.random.PRNGKey(0)))
    params, _ = trainer.parts.task.init_variables(jax.random.key(0))
    for got, want in zip(jax.tree.leaves(first.params), jax.tree.leaves(params), strict=True):
        assert np.array_equal(np.asarray(got), np.asarray(want))
    events = [
        json.loads(line.removeprefix(":::MLLOG "))
        for line in (tmp_path / "events.log").read_text().splitlines()
    ]
    assert events[-1]["key"] == "run_stop"
    assert events[-1]["metadata"]["status"] == "aborted"
    assert "stayed below target_accuracy 0.99" in events[-1]["metadata"]["reason"]

"""The event log of a short ResNet-50 LARS run passes MLPerf's compliance checker, across a
resume, apart from the accuracy target a few steps cannot reach.

The run reads a folder of JPEGs as uint8 and normalises on the device, so it is also the
default run's end-to-end test of an ImageNet recipe on files.
"""

from __future__ import annotations

import json
import logging

import pytest
from mlperf_logging.compliance_checker import mlp_compliance

from jaxdist.data.fake import write_image_folder
from jaxdist.run.config import apply_overrides, load_recipe
from jaxdist.run.trainer import Trainer

RULESET = "4.0.0"  # the last MLPerf Training round with ResNet-50
ACCURACY_TARGET_MISSED = (
    "Failed checks for eval_accuracy : v['value'] >= 0.7590 and v['value'] < 1.0"
)

# The recipe on 8 CPU devices: a 2x4 torus, 32x32 crops of a small JPEG folder (64 train and 16
# held-out images: 2 steps per epoch), a width-8 ResNet.
# ResNet-10 stands in for ResNet-50 (the log's keys and the checker's rules are the same; a
# deeper model only takes longer to compile), logged as MLPerf's ResNet benchmark.
TINY_LARS = [
    "mesh=torus-2x4",
    "model.name=resnet10",
    "mlperf.benchmark=resnet",
    "model.bn_group_size=2",
    "model.width=8",
    "model.dtype=float32",
    "data.source=folder",
    "data.image_size=32",
    "batch_size=32",
    "max_per_device_batch=4",
    "eval_batch_size=16",
    "eval_every_epochs=1",
    "max_steps=3",
    "log_every_steps=1",
    "checkpoint.every_steps=1",
    "mlperf.org=jaxdist-tests",
]


class Crash(Exception):
    pass


def crash_at(step):
    def on_step(done, _state):
        if done == step:
            raise Crash(f"crash after step {done}")

    return on_step


def compliance_messages(path) -> list[str]:
    """Every error and warning the checker reports for ``path``."""
    mlp_compliance.enqueued_configs.clear()
    checker = mlp_compliance.make_checker("training", RULESET, quiet=False, werror=False)
    previous = logging.getLogger().level
    logging.getLogger().setLevel(logging.ERROR)  # its progress lines go to the root logger
    try:
        checker.check_file(str(path), f"training_{RULESET}/common.yaml")
    finally:
        logging.getLogger().setLevel(previous)
    return [*checker.warnings.values(), *checker.overwritable.values(), *checker.not_overwritable]


def events(path) -> list[dict]:
    return [json.loads(line.split(" ", 1)[1]) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    """The recipe stopped by an error after step 2 of 3, then rerun to the end."""
    workdir = tmp_path_factory.mktemp("mlperf") / "run"
    root = write_image_folder(workdir.parent / "imagenet", 4, 16, 4, (36, 64))
    overrides = [*TINY_LARS, f"data.root={root}"]
    config = apply_overrides(load_recipe("resnet50_imagenet_mlperf_lars"), overrides)
    assert config.data.dtype == "uint8"  # normalised on the device
    with pytest.raises(Crash):
        Trainer(config, workdir).run(on_step=crash_at(2))
    Trainer(config, workdir).run()
    return workdir / "events.log"


def test_the_checker_finds_only_the_missed_accuracy_target(resumed_run, tmp_path):
    # The interrupted process closed its part with an aborted run_stop; MLPerf counts one run
    # per log, so that stop is left out here and the rest must pass as one run.
    lines = resumed_run.read_text().splitlines()
    first_stop = next(i for i, x in enumerate(lines) if '"key": "run_stop"' in x)
    one_run = tmp_path / "events.log"
    one_run.write_text("\n".join(lines[:first_stop] + lines[first_stop + 1 :]) + "\n")
    assert compliance_messages(one_run) == [ACCURACY_TARGET_MISSED]


def test_run_start_is_logged_once_across_the_resume(resumed_run):
    logged = events(resumed_run)
    keys = [e["key"] for e in logged]
    assert keys.count("run_start") == 1 and keys.count("init_start") == 1
    assert keys.count("run_resumed") == 1 and keys.count("submission_org") == 1
    resumed = next(e for e in logged if e["key"] == "run_resumed")
    assert resumed["metadata"]["step"] == 2
    stops = [e["metadata"] for e in logged if e["key"] == "run_stop"]
    assert stops[0]["status"] == "aborted" and stops[0]["reason"].startswith("Crash")
    assert stops[1]["status"] == "aborted" and "below target_accuracy" in stops[1]["reason"]


def test_the_header_reports_the_recipe(resumed_run):
    value = {e["key"]: e["value"] for e in events(resumed_run)}
    assert value["submission_benchmark"] == "resnet" and value["opt_name"] == "lars"
    assert value["submission_platform"] == "8xcpu"
    assert (value["train_samples"], value["eval_samples"]) == (64, 16)
    assert value["global_batch_size"] == 32 and value["gradient_accumulation_steps"] == 1
    assert value["model_bn_span"] == 8  # 4 images per device, statistics over 2 devices
    assert value["lars_opt_end_learning_rate"] == 1e-4 and value["lars_epsilon"] == 0.0
    # 57 epochs of 2 steps, the first 16 epochs warm-up.
    assert value["lars_opt_learning_rate_decay_steps"] == 2 * (57 - 16)


def test_resnet50_is_logged_as_mlperfs_resnet_benchmark():
    """Without ``mlperf.benchmark``, a ResNet-50 run is MLPerf's ``resnet``; another model is
    named by itself."""
    from jaxdist.run import mlperf

    assert mlperf._benchmark("resnet50") == "resnet"
    assert mlperf._benchmark("resnet18") == "resnet18"

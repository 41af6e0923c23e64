"""The trainer: exact resume (also across a batch-size stage boundary), SIGTERM, logs."""

import contextlib
import io
import json
import re
import shutil
import signal
import subprocess
import time
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from jaxdist.run.checkpoint import abstract_like
from jaxdist.run.config import base_config
from jaxdist.run.hooks import Hook
from jaxdist.run.trainer import Trainer
from jaxdist.training.protocol import Step
from jaxdist.training.train_step import TrainStep
from tests._procs import JAXDIST, clean_env

# A tiny run on the 8x8 digits (1,438 train images of 8x8): 16 images per step until
# 0.05 epochs (72 samples: steps 0-4), then 32 per step from step 5.
TINY = {
    "model.name": "resnet10",
    "model.stem": "small",
    "model.width": 4,
    "data.source": "digits",
    "batch_size": 32,
    "batch_ramp": ((0.05, 16),),
    "num_epochs": 1.0,
    "lr.warmup_epochs": 0.1,
    "lr.peak": 0.2,
    "eval_every_epochs": 0.0,
    "eval_batch_size": 360,
    "checkpoint.every_steps": 3,
    "log_every_steps": 2,
    "max_steps": 7,
}


def tiny_config(**overrides):
    config = base_config()
    for key, value in {**TINY, **overrides}.items():
        *parents, leaf = key.split(".")
        node = config
        for name in parents:
            node = node[name]
        node[leaf] = value
    return config


class Crash(Exception):
    pass


def _crash_at(step_to_crash):
    def on_step(step, state):
        if step == step_to_crash:
            raise Crash(f"simulated crash after step {step}")

    return on_step


def assert_same_abstract(got, want):
    """The same tree of ``ShapeDtypeStruct``s: shapes, dtypes and shardings."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert (x.shape, x.dtype, x.sharding) == (y.shape, y.dtype, y.sharding), (x, y)


def _assert_trees_equal(a, b, what):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b)
    for i, (x, y) in enumerate(zip(leaves_a, leaves_b, strict=True)):
        x, y = np.asarray(x), np.asarray(y)
        assert np.array_equal(x, y), (
            f"{what}: leaf {i} differs after resume (max |diff| {np.abs(x - y).max()})"
        )


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The tiny recipe trained start to end, no crash, with what it printed."""
    trainer = Trainer(tiny_config(), tmp_path_factory.mktemp("straight") / "run")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer.summary = trainer.run()
    trainer.printed = printed.getvalue()
    return trainer


def test_resume_is_bitwise_exact_across_a_ramp(straight, tmp_path, monkeypatch):
    summary = straight.summary
    assert summary["step"] == 7 and not summary["preempted"]
    schedule = straight.parts.schedule
    assert schedule.stage_index_at(4) == 0 and schedule.stage_index_at(5) == 1
    assert isinstance(straight.train_step_for(0), TrainStep)
    assert isinstance(straight.train_step_for(0), Step)

    # Crash after step 4: the newest checkpoint is step 3, inside the first (16-image) stage;
    # the resumed run redoes step 4 and crosses into the 32-image stage at step 5.
    # The resumed run reuses the crashed Trainer object only to skip recompiling (the slow
    # test below resumes in a fresh one); state, data position and LR come from the disk.
    workdir = tmp_path / "crashed"
    resumed = Trainer(tiny_config(), workdir)
    with pytest.raises(Crash):
        resumed.run(on_step=_crash_at(4))
    # The checkpoint is read into the initial state's shapes and shardings; nothing is
    # initialised for it to replace.
    assert_same_abstract(resumed.abstract_state(), abstract_like(resumed.initial_state()))
    monkeypatch.setattr(Trainer, "initial_state", lambda self: pytest.fail("initialised"))
    assert resumed.run()["step"] == 7

    _assert_trees_equal(resumed.state.params, straight.state.params, "params")
    _assert_trees_equal(resumed.state.model_state, straight.state.model_state, "batch stats")
    _assert_trees_equal(resumed.state.opt_state, straight.state.opt_state, "optimizer state")

    records = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in records if r["kind"] == "train"}
    assert train[4]["batch_size"] == 16 and train[6]["batch_size"] == 32
    events = (workdir / "events.log").read_text().splitlines()
    keys = [json.loads(line.removeprefix(":::MLLOG "))["key"] for line in events]
    assert keys.count("run_start") == 1 and keys.count("run_resumed") == 1
    assert keys[-1] == "run_stop"
    assert "eval_accuracy" in keys and "epoch_start" in keys


@pytest.mark.slow
def test_resume_after_the_ramp_continues_data_position(tmp_path):
    # Checkpoint at step 6 (second stage); the resumed run's data position must be the
    # straight run's: compare the last step's metrics, which depend on the batch content.
    config = dict(max_steps=8)
    straight = Trainer(tiny_config(**config), tmp_path / "straight")
    straight.run()
    workdir = tmp_path / "crashed"
    with pytest.raises(Crash):
        Trainer(tiny_config(**config), workdir).run(on_step=_crash_at(7))
    resumed = Trainer(tiny_config(**config), workdir)
    resumed.run()
    _assert_trees_equal(resumed.state.params, straight.state.params, "params")


SIGTERM_RECIPE = """
from jaxdist.run.config import base_config

def get_config():
    c = base_config()
    c.model.name = "resnet10"
    c.model.stem = "small"
    c.model.width = 4
    c.data.source = "digits"
    c.batch_size = 16
    c.num_epochs = 50.0
    c.lr.warmup_epochs = 1.0
    c.eval_every_epochs = 0.0
    c.eval_batch_size = 360
    c.checkpoint.every_steps = 0
    c.log_every_steps = 1
    return c
"""


# Beside other tests: the child trains for 50 epochs, far beyond the signal, and nothing is
# timed but a generous deadline.
@pytest.mark.parametrize(
    ("signum", "code", "said"),
    [
        (signal.SIGTERM, 143, "stopped by SIGTERM"),
        pytest.param(signal.SIGINT, 130, "stopped by Ctrl-C", marks=pytest.mark.slow),
    ],
)
def test_sigterm_and_ctrl_c_save_a_checkpoint_before_exit(tmp_path, signum, code, said):
    recipe = tmp_path / "tiny.py"
    recipe.write_text(SIGTERM_RECIPE)
    workdir = tmp_path / "run"
    env = clean_env()
    cmd = [*JAXDIST, "--cpu-devices", "2", "train", str(recipe)]
    proc = subprocess.Popen(
        [*cmd, "--workdir", str(workdir)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics = workdir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.5)
    assert proc.poll() is None, f"training exited early:\n{proc.communicate()[0]}"
    proc.send_signal(signum)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == code, f"expected exit {code}, got {proc.returncode}:\n{output}"
    assert said in output and "Traceback" not in output, output
    steps = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    assert steps, f"no checkpoint written; output:\n{output}"
    logged = max(json.loads(x)["step"] for x in metrics.read_text().splitlines())
    assert steps[-1] == logged, f"checkpoint at step {steps[-1]}, last logged step {logged}"
    meta = json.loads((workdir / "checkpoints" / str(steps[-1]) / "meta" / "metadata").read_text())
    assert meta["step"] == steps[-1] and meta["samples_seen"] == 16 * steps[-1]
    stop = json.loads((workdir / "events.log").read_text().splitlines()[-1].split(" ", 1)[1])
    assert stop["key"] == "run_stop" and stop["metadata"]["status"] == "aborted"
    assert stop["metadata"]["reason"] == f"preempted ({signal.Signals(signum).name})"


def test_a_finished_run_rerun_says_so_and_appends_nothing(straight, tmp_path, capsys):
    workdir = tmp_path / "run"
    shutil.copytree(straight.workdir, workdir)
    first = straight.summary
    written = {name: (workdir / name).read_text() for name in ("metrics.jsonl", "events.log")}
    capsys.readouterr()
    again = Trainer(tiny_config(), workdir).run()
    out = capsys.readouterr().out
    assert "already finished: step 7 of 7" in out and "resumed" not in out, out
    assert again["already_finished"] and again["step"] == first["step"] == 7
    # The eval it reports is the finished run's, read back from its metrics.
    assert again["top1"] == pytest.approx(first["top1"]) and "top5" in again
    for name, text in written.items():
        assert (workdir / name).read_text() == text, f"the rerun appended to {name}"


def test_progress_lines_carry_elapsed_time_and_an_eta(straight):
    lines = [x for x in straight.printed.splitlines() if x.startswith("step ")]
    assert lines, "no progress line"
    for line in lines:
        assert re.search(r"\| \d+(?:m\d\ds|s) elapsed, eta \d+(?:m\d\ds|s)$", line), line
    assert lines[-1].endswith("eta 0s"), lines[-1]


def test_cli_names_the_workdir_and_what_to_run_next(tmp_path):
    from jaxdist.cli.train import where_results_are

    text = where_results_are(tmp_path / "run")
    for part in ("metrics.jsonl", "events.log", "checkpoints/", f"jaxdist plot {tmp_path}/run"):
        assert part in text, text


def test_the_config_travels_with_the_checkpoint(tmp_path, capsys):
    """config.json deleted or replaced after a checkpoint: the rerun is compared with what the
    checkpoint was trained with, refused in one line when it differs, and config.json is
    written again from the checkpoint when it does not."""
    from jaxdist.run.rerun import ConfigChangedError

    workdir = tmp_path / "run"
    with pytest.raises(Crash):
        Trainer(tiny_config(), workdir).run(on_step=_crash_at(4))
    recorded = (workdir / "config.json").read_text()

    (workdir / "config.json").unlink()
    with pytest.raises(
        ConfigChangedError, match=r"the checkpoints in .*\(lr\.peak: 0\.2 -> 0\.3\)"
    ):
        Trainer(tiny_config(**{"lr.peak": 0.3}), workdir).run()
    assert not (workdir / "config.json").exists()  # nothing written by the refused rerun

    (workdir / "config.json").write_text(recorded.replace('"peak": 0.2', '"peak": 0.3'))
    with pytest.raises(ConfigChangedError, match=r"lr\.peak: 0\.2 -> 0\.3"):
        Trainer(tiny_config(**{"lr.peak": 0.3}), workdir).run()
    capsys.readouterr()
    summary = Trainer(tiny_config(), workdir).run()
    out = capsys.readouterr().out
    assert "config.json differed from what the checkpoints were trained with" in out
    assert "resumed from step 3" in out and summary["step"] == 7
    assert json.loads((workdir / "config.json").read_text()) == json.loads(recorded)


class _Recorder(Hook):
    """Writes down each moment the loop calls, and asks to stop after step ``stop_after``."""

    def __init__(self, stop_after):
        self.stop_after = stop_after
        self.moments = []

    def __enter__(self):
        self.moments.append("enter")
        return self

    def __exit__(self, *exc):
        self.moments.append("exit")

    def resumed(self, loop, meta):
        self.moments.append(f"resumed {loop.step}")

    def run_started(self, loop):
        self.moments.append("run_started")

    def step_starting(self, loop):
        self.moments.append(f"step_starting {loop.step + 1}")

    def step_calling(self, loop, compiled):
        self.moments.append(f"step_calling compiled={compiled}")

    @contextlib.contextmanager
    def around_step(self, loop):
        self.moments.append("around_step in")
        yield
        self.moments.append("around_step out")

    def step_done(self, loop):
        self.moments.append(f"step_done {loop.step}")

    def reported(self, loop, fetched):
        self.moments.append(f"reported {loop.step} ({len(fetched)} steps)")

    def recorded(self, loop, record):
        self.moments.append(f"recorded {record['kind']}")

    def evaluating(self, loop):
        self.moments.append("evaluating")

    def evaluated(self, loop):
        self.moments.append(f"evaluated top1={'top1' in loop.last_eval}")

    def saving(self, loop):
        self.moments.append(f"saving {loop.step}")

    def stop_requested(self, loop):
        return "told to" if loop.step == self.stop_after else ""

    def run_ended(self, loop, failure):
        self.moments.append(f"run_ended {loop.step} failure={failure}")


def test_a_users_hook_sees_every_moment_and_may_stop_the_run(tmp_path):
    recorder = _Recorder(stop_after=3)
    config = tiny_config(**{"checkpoint.every_steps": 2, "eval_every_epochs": 0.03})
    summary = Trainer(config, tmp_path, hooks=[recorder]).run()
    assert summary["stopped_by"] == "told to" and summary["preempted"] and summary["step"] == 3
    step = ["around_step in", "around_step out"]
    assert recorder.moments == [
        "enter",
        "resumed 0",
        "run_started",
        "step_starting 1",
        "step_calling compiled=False",
        *step,
        "step_done 1",
        "step_starting 2",
        "step_calling compiled=True",
        *step,
        "recorded train",
        "reported 2 (2 steps)",
        "saving 2",
        "step_done 2",
        # 3 x 16 samples pass 0.03 epochs of 1,438: an evaluation
        "step_starting 3",
        "step_calling compiled=True",
        *step,
        "evaluating",
        "evaluated top1=True",
        "recorded eval",
        "step_done 3",
        "saving 3",
        "run_ended 3 failure=None",
        "exit",
    ]
    events = [
        json.loads(line.removeprefix(":::MLLOG "))
        for line in (tmp_path / "events.log").read_text().splitlines()
    ]
    assert events[-1]["key"] == "run_stop"
    assert events[-1]["metadata"]["reason"] == "preempted (told to)"
    assert Trainer(config, tmp_path).run()["step"] == 3 + 4  # resumed at step 3, on to 7


def test_a_misspelt_moment_is_refused_where_the_hook_is_defined():
    with pytest.raises(
        TypeError, match=r"_Late.step_don is not a moment .* did you mean step_done"
    ):

        class _Late(Hook):
            def step_don(self, loop):
                pass

    class _Helper(Hook):  # a method that is no moment's near-miss is the hook's own business
        def summary(self):
            return "fine"

    assert _Helper().summary() == "fine"


def test_hooks_are_called_in_order_and_their_settings_checked_by_their_class():
    from jaxdist.run.hooks import Hooks
    from jaxdist.run.standard_hooks import check_hook_settings

    class _Strict(Hook):
        @classmethod
        def check_settings(cls, config, total_steps, profile_steps):
            if total_steps > 5:
                raise ValueError(f"_Strict runs at most 5 steps, not {total_steps}")

    class _Stopper(Hook):
        def __init__(self, reason):
            self.reason = reason

        def stop_requested(self, loop):
            return self.reason

    first, second = _Recorder(stop_after=None), _Recorder(stop_after=None)
    hooks = Hooks([first, _Stopper(""), _Stopper("SIGTERM"), second, _Stopper("later")])
    hooks.step_starting(SimpleNamespace(step=2))
    assert first.moments == second.moments == ["step_starting 3"]
    assert hooks.stop_requested(SimpleNamespace(step=3)) == "SIGTERM"
    config = tiny_config()
    check_hook_settings(config, 5, None, [_Strict()])
    with pytest.raises(ValueError, match="_Strict runs at most 5 steps, not 6"):
        check_hook_settings(config, 6, None, [_Strict()])
    with pytest.raises(ValueError, match="profile-steps 3:9 is outside the steps this run"):
        check_hook_settings(config, 6, (3, 9))

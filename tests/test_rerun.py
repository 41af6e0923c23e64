"""A workdir's recorded config: a changed setting is refused with its diff, a longer run
continues, and --allow-config-change continues and records the change."""

import json
import shutil

import pytest

from jaxdist.cli import main
from jaxdist.run import rerun
from jaxdist.run.config import base_config
from jaxdist.run.trainer import Trainer
from tests.test_trainer import tiny_config


def _workdir_with_progress(tmp_path, config):
    """A workdir as a run leaves it once it has a checkpoint."""
    workdir = tmp_path / "run"
    rerun.check_rerun(workdir, config)
    (workdir / "checkpoints" / "3").mkdir(parents=True)
    return workdir


def test_first_start_records_the_resolved_config(tmp_path):
    config = base_config()
    assert rerun.check_rerun(tmp_path / "run", config) == []
    recorded = json.loads((tmp_path / "run" / rerun.CONFIG_FILE).read_text())
    assert rerun.flatten(recorded) == rerun.flatten(config)


def test_a_changed_setting_is_refused_with_every_differing_key(tmp_path):
    workdir = _workdir_with_progress(tmp_path, base_config())
    changed = base_config()
    changed.lr.peak = 0.4
    changed.optimizer.name = "lars"
    changed.max_steps = 10  # safe, so not named among the refused
    with pytest.raises(rerun.ConfigChangedError) as raised:
        rerun.check_rerun(workdir, changed)
    message = str(raised.value)
    assert "lr.peak: 0.1 -> 0.4; optimizer.name: 'sgd' -> 'lars')" in message, message
    assert "max_steps" not in message and "--allow-config-change" in message
    assert not (workdir / rerun.CHANGES_FILE).exists()


def test_safe_changes_and_a_longer_schedule_continue(tmp_path):
    workdir = _workdir_with_progress(tmp_path, base_config())
    longer = base_config()
    longer.max_steps, longer.num_epochs, longer.log_every_steps = 500, 120.0, 10
    accepted = rerun.check_rerun(workdir, longer)
    assert accepted == [
        ("log_every_steps", 50, 10),
        ("max_steps", 0, 500),
        ("num_epochs", 90.0, 120.0),
    ]
    shorter = base_config()
    shorter.max_steps, shorter.num_epochs, shorter.log_every_steps = 500, 60.0, 10
    with pytest.raises(rerun.ConfigChangedError, match=r"num_epochs: 120.0 -> 60.0"):
        rerun.check_rerun(workdir, shorter)


def test_a_class_count_recorded_by_an_older_version_continues(tmp_path):
    """Older versions recorded data.num_classes 1000 whatever the dataset held (the model took
    the dataset's count then too); the resolved count now recorded is the same run."""
    old = base_config()
    old.data.source, old.data.num_classes = "digits", 1000
    workdir = _workdir_with_progress(tmp_path, old)
    now = base_config()
    now.data.source, now.data.num_classes = "digits", 10
    assert rerun.check_rerun(workdir, now) == []
    old.data.source = now.data.source = "synthetic"  # synthetic data made 1000: a real change
    workdir = _workdir_with_progress(tmp_path / "synthetic", old)
    with pytest.raises(rerun.ConfigChangedError, match=r"\(data.num_classes: 1000 -> 10\)"):
        rerun.check_rerun(workdir, now)


def test_a_field_added_after_the_run_started_continues_at_its_default(tmp_path):
    workdir = _workdir_with_progress(tmp_path, base_config())
    recorded = json.loads((workdir / rerun.CONFIG_FILE).read_text())
    del recorded["unroll_limit"]  # a workdir recorded before the field existed
    (workdir / rerun.CONFIG_FILE).write_text(json.dumps(recorded))
    assert rerun.check_rerun(workdir, base_config()) == [("unroll_limit", rerun.MISSING, 16)]
    (workdir / rerun.CONFIG_FILE).write_text(json.dumps(recorded))
    changed = base_config()
    changed.unroll_limit = 100  # not what the run did: refused
    with pytest.raises(rerun.ConfigChangedError, match="unroll_limit: '<missing>' -> 100"):
        rerun.check_rerun(workdir, changed)


def test_the_flag_continues_and_records_the_change(tmp_path):
    workdir = _workdir_with_progress(tmp_path, base_config())
    changed = base_config()
    changed.label_smoothing = 0.1
    accepted = rerun.check_rerun(workdir, changed, allow_change=True)
    assert accepted == [("label_smoothing", 0.0, 0.1)]
    record = json.loads((workdir / rerun.CHANGES_FILE).read_text().splitlines()[-1])
    assert record["changes"] == [{"key": "label_smoothing", "old": 0.0, "new": 0.1}]
    # The recorded config is now the changed one: rerunning with it is no change.
    assert rerun.check_rerun(workdir, changed) == []


def test_a_workdir_without_progress_takes_the_new_config(tmp_path):
    rerun.check_rerun(tmp_path / "run", base_config())
    changed = base_config()
    changed.lr.peak = 0.4
    assert rerun.check_rerun(tmp_path / "run", changed) == []
    recorded = json.loads((tmp_path / "run" / rerun.CONFIG_FILE).read_text())
    assert recorded["lr"]["peak"] == 0.4


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """The workdir of the tiny recipe trained to its end (7 steps); tests work on copies."""
    workdir = tmp_path_factory.mktemp("finished") / "run"
    Trainer(tiny_config(), workdir).run()
    return workdir


def test_trainer_refuses_a_changed_learning_rate_and_appends_nothing(finished, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(finished, workdir)
    written = {name: (workdir / name).read_text() for name in ("metrics.jsonl", "events.log")}
    with pytest.raises(rerun.ConfigChangedError, match=r"lr.peak: 0.2 -> 0.3"):
        Trainer(tiny_config(**{"lr.peak": 0.3, "max_steps": 9}), workdir).run()
    for name, text in written.items():
        assert (workdir / name).read_text() == text, f"the refused rerun wrote to {name}"


def test_trainer_continues_a_longer_run_and_the_flag_records_in_the_event_log(finished, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(finished, workdir)
    longer = Trainer(tiny_config(max_steps=9), workdir).run()
    assert longer["step"] == 9
    changed = tiny_config(**{"max_steps": 10, "label_smoothing": 0.1})
    assert Trainer(changed, workdir, allow_config_change=True).run()["step"] == 10
    events = [
        json.loads(x.split(" ", 1)[1]) for x in (workdir / "events.log").read_text().splitlines()
    ]
    changes = [
        (e["value"], e["metadata"]["old"], e["metadata"]["new"])
        for e in events
        if e["key"] == "config_change"
    ]
    assert changes == [("max_steps", 7, 9), ("label_smoothing", 0.0, 0.1), ("max_steps", 9, 10)]


def test_cli_refusal_is_one_line_exit_2(tmp_path, capsys):
    recipe = tmp_path / "tiny.py"
    recipe.write_text(
        "from tests.test_trainer import tiny_config\n\ndef get_config():\n    return tiny_config()\n"
    )
    workdir = str(tmp_path / "run")
    assert main(["train", str(recipe), "--workdir", workdir, "--set", "max_steps=2"]) == 0
    capsys.readouterr()
    code = main(["train", str(recipe), "--workdir", workdir, "--set", "lr.peak=0.5"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "lr.peak: 0.2 -> 0.5" in err[0] and err[0].startswith("jaxdist train: ")


def test_a_run_recorded_with_eps_0_continues_with_eps_unset(tmp_path):
    """optimizer.eps was 0.0 unless set; unset (None) now gives LARS that same 0 and SGD reads
    none, so a rerun of such a run is the same run."""
    for name in ("sgd", "lars"):
        workdir = _workdir_with_progress(tmp_path / name, base_config())
        recorded = json.loads((workdir / rerun.CONFIG_FILE).read_text())
        recorded["optimizer"]["name"], recorded["optimizer"]["eps"] = name, 0.0
        (workdir / rerun.CONFIG_FILE).write_text(json.dumps(recorded))
        now = base_config()
        now.optimizer.name = name
        assert rerun.check_rerun(workdir, now) == []
    now.optimizer.eps = 1e-6  # a different eps is a different run
    with pytest.raises(rerun.ConfigChangedError, match=r"optimizer.eps: 0.0 -> 1e-06"):
        rerun.check_rerun(workdir, now)


def test_the_note_says_whether_config_json_was_missing_or_damaged(tmp_path):
    """config.json rewritten from the checkpoint's record: the line says why, and a truncated
    file is damaged, not missing."""
    trained_with = rerun.config_record(base_config(), None)
    path = tmp_path / rerun.CONFIG_FILE
    text = json.dumps(trained_with, indent=2)

    def note():
        return rerun.record_note(tmp_path, trained_with, step=3)

    assert note() == (
        "config.json was missing; compared with the checkpoint of step 3 and written from it"
    )
    path.write_text(text[: len(text) // 2])  # cut short, as by a full disk
    assert note().startswith("config.json was damaged (not valid JSON: "), note()
    assert "; compared with the checkpoint of step 3 and written from it" in note()
    path.write_bytes(b"\xff\xfe\x00garbage")
    assert note().startswith("config.json was damaged (not text); "), note()
    path.write_text("[1, 2]")
    assert note().startswith("config.json was not a config jaxdist wrote; "), note()
    path.write_text(text.replace('"peak": 0.1', '"peak": 0.3'))
    assert note().startswith("config.json differed from what the checkpoints were trained with")
    path.write_text(text)
    assert note() is None

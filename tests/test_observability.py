"""What a run leaves to look at besides its JSONL: TensorBoard summaries read back from the
event file, and a profiler trace of chosen steps that names them."""

import gzip
import json
import struct

import pytest

from jaxdist.cli import main
from jaxdist.run import tensorboard
from jaxdist.run.trainer import Trainer
from tests.test_trainer import tiny_config


def read_events(directory):
    """Every ``Event`` of the TFRecord event files under ``directory``: an 8-byte length, its
    4-byte CRC, the record, its 4-byte CRC."""
    from tensorboardX.proto import event_pb2

    events = []
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            record = data[offset + 12 : offset + 12 + length]
            offset += 12 + length + 4
            event = event_pb2.Event()
            event.ParseFromString(record)
            events.append(event)
    return events


def test_tensorboard_holds_every_logged_scalar_and_the_config(tmp_path):
    from tensorboardX.proto import plugin_hparams_pb2

    workdir = tmp_path / "run"
    Trainer(tiny_config(tensorboard="on"), workdir).run()
    events = read_events(workdir / "tensorboard")
    scalars = {}
    hparams = {}
    for event in events:
        for value in event.summary.value:
            if value.metadata.plugin_data.plugin_name == "hparams":
                data = plugin_hparams_pb2.HParamsPluginData()
                data.ParseFromString(value.metadata.plugin_data.content)
                hparams.update(data.session_start_info.hparams)
            else:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    records = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    for key in ("loss", "accuracy", "lr", "batch_size", "images_per_sec"):
        assert sorted(scalars[f"train/{key}"]) == [r["step"] for r in train], key
        for r in train:
            assert scalars[f"train/{key}"][r["step"]] == pytest.approx(r[key], rel=1e-6)
    final = records[-1]
    assert final["kind"] == "eval"
    for key in ("top1", "top5"):
        assert scalars[f"eval/{key}"] == {final["step"]: pytest.approx(final[key])}
    assert hparams["lr.peak"].number_value == pytest.approx(0.2)
    assert hparams["model.name"].string_value == "resnet10"
    assert hparams["batch_ramp"].string_value == "[[0.05, 16]]"


def test_tensorboard_on_without_the_writer_names_the_extra(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(tensorboard, "_installed", lambda: False)
    recipe = tmp_path / "tiny.py"
    recipe.write_text(
        "from tests.test_trainer import tiny_config\ndef get_config():\n    return tiny_config()\n"
    )
    code = main(
        ["train", str(recipe), "--workdir", str(tmp_path / "run"), "--set", "tensorboard=on"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "tensorboard='on' needs the TensorBoard writer" in err[0]
    assert "pip install 'jaxdist[tensorboard]'" in err[0]
    assert not (tmp_path / "run").exists()


def test_profile_steps_trace_names_exactly_those_steps(tmp_path):
    workdir = tmp_path / "run"
    # One batch size (no ramp): one train step to compile.
    Trainer(tiny_config(batch_ramp=(), max_steps=4), workdir, profile_steps=(3, 4)).run()
    runs = list((workdir / "profile" / "plugins" / "profile").iterdir())
    assert len(runs) == 1 and list(runs[0].glob("*.xplane.pb")), runs
    with gzip.open(runs[0] / "perfetto_trace.json.gz") as f:
        trace = json.load(f)
    steps = {e["args"]["step_num"] for e in trace["traceEvents"] if e.get("name") == "train"}
    assert steps == {"3", "4"}


@pytest.mark.parametrize(
    ("steps", "expected"),
    [
        ("5:100", "--profile-steps 5:100 is outside the steps this run takes, 1 to 7"),
        ("4:2", "--profile-steps: expected FIRST:LAST with 1 <= FIRST <= LAST"),
        ("x", "--profile-steps: expected FIRST:LAST"),
    ],
)
def test_bad_profile_steps_are_one_line(tmp_path, capsys, steps, expected):
    recipe = tmp_path / "tiny.py"
    recipe.write_text(
        "from tests.test_trainer import tiny_config\ndef get_config():\n    return tiny_config()\n"
    )
    code = main(
        ["train", str(recipe), "--workdir", str(tmp_path / "run"), "--profile-steps", steps]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and expected in err[0], err

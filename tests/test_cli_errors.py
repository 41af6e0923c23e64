"""Bad input to the command line: one line naming the problem and the fix, exit 2 for a bad
command or config and 1 for a failure at run time, the stack only on request, nothing lost."""

import json

import numpy as np
import pytest

from jaxdist.cli import TRACEBACK_ENV, main

TINY_RECIPE = """
from tests.test_trainer import tiny_config

def get_config():
    c = tiny_config()
    c.mesh = "ring-2"
    c.max_steps = 2
    return c
"""


@pytest.fixture
def recipe(tmp_path):
    path = tmp_path / "tiny.py"
    path.write_text(TINY_RECIPE)
    return str(path)


def _one_line(capsys, code, expected_code, *parts):
    err = capsys.readouterr().err.strip().splitlines()
    assert code == expected_code, f"exit {code}, expected {expected_code}: {err}"
    assert len(err) == 1, "expected one line:\n" + "\n".join(err)
    for part in parts:
        assert part in err[0], err[0]
    return err[0]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["batch_size=-4"], "global_batch_size must be a positive integer, got -4"),
        (["batch_size=0"], "global_batch_size must be a positive integer, got 0"),
        (["batch_size=7"], "global batch 7 does not divide over 2 devices"),
        (["mesh=nope"], "no mesh preset named 'nope'"),
        (["allreduce=foo"], "unknown allreduce 'foo'; expected one of"),
        (["allreduce=torus2d"], "allreduce 'torus2d' needs two data axes"),
        (["model.bn_group_size=3"], "model.bn_group_size=3 must divide the 2 data-parallel"),
        (
            ["optimizer.name=adam"],
            "optimizer.name must be one of ['adamw', 'lars', 'sgd'], got 'adam'",
        ),
        # A field the rest of the config leaves unread is refused, never ignored.
        (
            ["pipeline.microbatches=4"],
            "pipeline.microbatches=4 does nothing with pipeline.stages=0",
        ),
        (["lr.power=3.0"], "lr.power=3.0 does nothing with lr.kind='cosine'; leave it at its"),
        (
            ["optimizer.trust_coefficient=0.01"],
            "optimizer.trust_coefficient=0.01 does nothing with optimizer.name='sgd'",
        ),
        (["unroll_limit=4"], "unroll_limit=4 shapes the ppermute schedules, and allreduce='na"),
        (["transfer_dtype=bf16"], "transfer_dtype must be one of bfloat16, float16, float32"),
        (["skip_nonfinite_steps=-1"], "skip_nonfinite_steps must be >= 0, got -1"),
        (["scatter_behind=True"], "scatter_behind=True paces FSDP's gradient reduce-scatters"),
        (["watchdog_s=-1.0"], "watchdog_s must be >= 0 (0 disables it), got -1.0"),
        # Meshes and rules: an axis no step handles, a rule for an axis the mesh lacks, a
        # tensor axis for a model that names no dimensions.
        (["mesh=data=1,expert=2"], "mesh axis 'expert' has the role expert, which no step"),
        (["mesh=data=2,stage=1"], "the mesh's 'stage' axis cuts the model into pipeline"),
        (["logical_axis_rules=mlp=tensor"], "logical_axis_rules are given, but the resnet10"),
        (["mesh=data=1,tensor=2"], "the mesh's 'tensor' axis splits weights, but the resnet10"),
        (["tensor_schedule=collective_matmul"], "tensor_schedule='collective_matmul' schedules"),
        (["tensor_sequence=True"], "tensor_sequence=True splits the sequence over the 'tensor'"),
    ],
)
def test_a_bad_config_value_is_one_line_exit_2(recipe, tmp_path, capsys, overrides, expected):
    args = ["train", recipe, "--workdir", str(tmp_path / "run")]
    for override in overrides:
        args += ["--set", override]
    _one_line(capsys, main(args), 2, "jaxdist train: ", expected)
    assert not (tmp_path / "run").exists(), "a refused run left a workdir behind"


def test_print_config_checks_what_it_prints(recipe, capsys):
    code = main(["train", recipe, "--print-config", "--set", "batch_size=7"])
    _one_line(capsys, code, 2, "does not divide over 2 devices")
    assert main(["train", recipe, "--print-config"]) == 0
    assert "batch_size: 32" in capsys.readouterr().out


def test_a_recipe_with_invalid_python_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text("def get_config(:\n    pass\n")
    _one_line(capsys, main(["train", str(bad)]), 2, f"recipe {bad}: invalid Python at line 1")


def test_the_stack_on_request(recipe, tmp_path, monkeypatch):
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    with pytest.raises(ValueError, match="does not divide over 2 devices"):
        main(["train", recipe, "--workdir", str(tmp_path / "run"), "--set", "batch_size=7"])


def test_a_missing_dataset_is_one_line_exit_1(recipe, tmp_path, capsys):
    args = ["train", recipe, "--set", "data.source=folder", "--set", f"data.root={tmp_path}/none"]
    _one_line(capsys, main(args), 1, f"dataset root {tmp_path}/none does not exist")


@pytest.fixture
def images_with_two_bad(tmp_path, capsys):
    root = tmp_path / "images"
    main(
        [
            "data",
            "fake",
            str(root),
            "--classes",
            "2",
            "--train-per-class",
            "8",
            "--val-per-class",
            "4",
            "--min-size",
            "40",
            "--max-size",
            "60",
        ]
    )
    files = sorted((root / "train").rglob("*.JPEG"))
    files[0].write_bytes(b"not an image")
    files[3].write_bytes(b"")
    capsys.readouterr()
    return root, files[0], files[3]


def test_a_corrupt_image_stops_the_run_in_one_line_and_closes_the_event_log(
    recipe, images_with_two_bad, tmp_path, capsys
):
    root, *_ = images_with_two_bad
    workdir = tmp_path / "run"
    args = [
        "train",
        recipe,
        "--workdir",
        str(workdir),
        "--set",
        "data.source=folder",
        "--set",
        f"data.root={root}",
        "--set",
        "data.num_classes=2",
        "--set",
        "data.image_size=16",
        "--set",
        "eval_batch_size=8",
    ]
    line = _one_line(capsys, main(args), 1, "cannot decode image", "--verify")
    assert str(root) in line
    last = json.loads((workdir / "events.log").read_text().splitlines()[-1].split(" ", 1)[1])
    assert last["key"] == "run_stop" and last["metadata"]["status"] == "aborted"
    assert last["metadata"]["reason"].startswith("DatasetError: cannot decode image")


def test_data_inspect_verify_names_every_bad_file(images_with_two_bad, capsys):
    root, garbage, empty = images_with_two_bad
    assert main(["data", "inspect", str(root)]) == 0  # counts only, without decoding
    capsys.readouterr()
    assert main(["data", "inspect", str(root), "--verify"]) == 1
    err = capsys.readouterr().err
    assert f"{garbage}: not a JPEG or other image" in err
    assert f"{empty}: empty file" in err
    assert "2 of 24 images cannot be decoded" in err


def test_plot_skips_a_truncated_last_line_with_a_warning(tmp_path, capsys):
    workdir = tmp_path / "run"
    workdir.mkdir()
    records = [
        {
            "kind": "train",
            "step": s,
            "epoch": s / 10,
            "loss": 1.0 / s,
            "lr": 0.1,
            "batch_size": 8,
            "images_per_sec": 100.0,
        }
        for s in (1, 2)
    ]
    text = "".join(json.dumps(r) + "\n" for r in records) + '{"kind": "train", "st'
    (workdir / "metrics.jsonl").write_text(text)
    assert main(["plot", str(workdir), "--out", str(tmp_path / "curves.png")]) == 0
    err = capsys.readouterr().err
    assert f"warning: skipped {workdir / 'metrics.jsonl'}:3" in err
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_a_mesh_size_written_as_a_string_is_refused(tmp_path, capsys):
    spec = tmp_path / "m.toml"
    spec.write_text('name = "m"\nlayout = "ring"\n[[axes]]\nname = "data"\nsize = "2"\n')
    code = main(["mesh", "show", str(spec)])
    _one_line(capsys, code, 2, "axis 'data' must have an integer size >= 1, got '2'")


def test_train_step_refuses_batch_leaves_of_different_sizes():
    from jaxdist.training.batches import check_batch_sizes

    with pytest.raises(ValueError, match=r"one leading \(batch\) size, got \['x'\]: 8, \['y'\]: 4"):
        check_batch_sizes({"x": np.zeros((8, 3)), "y": np.zeros((4,))})
    check_batch_sizes({"x": np.zeros((8, 3)), "y": np.zeros((8,))})

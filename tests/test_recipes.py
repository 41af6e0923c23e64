"""Recipes load, reject bad overrides, and run end to end for a few steps on tiny settings."""

from pathlib import Path

import pytest

from jaxdist.cli import main
from jaxdist.data.fake import write_image_folder
from jaxdist.run.config import ConfigError, apply_overrides, batch_stages, load_recipe
from jaxdist.run.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent
RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.py"))
IMAGENET = [r for r in RECIPES if r.startswith("resnet50_imagenet")]
PIPELINE = [r for r in RECIPES if "gpipe" in r]
MNIST = [r for r in RECIPES if r.startswith("mnist")]

# Tiny ImageNet-like settings: 32x32 images, width-8 ResNet-50, 4 images per device.
TINY_IMAGENET = [
    "data.image_size=32",
    "model.width=8",
    "model.dtype=float32",
    "batch_size=32",
    "batch_ramp=()",
    "max_per_device_batch=4",
    "eval_batch_size=16",
    "max_steps=2",
    "log_every_steps=1",
    "checkpoint.every_steps=0",
]
SYNTHETIC = [
    "data.source=synthetic",
    "data.synthetic_train_examples=64",
    "data.synthetic_eval_examples=16",
]


def test_all_recipes_present():
    assert set(IMAGENET) == {
        "resnet50_imagenet_mikami",
        "resnet50_imagenet_goyal",
        "resnet50_imagenet_mlperf_lars",
        "resnet50_imagenet_flax",
    }
    assert set(MNIST) == {"mnist_small_batch", "mnist_large_batch_ramp", "mnist_pipeline"}
    assert PIPELINE == ["resnet152_imagenet_gpipe"]


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_documents_itself(name):
    config = load_recipe(name)
    text = (ROOT / "recipes" / f"{name}.py").read_text()
    for word in ("Reproduces", "Command", "Hardware", "Expected"):
        assert word in text, f"{name}: docstring lacks a {word!r} section"
    assert batch_stages(config)[-1][1] == config.batch_size


def test_mnist_recipes_compare_like_with_like():
    small, large = load_recipe("mnist_small_batch"), load_recipe("mnist_large_batch_ramp")
    assert small.num_epochs == large.num_epochs
    assert large.batch_size >= 8 * small.batch_size and large.batch_ramp
    assert large.label_smoothing > 0 and small.label_smoothing == 0


def test_the_pipeline_recipe_is_the_small_batch_recipe_cut_into_stages():
    small, pipelined = load_recipe("mnist_small_batch"), load_recipe("mnist_pipeline")
    for key in ("model", "data", "batch_size", "num_epochs", "lr", "optimizer", "seed"):
        assert small[key] == pipelined[key], key
    assert small.pipeline.stages == 0 and pipelined.pipeline.stages == 4


def test_derived_lr_follows_batch_override():
    config = apply_overrides(load_recipe("resnet50_imagenet_goyal"), ["batch_size=4096"])
    assert config.lr.peak == pytest.approx(0.1 * 4096 / 256)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("lr.peek=1", "unknown config key 'lr.peek'; did you mean lr.peak"),
        ("batch_size=abc", "expected an int like 8192, got 'abc'"),
        ("batch_size=1.5", "expected an int like 8192, got 1.5"),
        ("model.zero_init_last_bn_scale=maybe", "expected a boolean"),
        ("nonsense", "not of the form key=value"),
    ],
)
def test_bad_overrides_are_clear_errors(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        apply_overrides(load_recipe("resnet50_imagenet_goyal"), [override])


def test_cli_reports_override_errors(capsys):
    assert main(["train", "resnet50_imagenet_goyal", "--set", "lr.peek=1"]) == 2
    assert "unknown config key 'lr.peek'" in capsys.readouterr().err


def test_unknown_recipe():
    with pytest.raises(ConfigError, match="recipe 'nope' not found"):
        load_recipe("nope")


def _smoke(name, overrides, workdir):
    config = apply_overrides(load_recipe(name), overrides)
    summary = Trainer(config, workdir).run()
    assert summary["step"] == config.max_steps, summary
    assert 0.0 <= summary["top1"] <= summary["top5"] <= 1.0
    assert (workdir / "metrics.jsonl").read_text().count('"kind": "train"') == config.max_steps


# The pipeline recipe's smoke run is slow (it compiles a pipeline step of 4 stages);
# The default run trains mnist_large_batch_ramp, which is mnist_small_batch's config with a ramp
# and label smoothing: with the smoke run's batch settings, mnist_small_batch would compile the
# same model, data and optimizer once more (tests/test_build_run.py resolves it into its parts,
# every check included). tests/test_pipeline_trainer.py trains a pipeline recipe.
@pytest.mark.parametrize(
    "name",
    [
        n if n == "mnist_large_batch_ramp" else pytest.param(n, marks=pytest.mark.slow)
        for n in MNIST
    ],
)
def test_mnist_recipe_smoke(name, tmp_path):
    _smoke(name, ["max_steps=2", "batch_ramp=()", "batch_size=32", "log_every_steps=1"], tmp_path)


# The default run's ImageNet recipe on files is the LARS one in test_mlperf_log.py.
@pytest.mark.slow
def test_imagenet_recipe_on_a_fake_folder(tmp_path):
    root = write_image_folder(tmp_path / "imagenet", num_classes=3, train_per_class=12)
    overrides = [*TINY_IMAGENET, "data.source=folder", f"data.root={root}", "data.dtype=uint8"]
    _smoke("resnet50_imagenet_flax", overrides, tmp_path / "run")


# Each recipe's own mesh preset is planning-scale; the smoke runs put its schedule on 8 CPU
# devices: the torus recipes on a 2x4 torus (so torus2d allreduce runs), per-device and
# grouped BN kept.
MESH_FOR_CPU = {
    "resnet50_imagenet_mikami": [
        "mesh=torus-2x4",
        "batch_ramp=((0.25, 16),)",
        "max_per_device_batch=2",
    ],
    "resnet50_imagenet_goyal": ["mesh="],
    "resnet50_imagenet_mlperf_lars": ["mesh=torus-2x4", "model.bn_group_size=2"],
    "resnet50_imagenet_flax": ["mesh="],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", IMAGENET)
def test_imagenet_recipe_on_synthetic_data(name, tmp_path):
    overrides = [*TINY_IMAGENET, *SYNTHETIC, *MESH_FOR_CPU[name]]
    _smoke(name, overrides, tmp_path)


@pytest.mark.slow
def test_gpipe_recipe_on_synthetic_data(tmp_path):
    overrides = [*TINY_IMAGENET, *SYNTHETIC, "max_per_device_batch=16", "pipeline.microbatches=2"]
    _smoke("resnet152_imagenet_gpipe", overrides, tmp_path)


def test_plot_writes_a_png(tmp_path):
    """Runs side by side, whatever their throughput is called: ``images_per_sec`` (image
    tasks, and every task's files before the name followed the task's unit) or
    ``samples_per_sec``."""
    import json

    runs = []
    for rate in ("images_per_sec", "samples_per_sec"):
        run = tmp_path / rate
        run.mkdir()
        train = {"kind": "train", "lr": 0.1, "batch_size": 8, rate: 100.0}
        lines = [{**train, "step": s, "epoch": s / 4, "loss": 2.0 / s} for s in range(1, 9)]
        lines.append({"kind": "eval", "step": 8, "epoch": 2.0, "top1": 0.5, "top5": 0.9})
        (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        runs.append(str(run))
    out = tmp_path / "curves.png"
    assert main(["plot", *runs, "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_plot_missing_metrics(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    assert "metrics.jsonl not found" in capsys.readouterr().err


def test_a_switch_drops_the_recipes_settings_it_makes_unread_with_a_note(capsys):
    """The LM recipe sets optimizer.b2 and eps for AdamW: switching to SGD on the command
    line drops them (one note each); a b2 the user gives with SGD is still refused."""
    from jaxdist.run.from_config import build_optimizer

    config = apply_overrides(load_recipe("transformer_lm"), ["optimizer.name=sgd"])
    assert (config.optimizer.b2, config.optimizer.eps) == (0.999, None)
    assert config.optimizer.weight_decay == load_recipe("transformer_lm").optimizer.weight_decay
    build_optimizer(config.optimizer, 0.1)
    notes = capsys.readouterr().err.strip().splitlines()
    assert notes == [
        "note: optimizer.b2=0.98 from the recipe does nothing with optimizer.name='sgd'; "
        "dropped (back to its default 0.999)",
        "note: optimizer.eps=1e-08 from the recipe does nothing with optimizer.name='sgd'; "
        "dropped (back to its default None)",
    ]
    given = apply_overrides(
        load_recipe("transformer_lm"), ["optimizer.name=sgd", "optimizer.b2=0.9"]
    )
    with pytest.raises(
        ValueError, match=r"optimizer.b2=0.9 does nothing with optimizer.name='sgd'"
    ):
        build_optimizer(given.optimizer, 0.1)
    assert "optimizer.b2" not in capsys.readouterr().err  # the user's own b2 is not dropped
    lr = apply_overrides(load_recipe("resnet50_imagenet_goyal"), ["lr.kind=cosine"])
    assert tuple(lr.lr.step_epochs) == () and lr.lr.init_lr == 0.1  # every kind reads init_lr
    assert capsys.readouterr().err.strip() == (
        "note: lr.step_epochs=(30.0, 60.0, 80.0) from the recipe does nothing with "
        "lr.kind='cosine'; dropped (back to its default ())"
    )


def test_pipeline_stages_0_drops_the_recipes_pipeline_settings_with_a_note(capsys):
    """``--set pipeline.stages=0`` on a pipeline recipe trains data parallel: the recipe's
    other pipeline fields go back to their defaults, one note each; a pipeline field the user
    gives with it is refused by name."""
    from jaxdist.run.config import base_config, refuse_unread

    recipe = load_recipe("mnist_pipeline")
    changed = [
        f for f, v in recipe.pipeline.items() if f != "stages" and v != base_config().pipeline[f]
    ]
    assert changed  # the recipe sets pipeline fields beyond stages
    config = apply_overrides(load_recipe("mnist_pipeline"), ["pipeline.stages=0"])
    assert dict(config.pipeline) == dict(base_config().pipeline)
    refuse_unread(config)
    notes = capsys.readouterr().err.strip().splitlines()
    assert [n.split("=")[0] for n in notes] == [f"note: pipeline.{f}" for f in changed]
    assert all("does nothing with pipeline.stages=0; dropped" in n for n in notes)
    given = apply_overrides(
        load_recipe("mnist_pipeline"), ["pipeline.stages=0", "pipeline.microbatches=3"]
    )
    with pytest.raises(ValueError, match=r"^pipeline.microbatches=3 does nothing with pipeline"):
        refuse_unread(given)


def test_pipeline_stages_drop_the_lm_recipes_scanned_layers_with_a_note(capsys):
    """The LM recipe scans its blocks; pipeline stages cut between blocks, so ``--set
    pipeline.stages=2`` unscans them with one note; given with them, they are kept for the
    stage cut to refuse (``tests/test_tasks.py``)."""
    assert load_recipe("transformer_lm").model.scan_layers
    config = apply_overrides(load_recipe("transformer_lm"), ["pipeline.stages=2"])
    assert config.model.scan_layers is False and config.model.remat == "full"
    assert capsys.readouterr().err.strip() == (
        "note: model.scan_layers=True from the recipe cannot be used with pipeline.stages=2 "
        "(pipeline stages cut the model between blocks, which scanned layers stack into one); "
        "dropped (back to False)"
    )
    given = apply_overrides(
        load_recipe("transformer_lm"), ["pipeline.stages=2", "model.scan_layers=True"]
    )
    assert given.model.scan_layers and not capsys.readouterr().err

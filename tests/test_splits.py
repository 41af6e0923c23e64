"""Split strings: the records they select, as TFDS and datasets select them, on every source."""

import re

import numpy as np
import pytest
from PIL import Image

from jaxdist.cli import main
from jaxdist.data import DataConfig, DatasetError, ImageFolderSource, make_pipeline
from jaxdist.data.fake import write_image_folder
from jaxdist.data.splits import overlap, parse_split


def records(text, size):
    return [list(part.records(size)) for part in parse_split(text)]


def test_bounds_select_as_tfds_rounds_them():
    # TFDS and datasets round a percent bound to the closest record: round(pct * n / 100).
    assert records("train", 10) == [list(range(10))]
    assert records("train[:90%]", 1438) == [list(range(1294))]
    assert records("train[90%:]", 1438) == [list(range(1294, 1438))]
    assert records("train[-10%:]", 1438) == [list(range(1294, 1438))]
    assert records("train[12.5%:37.5%]", 8) == [[1, 2]]
    assert records("train[:25%]", 10) == [[0, 1]]  # Python's round, as TFDS: 2.5 -> 2
    assert records("train[:35%]", 10) == [[0, 1, 2, 3]]  # 3.5 -> 4
    assert records("train[2:5]+test[-1:]", 10) == [[2, 3, 4], [9]]
    assert records(" train [ : 3 ] ", 10) == [[0, 1, 2]]


@pytest.mark.parametrize("text", ["", "train[", "train[1.5:]", "train[:150%]", "a+", "tr ain"])
def test_a_malformed_split_string_is_one_line(text):
    with pytest.raises(
        DatasetError, match=r"^data.eval_split: expected NAME or NAME\[START:STOP\]"
    ):
        parse_split(text, "data.eval_split")


def test_overlap_names_the_shared_records():
    assert overlap("train[:90%]", "train[90%:]", {"train": 100}) == ""
    assert overlap("train", "validation", {"train": 100, "validation": 10}) == ""
    assert overlap("train[:90%]", "train[85%:]", {"train": 100}) == "5 records of 'train'"


def test_a_held_out_share_of_train_is_disjoint_and_complete():
    pipeline = make_pipeline(
        DataConfig(source="digits", train_split="train[:90%]", eval_split="train[90%:]+val")
    )
    whole = make_pipeline(DataConfig(source="digits")).train_source
    train, held_out = pipeline.train_source, pipeline.eval_source
    assert (len(train), len(held_out)) == (1294, 144 + 359)
    images = [train[i]["image"] for i in range(len(train))]
    images += [held_out[i]["image"] for i in range(144)]
    np.testing.assert_array_equal(np.stack(images), whole.images)  # in order, nothing lost
    assert held_out.classes == whole.classes


def test_overlapping_or_empty_splits_and_val_fraction_elsewhere_are_refused():
    shared = make_pipeline(
        DataConfig(source="digits", train_split="train[:90%]", eval_split="train[85%:]")
    )
    with pytest.raises(DatasetError, match=r"share 72 records of 'train': held-out"):
        _ = shared.eval_source
    with pytest.raises(DatasetError, match=r"train\[5:3\] selects no records \(train has 1438\)"):
        make_pipeline(DataConfig(source="digits", train_split="train[5:3]"))
    with pytest.raises(DatasetError, match=r"digits has the splits \['train', 'val'\], not 'test'"):
        _ = make_pipeline(DataConfig(source="digits", eval_split="test")).eval_source
    with pytest.raises(ValueError, match=r"val_fraction holds out a share of digits and mnist5k"):
        DataConfig(source="synthetic", val_fraction=0.1)


def test_a_folder_with_train_and_test_only(tmp_path):
    root = write_image_folder(tmp_path / "set", 3, 4, 2, (20, 30), seed=1)
    (root / "val").rename(root / "test")
    pipeline = make_pipeline(
        DataConfig(source="folder", root=str(root), eval_split="test", image_size=16)
    )
    assert (pipeline.num_train_examples, pipeline.num_eval_examples) == (12, 6)
    assert pipeline.eval_source.split == "test"
    assert pipeline.eval_source.classes == ImageFolderSource(root, "train").classes
    batch = next(iter(pipeline.eval_iterator(6)))
    assert batch["image"].shape == (6, 16, 16, 3)


def test_the_class_count_comes_from_the_data(tmp_path, capsys):
    root = write_image_folder(tmp_path / "set", 3, 4, 2, (20, 30), seed=1)
    assert make_pipeline(DataConfig(source="folder", root=str(root))).num_classes == 3
    with pytest.raises(
        DatasetError,
        match=r"^data.num_classes=10, but the folder dataset has 3 "
        r"classes \(class_00, class_01, class_02\); the model takes the",
    ):
        make_pipeline(DataConfig(source="folder", root=str(root), num_classes=10))
    assert (
        make_pipeline(DataConfig(source="synthetic", synthetic_train_examples=4)).num_classes
        == 1000
    )
    # What a run prints and records is the dataset's count.
    sets = [
        "--set",
        "data.source=folder",
        "--set",
        f"data.root={root}",
        "--set",
        "data.image_size=16",
        "--set",
        "eval_batch_size=8",
    ]
    assert main(["train", "mnist_small_batch", *sets, "--print-config"]) == 0
    assert re.search(r"^  num_classes: 3$", capsys.readouterr().out, re.M)
    assert main(["train", "mnist_small_batch", *sets, "--set", "data.num_classes=10"]) == 1
    assert "data.num_classes=10, but the folder dataset has 3 classes" in capsys.readouterr().err


def test_a_root_one_level_off_says_what_is_there(tmp_path):
    root = write_image_folder(tmp_path / "imagenet", 2, 2, 1, (20, 30), seed=1)
    for given, hint in [
        (
            root / "train",
            rf"; {root}/train looks like one split \(its folders hold images\): "
            rf"give its parent {root}$",
        ),
        (tmp_path, rf"; {root} has a train folder: give that as the root$"),
        (tmp_path / "imagenett", rf"; {tmp_path} has \['imagenet'\]$"),
    ]:
        with pytest.raises(DatasetError, match=hint):
            make_pipeline(DataConfig(source="folder", root=str(given)))
    with pytest.raises(
        DatasetError,
        match=rf"no split folder {root}/test; .* {root} has "
        r"\['train', 'val'\]$",
    ):
        _ = make_pipeline(
            DataConfig(source="folder", root=str(root), eval_split="test")
        ).eval_source


def test_png_files_in_a_folder_are_read(tmp_path):
    root = write_image_folder(tmp_path / "set", 2, 2, 1, (20, 30), seed=1)
    for jpeg in root.rglob("*.JPEG"):
        Image.open(jpeg).convert("L").save(jpeg.with_suffix(".png"))
        jpeg.unlink()
    pipeline = make_pipeline(DataConfig(source="folder", root=str(root), image_size=8))
    assert pipeline.num_train_examples == 4
    assert next(iter(pipeline.eval_iterator(2)))["image"].shape == (2, 8, 8, 3)


def test_data_inspect_reads_the_splits_training_reads(tmp_path, capsys):
    root = write_image_folder(tmp_path / "set", 3, 4, 2, (20, 30), seed=1)
    (root / "val").rename(root / "test")
    assert main(["data", "inspect", str(root)]) == 1  # as train: no held-out split named val
    assert f"no split folder {root}/val" in capsys.readouterr().err
    assert main(["data", "inspect", str(root), "--eval-split", "test"]) == 0
    out = capsys.readouterr().out
    assert "  train: 12 images, 3 of 3 classes" in out and "  test: 6 images" in out
    argv = [
        "data",
        "inspect",
        str(root),
        "--train-split",
        "train[:75%]",
        "--eval-split",
        "train[75%:]+test",
        "--verify",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "train[:75%]: 9 images" in out and "train[75%:]+test: 9 images" in out
    assert "verified: all 18 images decode" in out
    argv[6] = "train[50%:]"
    assert main(argv) == 1
    assert "share 3 records of 'train': held-out" in capsys.readouterr().err


def test_a_folder_stored_by_class_is_sliced_in_a_fixed_shuffle(tmp_path):
    """A folder lists its records class by class: train[:50%] takes about half of every class
    (not the first half of the classes), the same records every time, in stored order."""
    root = write_image_folder(tmp_path / "set", 4, 10, 1, (20, 30), seed=1)
    config = DataConfig(
        source="folder", root=str(root), train_split="train[:50%]", eval_split="train[50%:]"
    )
    first, again = make_pipeline(config), make_pipeline(config)
    names = [first.train_source[i]["name"] for i in range(len(first.train_source))]
    assert names == [again.train_source[i]["name"] for i in range(20)] == sorted(names)
    labels = [first.train_source[i]["label"] for i in range(20)]
    assert all(2 <= labels.count(c) <= 8 for c in range(4)), labels
    held_out = {first.eval_source[i]["name"] for i in range(20)}
    assert not held_out & set(names) and len(held_out | set(names)) == 40

"""The tfds and hf sources, offline, on tiny datasets built here from a folder of JPEGs.

Each dataset holds the folder's very JPEG bytes in the folder's order, so the pipeline must
yield the same batches from all three: that covers the bytes kept undecoded, labels, class
names, the split mapping (``validation`` for ``val``), shuffling and resume.
"""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
import tensorflow_datasets as tfds
from array_record.python.array_record_module import ArrayRecordReader
from PIL import Image

from jaxdist.cli import main as cli_main
from jaxdist.data import (
    DataConfig,
    DatasetError,
    HuggingFaceSource,
    ImageFolderSource,
    TfdsSource,
    build_eval_iterator,
    build_train_iterator,
    make_pipeline,
    open_source,
)
from jaxdist.data.fake import write_image_folder
from jaxdist.data.tfrecord import write_tfrecord
from jaxdist.data.transforms import decode
from jaxdist.run.config import base_config
from jaxdist.run.trainer import Trainer
from tests.test_trainer import tiny_config

SIZE = 32


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No network: the Hub and TFDS's GCS mirror are off for every test here."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("NO_GCE_CHECK", "true")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_image_folder(tmp_path_factory.mktemp("imagenet"), 3, 5, 2, (40, 90), seed=3)


def folder_records(folder, split):
    source = ImageFolderSource(folder, split)
    return source.classes, [source[i] for i in range(len(source))]


def write_hf(root, folder, splits=("train", "validation"), label_shift=0):
    """The Hub's layout: ``ROOT/data/<split>-00000-of-00001.parquet`` with an Image column of
    JPEG bytes and a ClassLabel column."""
    for split in splits:
        classes, records = folder_records(folder, "train" if split == "train" else "val")
        features = datasets.Features(
            {"image": datasets.Image(), "label": datasets.ClassLabel(names=list(classes))}
        )
        table = datasets.Dataset.from_dict(
            {
                # A bare file name, as on the Hub: a path to an existing file would be stored
                # in place of the bytes.
                "image": [{"bytes": r["jpeg"], "path": Path(r["name"]).name} for r in records],
                "label": [r["label"] - label_shift for r in records],
            },
            features=features,
        )
        (root / "data").mkdir(parents=True, exist_ok=True)
        table.to_parquet(str(root / "data" / f"{split}-00000-of-00001.parquet"))
    return root


def write_tfds(data_dir, folder, name="tiny_imagenet_jpegs"):
    """A TFDS dataset prepared in ArrayRecord format, as ``tfds build`` leaves it."""
    classes, _ = folder_records(folder, "train")

    # Not registered: the source finds it by its files, as in a process that never saw the code.
    class TinyJpegs(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            features = tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Image(encoding_format="jpeg"),
                    "label": tfds.features.ClassLabel(names=list(classes)),
                }
            )
            return tfds.core.DatasetInfo(builder=self, features=features)

        def _split_generators(self, dl_manager):
            return {
                "train": self._generate_examples("train"),
                "validation": self._generate_examples("val"),
            }

        def _generate_examples(self, split):
            for i, record in enumerate(folder_records(folder, split)[1]):
                yield i, {"image": record["jpeg"], "label": record["label"]}

    TinyJpegs.name = name
    builder = TinyJpegs(data_dir=str(data_dir), file_format="array_record")
    builder.download_and_prepare()
    return name


@pytest.fixture(scope="module")
def hf_dir(folder, tmp_path_factory):
    return write_hf(tmp_path_factory.mktemp("hf") / "tiny-imagenet", folder)


@pytest.fixture(scope="module")
def tfds_dir(folder, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("tfds")
    write_tfds(data_dir, folder)
    return data_dir


class FolderInOrderOf:
    """The folder's records of ``split`` in the order ``source`` holds the same JPEGs (TFDS
    shuffles records when it prepares a dataset; the Hub's parquet keeps the order)."""

    encoded = True

    def __init__(self, folder, split, source) -> None:
        self.folder = ImageFolderSource(folder, split)
        by_bytes = {self.folder[i]["jpeg"]: i for i in range(len(self.folder))}
        self.order = [by_bytes[source[i]["jpeg"]] for i in range(len(source))]
        self.classes, self.mean, self.std = self.folder.classes, self.folder.mean, self.folder.std

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, index):
        return self.folder[self.order[index]]


def take(it, n):
    return [next(it) for _ in range(n)]


def assert_same(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x.keys() == y.keys()
        for key in x:
            np.testing.assert_array_equal(x[key], y[key], err_msg=f"batch {i}, {key!r}")


def configs(hf_dir, tfds_dir):
    common = {"image_size": SIZE, "seed": 5}
    cache = str(hf_dir.parent / "c")
    return {
        "hf": DataConfig(source="hf", dataset=str(hf_dir), root=cache, **common),
        "tfds": DataConfig(
            source="tfds", dataset="tiny_imagenet_jpegs", root=str(tfds_dir), **common
        ),
    }


def test_tfds_and_hf_yield_the_folders_batches(folder, hf_dir, tfds_dir):
    for name, config in configs(hf_dir, tfds_dir).items():
        pipeline = make_pipeline(config)
        assert pipeline.train_source.classes == ("class_00", "class_01", "class_02"), name
        assert (pipeline.num_train_examples, pipeline.num_eval_examples) == (15, 6), name
        train = FolderInOrderOf(folder, "train", pipeline.train_source)
        held_out = FolderInOrderOf(folder, "val", pipeline.eval_source)
        if name == "hf":
            assert train.order == list(range(15)) and held_out.order == list(range(6))
        want = take(build_train_iterator(train, 4, seed=5, image_size=SIZE), 6)
        assert_same(want, take(pipeline.train_iterator(4), 6))
        # Resume mid-stream: the batches from sample 12 on are those of the uninterrupted run.
        assert_same(want[3:], take(pipeline.train_iterator(4, start_sample=12), 3))
        want = list(build_eval_iterator(held_out, 4, image_size=SIZE))
        assert_same(want, list(pipeline.eval_iterator(4)))


def test_records_keep_the_stored_jpeg_bytes(folder, hf_dir, tfds_dir):
    _, want = folder_records(folder, "val")
    sources = [
        HuggingFaceSource(str(hf_dir), "val", cache_dir=str(hf_dir.parent / "c")),
        TfdsSource("tiny_imagenet_jpegs", "val", data_dir=str(tfds_dir)),
    ]
    for source in sources:
        assert source.split == "validation"
        got = {source[i]["jpeg"]: source[i]["label"] for i in range(len(source))}
        assert got == {r["jpeg"]: r["label"] for r in want}, source


def test_the_run_config_reaches_the_sources(hf_dir):
    config = base_config()
    config.data.source = "hf"
    config.data.dataset = str(hf_dir)
    config.data.root = str(hf_dir.parent / "c")
    assert make_pipeline(config.data.to_dict()).num_classes == 3


# --------------------------------------------------------------------------- bad input


def test_a_dataset_that_does_not_exist_is_one_line(tmp_path):
    with pytest.raises(DatasetError, match=r"tfds dataset 'no_such_set' does not exist") as err:
        TfdsSource("no_such_set", "train", data_dir=str(tmp_path))
    assert "\n" not in str(err.value)
    with pytest.raises(DatasetError, match=r"hf dataset .*nothing cannot be opened") as err:
        HuggingFaceSource(str(tmp_path / "nothing"), "train", cache_dir=str(tmp_path / "c"))
    assert "\n" not in str(err.value)


def test_a_catalog_dataset_not_prepared_says_how_to_prepare_it(tmp_path):
    with pytest.raises(
        DatasetError,
        match=r"not prepared in .*; prepare it with `tfds build mnist --data_dir",
    ) as err:
        TfdsSource("mnist", "train", data_dir=str(tmp_path))
    assert "\n" not in str(err.value)


def test_a_missing_split_names_the_splits_there_are(folder, tmp_path):
    root = write_hf(tmp_path / "only-train", folder, splits=("train", "test"))
    with pytest.raises(DatasetError, match=r"no 'validation' or 'val' or 'valid' split; it has "):
        HuggingFaceSource(str(root), "val", cache_dir=str(tmp_path / "c"))


def test_labels_out_of_range_name_the_record(folder, tmp_path):
    # -1 is how unlabelled splits (ImageNet's test split on the Hub) mark their labels.
    root = write_hf(tmp_path / "unlabelled", folder, label_shift=1)
    with pytest.raises(DatasetError, match=r"label -1 is outside 0\.\.2 \(3 classes\)"):
        HuggingFaceSource(str(root), "train", cache_dir=str(tmp_path / "c"))


def png_bytes(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def three_modes(size=(12, 10)):
    """The same pixels as an RGB, a grayscale (L) and a palette (P) image."""
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8))
    return [rgb, rgb.convert("L"), rgb.convert("P")]


def test_png_grayscale_and_palette_images_come_out_as_rgb(tmp_path):
    images = three_modes()
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b", "c"])}
    )
    table = datasets.Dataset.from_dict(
        {
            "image": [{"bytes": png_bytes(i), "path": f"{n}.png"} for n, i in enumerate(images)],
            "label": [0, 1, 2],
        },
        features=features,
    )
    datasets.DatasetDict({"train": table}).save_to_disk(str(tmp_path / "png"))
    source = HuggingFaceSource(str(tmp_path / "png"), "train")
    for index, image in enumerate(images):
        stored = source[index]["jpeg"]
        assert stored == png_bytes(image)
        np.testing.assert_array_equal(decode(stored), np.asarray(image.convert("RGB")))
    pipeline = make_pipeline(
        DataConfig(
            source="hf",
            dataset=str(tmp_path / "png"),
            image_size=8,
            train_split="train[:1]",
            eval_split="train[1:]",
        )
    )
    assert next(iter(pipeline.eval_iterator(2)))["image"].shape == (2, 8, 8, 3)


def test_bytes_that_are_no_image_are_one_line(tmp_path):
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=["a"])}
    )
    table = datasets.Dataset.from_dict(
        {"image": [{"bytes": b"not an image", "path": "x.png"}], "label": [0]}, features=features
    )
    datasets.DatasetDict({"train": table}).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(DatasetError, match=r"cannot decode image .*not a JPEG or other image"):
        HuggingFaceSource(str(tmp_path / "bad"), "train")


def write_tfds_png(data_dir, name="tiny_gray_png", splits=(("train", 8), ("test", 4))):
    """MNIST's layout in TFDS: grayscale PNG images of shape (H, W, 1), train and test only."""

    class TinyPng(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            features = tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Image(shape=(None, None, 1), encoding_format="png"),
                    "label": tfds.features.ClassLabel(names=["zero", "one"]),
                }
            )
            return tfds.core.DatasetInfo(builder=self, features=features)

        def _split_generators(self, dl_manager):
            return {split: self._generate_examples(split, n) for split, n in splits}

        def _generate_examples(self, split, count):
            rng = np.random.default_rng(len(split))
            for i in range(count):
                pixels = rng.integers(0, 255, (10, 12), dtype=np.uint8)
                yield i, {"image": png_bytes(Image.fromarray(pixels)), "label": i % 2}

    TinyPng.name = name
    TinyPng(data_dir=str(data_dir), file_format="array_record").download_and_prepare()
    return name


def as_tfrecord(prepared: Path) -> None:
    """What ``tfds build`` without ``--file_format`` leaves: the same serialized examples in
    TFRecord files, and ``fileFormat: tfrecord`` in the dataset's info."""
    for path in prepared.glob("*.array_record-*"):
        reader = ArrayRecordReader(str(path))
        write_tfrecord(str(path).replace(".array_record-", ".tfrecord-"), reader.read_all())
        reader.close()
        path.unlink()
    info_path = prepared / "dataset_info.json"
    info = json.loads(info_path.read_text())
    info_path.write_text(json.dumps({**info, "fileFormat": "tfrecord"}))


def test_a_tfrecord_prepared_dataset_reads_as_its_array_record_twin(folder, tmp_path, monkeypatch):
    write_tfds(tmp_path / "ar", folder)
    shutil.copytree(tmp_path / "ar", tmp_path / "tfr")
    as_tfrecord(tmp_path / "tfr" / "tiny_imagenet_jpegs" / "1.0.0")
    for split in ("train", "val"):
        twin = TfdsSource("tiny_imagenet_jpegs", split, data_dir=str(tmp_path / "ar"))
        source = TfdsSource("tiny_imagenet_jpegs", split, data_dir=str(tmp_path / "tfr"))
        assert len(source) == len(twin) and source.classes == twin.classes
        for i in range(len(twin)):
            assert source[i]["jpeg"] == twin[i]["jpeg"] and source[i]["label"] == twin[i]["label"]
    common = {"source": "tfds", "dataset": "tiny_imagenet_jpegs", "image_size": SIZE, "seed": 5}
    want = make_pipeline(DataConfig(root=str(tmp_path / "ar"), **common))
    got = make_pipeline(DataConfig(root=str(tmp_path / "tfr"), **common))
    assert_same(
        take(want.train_iterator(4, start_sample=4), 3),
        take(got.train_iterator(4, start_sample=4), 3),
    )
    # The index is built once, kept beside the files, and read from there after.
    prepared = tmp_path / "tfr" / "tiny_imagenet_jpegs" / "1.0.0"
    assert len(list(prepared.glob(".jaxdist-index-*.npz"))) == 2
    monkeypatch.setattr("jaxdist.data.tfrecord.scan", lambda path: pytest.fail("scanned again"))
    assert len(TfdsSource("tiny_imagenet_jpegs", "train", data_dir=str(tmp_path / "tfr"))) == 15


def test_a_damaged_tfrecord_file_is_one_line_and_verify_finds_a_changed_byte(tmp_path, capsys):
    name = write_tfds_png(tmp_path)
    prepared = tmp_path / name / "1.0.0"
    as_tfrecord(prepared)
    (shard,) = prepared.glob("*-test.tfrecord-*")
    data = bytearray(shard.read_bytes())
    data[data.rindex(b"IDAT") + 8] ^= 0xFF  # inside the last record's PNG: found by --verify only
    shard.write_bytes(bytes(data))
    source = TfdsSource(name, "test", data_dir=str(tmp_path))
    assert [source.verify_record(i) for i in range(len(source))] == [True] * 3 + [False]
    argv = ["data", "inspect", f"tfds:{name}", "--root", str(tmp_path), "--eval-split", "test"]
    assert cli_main([*argv, "--verify"]) == 1
    err = capsys.readouterr().err
    assert f"tfds:{name}/test[3]: its bytes do not match their checksum" in err
    assert "1 of 12 images cannot be decoded" in err
    shard.write_bytes(bytes(data[:-3]))  # cut short, as a copy that stopped
    with pytest.raises(
        DatasetError, match=r"-test.tfrecord-00000-of-00001: truncated in the record"
    ):
        TfdsSource(name, "test", data_dir=str(tmp_path))


@pytest.mark.slow  # three recipe runs on converted datasets: about 20 s
def test_recipes_train_on_png_tfrecord_train_test_and_renamed_columns(folder, tmp_path):
    """The layouts a user brings: MNIST-like PNG TFDS in TFRecord with train and test only, and
    an HF dataset whose columns are img and fine_label."""
    name = write_tfds_png(tmp_path / "tfds")
    as_tfrecord(tmp_path / "tfds" / name / "1.0.0")
    classes, records = folder_records(folder, "train")
    features = datasets.Features(
        {"img": datasets.Image(), "fine_label": datasets.ClassLabel(names=list(classes))}
    )
    table = datasets.Dataset.from_dict(
        {
            "img": [{"bytes": r["jpeg"], "path": Path(r["name"]).name} for r in records],
            "fine_label": [r["label"] for r in records],
        },
        features=features,
    )
    datasets.DatasetDict({"train": table, "test": table}).save_to_disk(str(tmp_path / "hf"))
    runs = {
        "tfds": {"data.source": "tfds", "data.dataset": name, "data.root": str(tmp_path / "tfds")},
        "hf": {"data.source": "hf", "data.dataset": str(tmp_path / "hf")},
    }
    for kind, data in runs.items():
        config = tiny_config(
            **data,
            **{
                "data.eval_split": "test",
                "data.image_size": 16,
                "batch_ramp": (),
                "batch_size": 8,
                "eval_batch_size": 8,
                "num_epochs": 4.0,
                "max_steps": 2,
            },
        )
        summary = Trainer(config, tmp_path / f"run-{kind}").run()
        assert summary["step"] == 2 and 0 <= summary["top1"] <= 1, kind


def test_a_missing_extra_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DatasetError, match=r"pip install 'jaxdist\[tfds\]'"):
        TfdsSource("imagenet2012", "train")
    with pytest.raises(DatasetError, match=r"pip install 'jaxdist\[hf\]'"):
        HuggingFaceSource("ILSVRC/imagenet-1k", "train")


def test_a_missing_dataset_name_is_refused():
    with pytest.raises(ValueError, match=r"data source 'tfds' needs dataset=<dataset name>"):
        DataConfig(source="tfds")


def test_cli_inspects_both(hf_dir, tfds_dir, capsys):
    argv = ["data", "inspect", f"hf:{hf_dir}", "--root", str(hf_dir.parent / "c")]
    assert cli_main(argv) == 0
    text = capsys.readouterr().out
    assert "train: 15 images, 3 of 3 classes" in text and "val: 6 images" in text
    argv = ["data", "inspect", "tfds:tiny_imagenet_jpegs", "--root", str(tfds_dir), "--verify"]
    assert cli_main(argv) == 0
    text = capsys.readouterr().out
    assert "train: 15 images" in text and "verified: all 21 images decode" in text
    assert (
        cli_main(["data", "inspect", "tfds:no_such_set", "--root", str(tfds_dir)]) == 1
    )  # as train
    assert "does not exist" in capsys.readouterr().err


def test_a_damaged_save_to_disk_folder_is_one_line(tmp_path):
    """A save_to_disk folder whose split lost its .arrow file: one line naming the dataset."""
    root = tmp_path / "damaged"
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=["a"])}
    )
    table = datasets.Dataset.from_dict(
        {"image": [np.zeros((8, 8, 3), np.uint8)], "label": [0]}, features=features
    )
    datasets.DatasetDict({"train": table}).save_to_disk(str(root))
    for arrow in root.rglob("*.arrow"):
        arrow.unlink()
    with pytest.raises(
        DatasetError, match=r"damaged \(a save_to_disk folder\) cannot be read: \w+"
    ) as err:
        HuggingFaceSource(str(root), "train")
    assert "\n" not in str(err.value)


def test_an_empty_split_names_itself_and_how_to_pick_another(tmp_path):
    """A save_to_disk folder whose validation split has no records: one line naming the split
    and data.eval_split; the train split still reads, and the suggested splits work."""
    root = tmp_path / "empty_val"
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])}
    )
    images = [np.full((8, 8, 3), i, np.uint8) for i in range(10)]
    table = datasets.Dataset.from_dict(
        {"image": images, "label": [i % 2 for i in range(10)]}, features=features
    )
    empty = datasets.Dataset.from_dict({"image": [], "label": []}, features=features)
    datasets.DatasetDict({"train": table, "validation": empty}).save_to_disk(str(root))
    with pytest.raises(DatasetError) as err:
        HuggingFaceSource(str(root), "val")
    message = str(err.value)
    assert message.startswith(f"hf dataset {root}: split 'validation' is empty (0 records); ")
    assert "--set data.eval_split='train[90%:]'" in message and "\n" not in message
    assert len(HuggingFaceSource(str(root), "train")) == 10
    pipeline = make_pipeline(
        DataConfig(
            source="hf",
            dataset=str(root),
            image_size=8,
            train_split="train[:90%]",
            eval_split="train[90%:]",
        )
    )
    assert (pipeline.num_train_examples, pipeline.num_eval_examples) == (9, 1)


def test_the_datasets_progress_bars_stay_out_of_a_run_unless_asked_for(hf_dir, tmp_path, capfd):
    """Preparing a fresh cache draws "Generating ... split" bars: not when a run opens the
    dataset, and when `jaxdist data inspect` does (it passes show_progress=True)."""
    HuggingFaceSource(str(hf_dir), "train", cache_dir=str(tmp_path / "quiet"))
    assert "Generating" not in capfd.readouterr().err
    HuggingFaceSource(str(hf_dir), "train", cache_dir=str(tmp_path / "shown"), show_progress=True)
    assert "Generating train split" in capfd.readouterr().err
    assert not datasets.are_progress_bars_disabled()  # left as it was


def test_columns_by_other_common_names_are_found_or_given(folder, tmp_path):
    """cifar100's layout (img, fine_label): found by its common names; given explicitly with
    data.image_key / data.label_key; a name that is not there is one line naming what is."""
    classes, records = folder_records(folder, "train")
    features = datasets.Features(
        {
            "img": datasets.Image(),
            "coarse": datasets.ClassLabel(names=["x", "y"]),
            "fine_label": datasets.ClassLabel(names=list(classes)),
        }
    )
    table = datasets.Dataset.from_dict(
        {
            "img": [{"bytes": r["jpeg"], "path": Path(r["name"]).name} for r in records],
            "coarse": [0] * len(records),
            "fine_label": [r["label"] for r in records],
        },
        features=features,
    )
    root = tmp_path / "cifar100_like"
    datasets.DatasetDict({"train": table}).save_to_disk(str(root))
    found = HuggingFaceSource(str(root), "train")
    assert found.classes == tuple(classes) and len(found) == len(records)
    assert found[3]["jpeg"] == records[3]["jpeg"] and found[3]["label"] == records[3]["label"]
    given = HuggingFaceSource(str(root), "train", image_key="img", label_key="coarse")
    assert given.classes == ("x", "y") and given[3]["label"] == 0
    with pytest.raises(
        DatasetError,
        match=r"has no 'picture' column \(data\.image_key\); it has \['coarse', 'fine_label', 'img'\]",
    ):
        HuggingFaceSource(str(root), "train", image_key="picture")
    config = DataConfig(source="hf", dataset=str(root), label_key="coarse")
    assert open_source(config, "train").classes == ("x", "y")
    # A column called label beside the one chosen is left alone, not overwritten.
    both = tmp_path / "with_label_too"
    datasets.DatasetDict({"train": table.rename_column("fine_label", "label")}).save_to_disk(
        str(both)
    )
    assert HuggingFaceSource(str(both), "train", label_key="coarse")[3]["label"] == 0


def test_a_tfds_root_one_level_off_or_a_missing_version_says_what_is_there(tfds_dir, tmp_path):
    name = "tiny_imagenet_jpegs"
    for dataset, data_dir, hint in [
        (
            f"{name}:2.0.0",
            tfds_dir,
            rf"{tfds_dir}/{name} holds version\(s\) 1.0.0: name one, "
            rf"e.g. dataset='{name}:1.0.0'",
        ),
        (
            name,
            tfds_dir / name,
            rf"{tfds_dir}/{name} is a dataset's own folder: give its "
            rf"parent {tfds_dir} as the root",
        ),
    ]:
        with pytest.raises(DatasetError, match=hint) as err:
            TfdsSource(dataset, "train", data_dir=str(data_dir))
        assert "\n" not in str(err.value)
    (tmp_path / "above").mkdir()
    (tmp_path / "above" / "tfds").symlink_to(tfds_dir)
    with pytest.raises(
        DatasetError,
        match=rf"{tmp_path}/above/tfds/{name} is there: give "
        rf"{tmp_path}/above/tfds as the root",
    ):
        TfdsSource(name, "train", data_dir=str(tmp_path / "above"))

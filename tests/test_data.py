"""Input pipeline: sources, convert, transforms, sharding, determinism, resume, errors, CLI."""

from __future__ import annotations

import numpy as np
import pytest
import simplejpeg

from jaxdist.cli import main as cli_main
from jaxdist.data import (
    ArrayRecordSource,
    ArraySource,
    DataConfig,
    DatasetError,
    ImageFolderSource,
    SyntheticSource,
    build_eval_iterator,
    build_train_iterator,
    convert_folder,
    load_digits,
    load_mnist5k,
    make_pipeline,
)
from jaxdist.data.fake import write_image_folder
from jaxdist.data.small_datasets import stratified_split
from jaxdist.data.sources import IMAGENET_MEAN, IMAGENET_STD
from jaxdist.data.transforms import center_crop_box, normalize, random_resized_crop_box

SIZE = 32  # output side: small so the tests stay fast


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """3 classes x (6 train + 2 val) JPEGs of 48-160 px."""
    return write_image_folder(tmp_path_factory.mktemp("imagenet"), 3, 6, 2, (48, 160), seed=1)


@pytest.fixture(scope="module")
def converted(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("arrayrecord") / "ar"
    convert_folder(folder, out, shards=2)
    return out


class IndexSource(ArraySource):
    """Image ``i`` is filled with ``i``, so every output sample says which record it is;
    records read are logged to check that a process reads only its share."""

    def __init__(self, n: int) -> None:
        images = np.broadcast_to(np.arange(n, dtype=np.uint8)[:, None, None, None], (n, 2, 2, 1))
        super().__init__(images.copy(), np.arange(n) % 3, ("a", "b", "c"), mean=(0,), std=(1,))
        self.read: list[int] = []

    def __getitem__(self, index):
        self.read.append(int(index))
        return super().__getitem__(index)


def ids(batch) -> list[int]:
    return batch["image"][:, 0, 0, 0].astype(int).tolist()


def flat(batches) -> list[int]:
    """Record ids of a list of batches, in order."""
    return [i for b in batches for i in ids(b)]


def take(it, n):
    return [next(it) for _ in range(n)]


def assert_batches_equal(a, b):
    assert len(a) == len(b), f"expected {len(a)} batches, found {len(b)}"
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x.keys() == y.keys(), f"batch {i}: keys {sorted(x)} vs {sorted(y)}"
        for key in x:
            np.testing.assert_array_equal(x[key], y[key], err_msg=f"batch {i}, {key!r}")


def train_it(source, batch, **kw):
    kw.setdefault("seed", 0)
    kw.setdefault("process_index", 0)
    kw.setdefault("process_count", 1)
    kw.setdefault("image_size", SIZE)
    return build_train_iterator(source, batch, **kw)


# --------------------------------------------------------------------------- sources


def test_folder_source_lists_classes_and_files(folder):
    source = ImageFolderSource(folder, "train")
    assert source.classes == ("class_00", "class_01", "class_02")
    assert len(source) == 18
    assert source.labels.tolist() == [0] * 6 + [1] * 6 + [2] * 6
    record = source[7]
    assert record["label"] == 1 and record["name"].endswith("train/class_01/img_0001.JPEG")
    assert simplejpeg.decode_jpeg_header(record["jpeg"])[0] >= 48


def test_arrayrecord_holds_the_folder_records(folder, converted):
    for split in ("train", "val"):
        a, b = ImageFolderSource(folder, split), ArrayRecordSource(converted, split)
        assert len(a) == len(b) and a.classes == b.classes
        for i in range(len(a)):
            ra, rb = a[i], b[i]
            assert ra["jpeg"] == rb["jpeg"], f"{split} record {i}: bytes differ"
            assert ra["label"] == rb["label"], (
                f"{split} record {i}: label {ra['label']} vs {rb['label']}"
            )
    # ... and so the pipelines agree batch for batch.
    assert_batches_equal(
        take(train_it(ImageFolderSource(folder, "train"), 6), 4),
        take(train_it(ArrayRecordSource(converted, "train"), 6), 4),
    )


def test_synthetic_source_is_a_function_of_seed_and_index():
    a, b = SyntheticSource(10, (4, 4, 3), 5, seed=1), SyntheticSource(10, (4, 4, 3), 5, seed=1)
    np.testing.assert_array_equal(a[3]["image"], b[3]["image"])
    assert not np.array_equal(a[3]["image"], a[4]["image"])
    assert not np.array_equal(a[3]["image"], SyntheticSource(10, (4, 4, 3), 5, seed=2)[3]["image"])
    assert all(0 <= a[i]["label"] < 5 for i in range(10))


# --------------------------------------------------------------------------- transforms


def test_random_resized_crop_box_stays_in_range():
    rng = np.random.default_rng(0)
    for height, width in [(100, 100), (60, 200), (375, 500), (20, 7)]:
        for _ in range(200):
            top, left, h, w = random_resized_crop_box(height, width, rng)
            assert top >= 0 and top + h <= height and left >= 0 and left + w <= width
            assert h >= 1 and w >= 1
    # Inside the area and aspect ranges when the image allows it (rounding aside).
    for _ in range(200):
        _, _, h, w = random_resized_crop_box(500, 500, rng)
        assert 0.08 * 0.95 <= h * w / 250_000 <= 1.0
        assert 3 / 4 * 0.95 <= w / h <= 4 / 3 * 1.05
    assert center_crop_box(256, 512) == (16.0, 144.0, 224.0, 224.0)


def test_eval_float_output_is_normalised_uint8_output(folder):
    source = ImageFolderSource(folder, "val")
    (u8,) = take(
        build_eval_iterator(
            source, 6, process_index=0, process_count=1, image_size=SIZE, dtype="uint8"
        ),
        1,
    )
    (f32,) = take(
        build_eval_iterator(source, 6, process_index=0, process_count=1, image_size=SIZE), 1
    )
    np.testing.assert_allclose(
        f32["image"], normalize(u8["image"], IMAGENET_MEAN, IMAGENET_STD), rtol=1e-6
    )


# --------------------------------------------------------------------------- batches


def test_train_and_eval_batches_have_the_right_shapes(folder):
    pipe = make_pipeline(DataConfig(source="folder", root=str(folder), image_size=SIZE))
    assert (
        pipe.num_classes == 3
        and pipe.num_train_examples == 18
        and pipe.image_shape == (SIZE, SIZE, 3)
    )
    batch = next(pipe.train_iterator(8, process_index=1, process_count=2))
    assert batch["image"].shape == (4, SIZE, SIZE, 3) and batch["image"].dtype == np.float32
    assert batch["label"].shape == (4,) and batch["label"].dtype == np.int32
    u8 = next(train_it(pipe.train_source, 4, dtype="uint8"))
    assert u8["image"].dtype == np.uint8 and u8["image"].shape == (4, SIZE, SIZE, 3)
    # 6 val images, global batch 4 -> 2 batches, the last padded with 2 masked zeros.
    evals = list(pipe.eval_iterator(4, process_index=0, process_count=1))
    assert [b["image"].shape for b in evals] == [(4, SIZE, SIZE, 3)] * 2
    masks = np.concatenate([b["mask"] for b in evals])
    assert masks.tolist() == [True] * 6 + [False] * 2
    np.testing.assert_array_equal(evals[1]["image"][2:], 0)
    assert np.concatenate([b["label"] for b in evals])[:6].tolist() == [0, 0, 1, 1, 2, 2]


def test_same_seed_same_batches_other_seed_other_batches(folder):
    source = ImageFolderSource(folder, "train")
    first = take(train_it(source, 4, seed=7), 6)
    assert_batches_equal(first, take(train_it(source, 4, seed=7), 6))
    other = take(train_it(source, 4, seed=8), 6)
    assert not all(
        np.array_equal(a["image"], b["image"]) for a, b in zip(first, other, strict=True)
    )
    # Every epoch is a permutation of the records, and a different one each epoch.
    stream = flat(take(train_it(IndexSource(18), 6, seed=7), 6))
    assert sorted(stream[:18]) == sorted(stream[18:]) == list(range(18))
    assert stream[:18] != stream[18:] and stream[:18] != list(range(18))


def test_two_hosts_read_disjoint_shards_that_cover_the_data():
    n, batch = 18, 6
    sources = [IndexSource(n), IndexSource(n)]
    seen = []
    for p, source in enumerate(sources):
        it = train_it(source, batch, process_index=p, process_count=2, num_epochs=1)
        seen.append([ids(b) for b in it])
    assert [len(s) for s in seen] == [3, 3], f"batches per host: {[len(s) for s in seen]}"
    host0 = [i for batch in seen[0] for i in batch]
    host1 = [i for batch in seen[1] for i in batch]
    assert not set(host0) & set(host1), f"hosts share records {set(host0) & set(host1)}"
    assert sorted(host0 + host1) == list(range(n))
    # Each host read only its own records.
    assert set(sources[0].read) == set(host0) and set(sources[1].read) == set(host1)
    # Global batch k is the same samples as with one process.
    single = [ids(b) for b in train_it(IndexSource(n), batch, num_epochs=1)]
    for k in range(3):
        assert sorted(seen[0][k] + seen[1][k]) == sorted(single[k]), f"global batch {k} differs"


def test_resume_from_iterator_state_is_exact(folder):
    source = ImageFolderSource(folder, "train")
    it = train_it(source, 4, seed=3)
    take(it, 3)  # k batches, into the second epoch at the end
    state = it.get_state()
    assert state["next_sample"] == 12
    expected = take(it, 4)  # m more
    fresh = train_it(source, 4, seed=3)
    fresh.set_state(state)
    assert_batches_equal(expected, take(fresh, 4))
    # A state from another seed is refused, naming the mismatch.
    with pytest.raises(ValueError, match="seed=3"):
        train_it(source, 4, seed=4).set_state(state)


def test_batch_size_change_at_a_sample_offset_continues_the_order():
    n = 18
    reference = flat(take(train_it(IndexSource(n), 2), 20))  # 40 samples
    small = train_it(IndexSource(n), 4)
    stage1 = flat(take(small, 3))  # 12 samples at batch 4
    # Stage 2 at batch 8 on two processes, starting where stage 1 stopped.
    hosts = [
        train_it(
            IndexSource(n), 8, start_sample=small.next_sample, process_index=p, process_count=2
        )
        for p in range(2)
    ]
    stage2 = []
    for _ in range(3):
        step = [ids(next(h)) for h in hosts]
        stage2.append(sorted(step[0] + step[1]))
    assert stage1 == reference[:12]
    assert stage2 == [sorted(reference[12 + 8 * k : 20 + 8 * k]) for k in range(3)]
    # set_state with a state from the previous stage restarts at its next_sample.
    big = train_it(IndexSource(n), 8)
    big.set_state(small.get_state())
    assert ids(next(big)) == reference[12:20]


def test_batch_size_change_keeps_each_samples_augmentation(folder):
    source = ImageFolderSource(folder, "train")
    by_two = take(train_it(source, 2, seed=5), 4)
    by_four = next(train_it(source, 4, seed=5))
    resumed = next(train_it(source, 4, seed=5, start_sample=4))
    np.testing.assert_array_equal(
        by_four["image"], np.concatenate([b["image"] for b in by_two[:2]])
    )
    np.testing.assert_array_equal(
        resumed["image"], np.concatenate([b["image"] for b in by_two[2:]])
    )


def test_worker_processes_give_the_same_batches_and_resume(folder):
    source = ImageFolderSource(folder, "train")
    expected = take(train_it(source, 4, seed=2), 6)
    with train_it(source, 4, seed=2, worker_count=2) as it:
        got = take(it, 3)
        state = it.get_state()
        got += take(it, 3)
    assert_batches_equal(expected, got)
    with train_it(source, 4, seed=2, worker_count=2) as fresh:
        fresh.set_state(state)
        assert_batches_equal(expected[3:], take(fresh, 3))


# --------------------------------------------------------------------------- small datasets


def test_digits_and_mnist5k_have_disjoint_stratified_splits():
    digits = {s: load_digits(s) for s in ("train", "val")}
    assert digits["train"].images.shape == (1438, 8, 8, 1)
    assert digits["val"].images.shape == (359, 8, 8, 1)
    assert digits["train"].images.dtype == np.uint8 and digits["train"].images.max() == 255
    mnist = {s: load_mnist5k(s) for s in ("train", "val")}
    assert mnist["train"].images.shape == (4000, 28, 28, 1)
    assert mnist["val"].images.shape == (1000, 28, 28, 1)
    assert np.bincount(mnist["val"].labels).tolist() == [100] * 10
    # The file is sorted by class; the splits must not be.
    assert np.any(np.diff(mnist["train"].labels[:100]) < 0)
    assert mnist["val"].mean == mnist["train"].mean  # eval normalised with train statistics
    labels = np.repeat(np.arange(10), 50)
    train_idx, val_idx = stratified_split(labels, 0.2, seed=0)
    assert not set(train_idx) & set(val_idx) and sorted([*train_idx, *val_idx]) == list(range(500))
    again = stratified_split(labels, 0.2, seed=0)
    np.testing.assert_array_equal(train_idx, again[0])
    # No image is in both splits (MNIST-5k has no duplicates across them).
    train_rows = {img.tobytes() for img in mnist["train"].images}
    assert not any(img.tobytes() in train_rows for img in mnist["val"].images)


def test_small_dataset_pipeline_batches():
    pipe = make_pipeline({"source": "mnist5k", "seed": 1})
    batch = next(pipe.train_iterator(32, process_index=0, process_count=1))
    assert batch["image"].shape == (32, 28, 28, 1) and batch["image"].dtype == np.float32
    assert abs(float(batch["image"].mean())) < 0.5  # normalised
    evals = list(pipe.eval_iterator(128, process_index=0, process_count=1))
    assert len(evals) == 8 and int(sum(b["mask"].sum() for b in evals)) == 1000


# --------------------------------------------------------------------------- errors


def test_missing_root_names_path_and_layout(tmp_path):
    with pytest.raises(
        DatasetError, match=rf"{tmp_path}/nope .*expected .*/train/<class>/\*\.JPEG"
    ):
        ImageFolderSource(tmp_path / "nope", "train")
    with pytest.raises(DatasetError, match=r"no metadata\.json.*jaxdist data convert"):
        ArrayRecordSource(tmp_path, "train")


def test_empty_train_folder_names_the_folder(tmp_path):
    (tmp_path / "train").mkdir()
    with pytest.raises(
        DatasetError, match=rf"no class folders under {tmp_path}/train; expected .*<class>/\*\.JPEG"
    ):
        make_pipeline(DataConfig(source="folder", root=str(tmp_path)))
    (tmp_path / "train" / "cat").mkdir()
    with pytest.raises(
        DatasetError, match=rf"class folder {tmp_path}/train/cat has no image files"
    ):
        ImageFolderSource(tmp_path, "train")


def test_corrupt_jpeg_names_the_file(tmp_path):
    write_image_folder(tmp_path, 2, 2, 1, (40, 60))
    broken = tmp_path / "train" / "class_01" / "img_0001.JPEG"
    broken.write_bytes(broken.read_bytes()[:40] + b"\x00garbage" * 8)
    source = ImageFolderSource(tmp_path, "train")
    with pytest.raises(DatasetError, match=r"cannot decode image .*class_01/img_0001\.JPEG"):
        list(train_it(source, 4, num_epochs=1))


def test_bad_batch_size_is_refused(folder):
    with pytest.raises(ValueError, match="multiple of process_count=2"):
        train_it(ImageFolderSource(folder, "train"), 5, process_count=2)


# --------------------------------------------------------------------------- CLI


def test_cli_convert_and_inspect(folder, tmp_path, capsys):
    out = tmp_path / "ar"
    assert (
        cli_main(["data", "convert", "--src", str(folder), "--dst", str(out), "--shards", "3"]) == 0
    )
    assert "train: 18 records in 3 shard(s)" in capsys.readouterr().out
    assert cli_main(["data", "inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "train: 18 images, 3 of 3 classes" in text and "val: 6 images" in text
    missing = ["--src", str(tmp_path / "none"), "--dst", str(tmp_path / "x"), "--shards", "1"]
    assert cli_main(["data", "convert", *missing]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_convert_refuses_an_existing_output_before_it_says_converting(folder, tmp_path, capsys):
    out = tmp_path / "ar"
    argv = ["data", "convert", "--src", str(folder), "--dst", str(out), "--shards", "1"]
    assert cli_main(argv) == 0
    assert "converting" in capsys.readouterr().out
    assert cli_main(argv) != 0
    captured = capsys.readouterr()
    assert "converting" not in captured.out, captured.out
    assert "metadata.json" in captured.err or "exists" in captured.err, captured.err


def test_inspect_fails_where_training_would_refuse_the_dataset(folder, tmp_path, capsys):
    """A folder without its held-out split: the train counts, then one line and exit 1, as
    `jaxdist train` exits on it; a folder that is not there: one line, exit 1."""
    import shutil

    root = tmp_path / "train_only"
    shutil.copytree(folder / "train", root / "train")
    assert cli_main(["data", "inspect", str(root)]) == 1
    captured = capsys.readouterr()
    assert "train: 18 images, 3 of 3 classes" in captured.out
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "jaxdist data: training would refuse this dataset: "
    )
    assert cli_main(["data", "inspect", str(tmp_path / "none")]) == 1
    assert capsys.readouterr().err.count("\n") == 1


# --------------------------------------------------------------------------- shares


def test_processes_holding_the_same_replicas_read_the_same_part_of_each_batch():
    """Which part of every global batch each process reads, from the replicas its devices
    hold: its own where the processes' replicas differ, the same where a tensor axis spans
    them, one line where processes share some replicas but not all; and an iterator built
    inside ``reading_share`` reads that part."""
    from types import SimpleNamespace

    from jaxdist.data.pipeline import process_of, reading_share
    from jaxdist.training.batches import data_share

    def mesh(processes, names):
        grid = np.array(processes, dtype=object)
        devices = np.vectorize(lambda p: SimpleNamespace(process_index=p), otypes=[object])(grid)
        return SimpleNamespace(devices=devices, axis_names=names)

    # 2 processes x 2 devices: fsdp across the processes, tensor inside each.
    inside = mesh([[0, 0], [1, 1]], ("fsdp", "tensor"))
    assert [data_share(inside, "fsdp", p) for p in (0, 1)] == [(0, 2), (1, 2)]
    # The tensor axis across them: each holds both replicas, so both read the whole batch.
    across = mesh([[0, 1], [0, 1]], ("fsdp", "tensor"))
    assert [data_share(across, "fsdp", p) for p in (0, 1)] == [(0, 1), (0, 1)]
    # 4 processes, tensor pairs across processes 0-1 and 2-3: two parts.
    pairs = mesh([[0, 1], [2, 3]], ("fsdp", "tensor"))
    assert [data_share(pairs, "fsdp", p) for p in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    overlapping = mesh([[0, 1], [0, 0]], ("fsdp", "tensor"))
    with pytest.raises(ValueError, match=r"process 0: \[0, 1\]; process 1: \[0\]"):
        data_share(overlapping, "fsdp", 0)

    def first_batch(**process):
        options = dict(seed=0, image_size=SIZE, shuffle=False, num_epochs=1)
        with build_train_iterator(IndexSource(8), 4, **options, **process) as batches:
            return ids(next(batches))

    with reading_share(1, 2):
        assert process_of(None, None) == (1, 2)
        assert process_of(0, 4) == (0, 4)  # given explicitly: as given
        inside = first_batch()
    assert process_of(None, None) == (0, 1)
    assert inside == first_batch(process_index=1, process_count=2) == [1, 3]
    assert first_batch() == [0, 1, 2, 3]

"""The DALI loader on CPU against the grain loader, and the grain path's decode and resize.

DALI decodes on the CPU here (no GPU): its libjpeg-turbo is the one the grain path's
simplejpeg uses, so the two loaders' images may differ only by rounding where both decode at
full scale, and by the filter standing in for the grain path's reduced-scale decode on large
images (checked statistically).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import simplejpeg

from jaxdist.data import dali_loader
from jaxdist.data.config import DataConfig, Pipeline
from jaxdist.data.fake import photo_like
from jaxdist.data.sources import DatasetError, ImageFolderSource
from jaxdist.data.transforms import decode_crop_resize, decode_scale, normalize

SIZE = 64


def write_photos(root, sizes, seed=0):
    """Photo-like JPEGs of the given (height, width), two classes, train and val alike."""
    rng = np.random.default_rng(seed)
    for split in ("train", "val"):
        for i, (height, width) in enumerate(sizes):
            folder = root / split / f"class_{i % 2}"
            folder.mkdir(parents=True, exist_ok=True)
            data = simplejpeg.encode_jpeg(photo_like(rng, height, width), quality=90)
            (folder / f"img_{i:03d}.JPEG").write_bytes(data)
    return root


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """Images whose every crop decodes at full scale (at most twice the output side)."""
    sizes = [(96, 128), (120, 90), (128, 100), (80, 110)] * 5
    return write_photos(tmp_path_factory.mktemp("photos"), sizes)


@pytest.fixture(scope="module")
def large_photos(tmp_path_factory):
    """Images many of whose crops the grain loader decodes at a reduced scale."""
    return write_photos(tmp_path_factory.mktemp("large"), [(300, 400), (400, 300)] * 6, seed=1)


def pipelines(root, **options):
    config = DataConfig(source="folder", root=str(root), image_size=SIZE, dtype="uint8")
    config = dataclasses.replace(config, **options)
    return Pipeline(config), Pipeline(dataclasses.replace(config, loader="dali"))


def both(root, kind, batch, count, **options):
    """``count`` batches of each loader (DALI: a pipeline per local device, 8 here)."""
    out = []
    for data in pipelines(root, **options):
        opened = data.eval_iterator(batch) if kind == "eval" else data.train_iterator(batch)
        with opened as batches:
            out.append([next(batches) for _ in range(count)])
    return out


def max_difference(a, b):
    return int(np.abs(a.astype(int) - b.astype(int)).max())


# --------------------------------------------------------------------------- same images


def test_eval_images_agree_within_jpeg_rounding_and_pad_alike(photos):
    grain, dali = both(photos, "eval", 8, 3)  # 20 images: the last batch has 4 padding rows
    for g, d in zip(grain, dali, strict=True):
        assert g.keys() == d.keys() == {"image", "label", "mask"}
        np.testing.assert_array_equal(d["label"], g["label"])
        np.testing.assert_array_equal(d["mask"], g["mask"])
        assert d["image"].dtype == np.uint8 and d["image"].shape == (8, SIZE, SIZE, 3)
        assert max_difference(d["image"], g["image"]) <= 1
    assert not dali[-1]["mask"][4:].any() and not dali[-1]["image"][4:].any()


def test_train_crops_and_flips_are_the_grain_loaders(photos):
    grain, dali = both(photos, "train", 8, 4)
    for g, d in zip(grain, dali, strict=True):
        np.testing.assert_array_equal(d["label"], g["label"])
        assert max_difference(d["image"], g["image"]) <= 1


def test_float32_output_is_the_normalised_uint8_output(photos):
    source = ImageFolderSource(photos, "train")
    floats, ints = (
        both(photos, "eval", 8, 1, dtype=dtype)[1][0]["image"] for dtype in ("float32", "uint8")
    )
    assert floats.dtype == np.float32
    expected = np.asarray(normalize(ints, source.mean, source.std))
    np.testing.assert_allclose(floats, expected, rtol=0, atol=1e-5)


def test_large_images_crops_agree_statistically(large_photos):
    """Where the grain loader decodes at 1/2 or 1/4 scale, DALI resizes instead: the crops
    are the same windows, so each image's mean colour agrees closely and its contrast within
    a few percent."""
    grain, dali = both(large_photos, "train", 8, 3)
    g = np.concatenate([b["image"] for b in grain]).astype(np.float64)
    d = np.concatenate([b["image"] for b in dali]).astype(np.float64)
    g_means, d_means = g.mean(axis=(1, 2)), d.mean(axis=(1, 2))
    assert np.abs(g_means - d_means).max() < 1.5, np.abs(g_means - d_means).max()
    assert np.corrcoef(g_means.ravel(), d_means.ravel())[0, 1] > 0.99
    contrast = d.std(axis=(1, 2, 3)) / g.std(axis=(1, 2, 3))
    assert np.all(np.abs(contrast - 1) < 0.06), contrast


def test_an_arrayrecord_conversion_gives_the_folders_batches(photos, tmp_path):
    from jaxdist.data.arrayrecord import convert_folder

    convert_folder(photos, tmp_path / "ar", shards=2)
    batches = []
    for source, root in (("folder", photos), ("arrayrecord", tmp_path / "ar")):
        config = DataConfig(source=source, root=str(root), image_size=SIZE, loader="dali")
        with Pipeline(config).train_iterator(8) as it:
            batches.append([next(it) for _ in range(2)])
    for a, b in zip(*batches, strict=True):
        np.testing.assert_array_equal(a["label"], b["label"])
        np.testing.assert_array_equal(a["image"], b["image"])


# --------------------------------------------------------------------------- position


def test_resume_replays_the_same_batches(photos):
    _, dali = pipelines(photos, seed=3)
    with dali.train_iterator(8) as batches:
        first = [next(batches) for _ in range(2)]
        state = batches.get_state()
        assert state["next_sample"] == batches.next_sample == 16
        after = [next(batches) for _ in range(2)]
    with dali.train_iterator(8) as resumed:
        resumed.set_state(state)
        again = [next(resumed) for _ in range(2)]
    assert not np.array_equal(first[0]["image"], after[0]["image"])
    for a, b in zip(after, again, strict=True):
        np.testing.assert_array_equal(a["label"], b["label"])
        np.testing.assert_array_equal(a["image"], b["image"])


def test_a_process_share_is_the_grain_loaders(photos):
    grain, dali = pipelines(photos)
    for process in range(2):
        shares = [
            data.train_iterator(16, process_index=process, process_count=2)
            for data in (grain, dali)
        ]
        with shares[0] as g, shares[1] as d:
            for _ in range(3):
                np.testing.assert_array_equal(next(d)["label"], next(g)["label"])


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"source": "digits"}, "data.loader=dali decodes images, but data.source='digits'"),
        ({"worker_count": 2}, "data.worker_count=2 starts grain decode processes"),
        ({"loader": "torchvision"}, "data.loader must be one of ('grain', 'dali')"),
    ],
)
def test_settings_dali_cannot_use_are_refused_in_one_line(tmp_path, options, message):
    values = {"source": "folder", "root": str(tmp_path), "loader": "dali", **options}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        DataConfig(**values)


def test_a_missing_dali_names_the_install_command(photos, monkeypatch):
    monkeypatch.setattr(dali_loader, "dali_available", lambda: False)
    with pytest.raises(DatasetError, match=r"pip install 'jaxdist\[dali\]'"):
        Pipeline(DataConfig(source="folder", root=str(photos), loader="dali"))


# --------------------------------------------------------------------------- grain's decode


def quadrants(height, width):
    """Four flat colours, one per quadrant: where a crop lands shows in its colour."""
    image = np.zeros((height, width, 3), np.uint8)
    image[: height // 2, : width // 2] = (200, 30, 30)
    image[: height // 2, width // 2 :] = (30, 200, 30)
    image[height // 2 :, : width // 2] = (30, 30, 200)
    image[height // 2 :, width // 2 :] = (200, 200, 30)
    return simplejpeg.encode_jpeg(image, quality=95)


@pytest.mark.parametrize("stored", [(128, 160), (512, 640)])
def test_decode_crop_resize_cuts_the_window_and_flips(stored):
    height, width = stored
    data = quadrants(height, width)
    top_left = (height * 0.05, width * 0.05, height * 0.4, width * 0.4)
    image = decode_crop_resize(data, top_left, 32, stored=stored)
    assert image.shape == (32, 32, 3) and image.dtype == np.uint8
    assert np.abs(image.astype(int) - (200, 30, 30)).max() <= 6
    # The whole image flipped: red (top left) now on the right.
    flipped = decode_crop_resize(data, (0, 0, height, width), 32, stored=stored, flip=True)
    plain = decode_crop_resize(data, (0, 0, height, width), 32, stored=stored)
    np.testing.assert_array_equal(flipped, plain[:, ::-1])
    assert np.abs(flipped[4, -4].astype(int) - (200, 30, 30)).max() <= 6


def test_decode_scale_takes_only_the_simd_scales_and_keeps_the_crop_large_enough():
    assert decode_scale((0, 0, 300, 300), 224) == 1.0  # 3/4 would be slower
    assert decode_scale((0, 0, 1000, 1000), 224) == 0.25
    assert decode_scale((0, 0, 449, 600), 224) == 0.5
    assert decode_scale((0, 0, 4000, 4000), 224) == 0.125
    assert decode_scale((0, 0, 50, 50), 224) == 1.0  # upscaled from full size


# --------------------------------------------------------------------------- data bench


def test_data_bench_times_each_loader_against_a_plan(photos, tmp_path, capsys):
    from jaxdist.cli import main

    plan = {
        "chip": "NVIDIA H100 SXM5",
        "stages": [{"per_chip_batch": 256, "step_seconds": {"total": 0.04}}],
    }
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    argv = [
        "data",
        "bench",
        "--source",
        "folder",
        "--root",
        str(photos),
        "--batch",
        "8",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--image-size",
        "32",
        "--loader",
        "grain,dali",
        "--plan",
        str(tmp_path / "plan.json"),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "the plan: 256 images per NVIDIA H100 SXM5 chip every 40.0 ms = 6,400 images/s" in out
    rows = [line for line in out.splitlines() if "images/s over 1 batches" in line]
    assert [row.split()[0] for row in rows] == ["grain", "dali"], out
    for row in rows:
        rate = float(row.split("images/s")[0].split()[-1].replace(",", ""))
        fed = float(row.split("feeds ")[1].split()[0])
        assert fed == pytest.approx(min(8, rate / 6400), abs=0.05), row
        assert row.endswith("of this host's 8 accelerators"), row


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--loader", "ffcv"], "--loader takes grain, dali, got ffcv"),
        (["--workers", "two"], "--workers takes comma-separated counts >= 0"),
        (["--plan", "missing.json"], "plan file missing.json not found"),
    ],
)
def test_data_bench_refuses_bad_options_in_one_line(photos, capsys, extra, message):
    from jaxdist.cli import main

    assert main(["data", "bench", "--source", "folder", "--root", str(photos), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


# --------------------------------------------------------------------------- a recipe


def write_mnist_folder(root):
    """MNIST-5k's train and val digits as an image folder of JPEGs, class folders by digit."""
    from jaxdist.data.small_datasets import load_mnist5k

    for split in ("train", "val"):
        source = load_mnist5k(split)
        for i in range(len(source)):
            record = source[i]
            folder = root / split / f"digit_{int(record['label'])}"
            folder.mkdir(parents=True, exist_ok=True)
            image = np.ascontiguousarray(np.repeat(np.asarray(record["image"]), 3, axis=-1))
            (folder / f"{i:05d}.jpg").write_bytes(simplejpeg.encode_jpeg(image, quality=95))
    return root


@pytest.mark.slow  # two 10-epoch runs of the MNIST recipe: about 4 minutes on 2 cores
def test_the_mnist_recipe_on_a_jpeg_folder_reaches_the_same_accuracy_with_either_loader(
    tmp_path,
):
    from jaxdist.run.config import apply_overrides, load_recipe
    from jaxdist.run.trainer import Trainer

    root = write_mnist_folder(tmp_path / "mnist")
    top1 = {}
    for loader in ("grain", "dali"):
        overrides = [
            "data.source=folder",
            f"data.root={root}",
            "data.image_size=28",
            "data.dtype=uint8",
            f"data.loader={loader}",
            "log_every_steps=1000",
        ]
        config = apply_overrides(load_recipe("mnist_small_batch"), overrides)
        top1[loader] = Trainer(config, tmp_path / loader).run()["top1"]
    assert top1["grain"] > 0.9, top1
    assert abs(top1["dali"] - top1["grain"]) <= 0.015, top1

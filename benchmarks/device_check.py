"""One real accelerator, checked in a few minutes: ResNet-50 training speed, the input pipeline,
memory, and what ``jaxdist plan``'s time model predicts for the chip.

On a GPU machine (``pip install "jax[cuda12]"`` and jaxdist), from the repository::

    python benchmarks/device_check.py                 # about 5 minutes on one H100
    python benchmarks/device_check.py --out benchmarks/results/device_check_h100.json

It measures, on the first device:

* the train step's images/s of ResNet-50 in bfloat16 (parameters float32) at per-device
  batches 128 and 256: jaxdist's ``TrainStep`` against the flax ImageNet example's step,
  timed in alternating rounds (:mod:`jaxdist.bench.resnet`), and the ratio;
* the input pipelines' train images/s (JPEG decode, random crop, flip) on a folder of
  photo-like ImageNet-sized JPEGs (500 x 375, quality 90): grain with a worker process per
  host core, and DALI decoding on the GPU (``device="mixed"``: nvJPEG and the hardware
  decoder where the GPU has one), and their ratio;
* ResNet-50 end to end at the first per-device batch: one pass over that folder with the DALI
  loader feeding the step (uint8 images, normalised on the device), against the same number
  of steps on a batch already on the device;
* the device's peak memory in use (what the runtime reports) and the compiled step's memory;
* the time model's step for the chip (FLOPs at peak times the calibrated efficiency of
  :mod:`jaxdist.aot.published`, as ``jaxdist plan`` prices it), beside the measured step;
* the transformer LM recipe's step (``recipes/transformer_lm.py`` at 12 layers x d_model 1024,
  context 512, bfloat16, AdamW) as ``jaxdist train`` builds it: measured, predicted as
  ``jaxdist plan`` prices a transformer (at the generation's model FLOPs utilization fitted
  on published runs, :mod:`jaxdist.aot.transformer_efficiency`), the share of the chip's
  peak FLOP/s it reaches, and its model FLOPs utilization (MaxText's count).

``--small`` runs the same on a narrow ResNet-50 at 32x32 pixels and per-device batches 4 and
8 (and a 2-layer LM of width 64), on any machine (the tests run it on CPU, with ``--batches 4``); ``--chip`` names the chip table entry to predict for when
the device's name does not say (a CPU has none).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import simplejpeg

from jaxdist import models
from jaxdist.aot import published
from jaxdist.aot.chips import CHIPS, network_for
from jaxdist.aot.compile import compile_train_step
from jaxdist.aot.predict import predict_step
from jaxdist.aot.timeline import matrix_flops
from jaxdist.aot.transformer_efficiency import fitted_efficiency
from jaxdist.bench import data as data_bench
from jaxdist.bench import resnet as resnet_bench
from jaxdist.data import DataConfig, dali_loader, make_pipeline
from jaxdist.data.fake import photo_like
from jaxdist.tasks.image_classification import NormalizeOnDevice
from jaxdist.training import optim
from jaxdist.training.classifier_loss import classifier_loss
from jaxdist.training.train_step import TrainStep

# Device names as the runtime reports them (device_kind) -> the chip table's entry.
KINDS = {"H200": "h200", "H100": "h100", "A100": "a100", "V100": "v100"}


def chip_for(device_kind: str, given: str | None) -> str | None:
    if given:
        if given not in CHIPS:
            raise SystemExit(
                f"device_check: --chip {given!r} is not in the chip table "
                f"({', '.join(sorted(CHIPS))})"
            )
        return given
    return next((name for key, name in KINDS.items() if key in device_kind), None)


def step_rates(per_device: int, size: int, width: int, steps: int, rounds: int) -> dict:
    """jaxdist's step and the flax example's on one device, bfloat16, images/s."""
    device = jax.devices()[:1]
    with jax.default_device(device[0]):
        rates = resnet_bench.measure(
            per_device,
            size,
            steps,
            warmup=1,
            width=width,
            rounds=rounds,
            conv_1x1_variant=False,
            dtype=jnp.bfloat16,
            devices=device,
        )
    found = {r.name: r for r in rates}
    ours, theirs = found[resnet_bench.JAXDIST], found[resnet_bench.FLAX_EXAMPLE]
    return {
        "per_device_batch": per_device,
        "jaxdist_images_per_s": ours.images_per_s,
        "jaxdist_step_ms": ours.step_ms,
        "flax_example_images_per_s": theirs.images_per_s,
        "flax_example_step_ms": theirs.step_ms,
        "jaxdist_over_flax_example": ours.images_per_s / theirs.images_per_s,
    }


def flop_counts(compiled) -> dict:
    """The step's FLOPs as the time model takes them beside two other counts: the device
    compiler's own analysis of the optimized program, and the program's matrix products and
    convolutions (library calls included). A gap between the first two is a count the
    compiler leaves out (the time model prices the first)."""
    own = compiled.compiled.cost_analysis()
    own = own[0] if isinstance(own, list) else own
    return {
        "flops_per_step": compiled.flops,
        "compiler_optimized_flops": float((own or {}).get("flops", 0.0)),
        "matrix_flops": matrix_flops(compiled.text),
    }


def predicted(per_device: int, size: int, width: int, chip: str) -> dict:
    """The compiled jaxdist step on this device, priced for ``chip`` as ``jaxdist plan``
    prices it: its FLOPs at peak x the calibrated efficiency (one device: no collectives)."""
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("data",))
    model = models.resnet50(width=width, dtype=jnp.bfloat16)
    example = jnp.zeros((1, size, size, 3))
    shapes = jax.eval_shape(lambda key: model.init(key, example, train=False), jax.random.key(0))
    params, model_state = shapes["params"], {k: v for k, v in shapes.items() if k != "params"}
    step = TrainStep(
        classifier_loss(model, num_classes=1000), optim.sgd_momentum(0.1), mesh, data_axes="data"
    )
    batch = {
        "image": ((per_device, size, size, 3), jnp.float32),
        "label": ((per_device,), jnp.int32),
    }
    compiled = compile_train_step(step, params, model_state, batch)
    return {
        **priced(compiled, chip),
        **flop_counts(compiled),
        "compiled_memory_bytes": compiled.memory.total,
    }


def priced(compiled, chip: str, model_flops: float | None = None) -> dict:
    """A compiled step's time on ``chip`` as ``jaxdist plan`` prices it (one device: no
    collectives): its FLOPs at peak x the chip's calibrated efficiency, or for a step whose
    task counts ``model_flops`` (a transformer's, MaxText's count), the efficiency at which
    those run at the generation's fitted model FLOPs utilization."""
    efficiency, note = published.calibrated_efficiency(chip)
    if model_flops:
        fit = fitted_efficiency(chip)
        efficiency, note = min(1.0, fit.value * compiled.flops / model_flops), fit.describe()
    seconds = predict_step(
        compiled, CHIPS[chip], efficiency=efficiency, network=network_for(CHIPS[chip])
    ).total
    return {
        "chip": chip,
        "efficiency": efficiency,
        "efficiency_note": note,
        "predicted_step_ms": seconds * 1e3,
    }


LM_SIZES = {
    "full": dict(num_layers=12, d_model=1024, num_heads=16, seq_len=512, batch=16),
    "small": dict(num_layers=2, d_model=64, num_heads=2, seq_len=64, batch=4),
}


def lm_step(small: bool, chip: str | None, steps: int, rounds: int) -> dict:
    """The transformer LM recipe's train step on the first device, built by the trainer as
    ``jaxdist train`` builds it: median step time over ``rounds`` of ``steps`` steps, the
    compiled step's FLOPs, and (with ``chip``) the time model's step for it."""
    from jaxdist.run.config import load_recipe, recipe_task
    from jaxdist.run.trainer import Trainer

    size = LM_SIZES["small" if small else "full"]
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "transformer_lm.py"
    config, get_task = load_recipe(recipe), recipe_task(recipe)
    for name in ("num_layers", "d_model", "num_heads"):
        config.model[name] = size[name]
    config.model.dtype = "bfloat16"
    config.data.seq_len = size["seq_len"]
    config.batch_size = size["batch"]
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("data",))
    with tempfile.TemporaryDirectory() as workdir:
        trainer = Trainer(config, workdir, task=get_task, mesh=mesh)
        step = trainer.train_step_for(0)
        state = trainer.initial_state()
        spec = trainer.parts.task.batch_spec(size["batch"])["tokens"]
        tokens = np.random.default_rng(0).integers(0, 256, spec.shape, np.uint8)
        batch = step.shard_batch({"tokens": tokens})
        rng = jax.random.key(0)
        state, metrics = step(state, batch, rng)  # compiles
        jax.block_until_ready(metrics)
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(steps):
                state, metrics = step(state, batch, rng)
            jax.block_until_ready(metrics)
            times.append((time.perf_counter() - start) / steps)
        variables = jax.eval_shape(trainer.parts.task.init_variables, jax.random.key(config.seed))
        shapes = {"tokens": (spec.shape, spec.dtype)}
        compiled = compile_train_step(step, *variables, shapes)
    measured = float(np.median(times))
    row = {
        "model": "transformer_lm",
        **size,
        "dtype": "bfloat16",
        "optimizer": "adamw",
        "step_ms": measured * 1e3,
        **flop_counts(compiled),
        "tokens_per_s": size["batch"] * size["seq_len"] / measured,
        "final_loss": float(jax.device_get(metrics["loss"])),
    }
    if chip is not None:
        model_flops = trainer.parts.task.model_flops_per_example() * size["batch"]
        row.update(priced(compiled, chip, model_flops))
        row["measured_over_predicted"] = row["step_ms"] / row["predicted_step_ms"]
        row["share_of_peak"] = compiled.flops / measured / CHIPS[chip].peak_flops
        row["model_flops_utilization"] = model_flops / measured / CHIPS[chip].peak_flops
    return row


def write_photo_folder(root: Path, count: int, small: bool) -> Path:
    """``count`` photo-like JPEGs of ImageNet's most common size (500 x 375; 40 x 30 small)."""
    height, width = (30, 40) if small else (375, 500)
    rng = np.random.default_rng(0)
    for i in range(count):
        folder = root / "train" / f"class_{i % 4}"
        folder.mkdir(parents=True, exist_ok=True)
        image = photo_like(rng, height, width)
        (folder / f"img_{i:05d}.JPEG").write_bytes(simplejpeg.encode_jpeg(image, quality=90))
    return root


def pipeline_rates(root: Path, size: int, batch: int, small: bool) -> dict:
    """The training iterator's images/s: grain with one worker process per host core, and
    DALI (GPU decode on a GPU) where it is installed."""
    workers = 0 if small else os.cpu_count() or 1
    steps = 2 if small else 20
    config = DataConfig(
        source="folder", root=str(root), image_size=size, dtype="uint8", worker_count=workers
    )
    grain = data_bench.measure(config, batch, steps=steps)
    result = {"workers": workers, "images_per_s": grain.images_per_s}
    if dali_loader.dali_available():
        dali_config = dataclasses.replace(config, loader="dali", worker_count=0)
        dali = data_bench.measure(dali_config, batch, steps=steps)
        result["dali"] = {
            "decode": dali_loader.decode_device(jax.local_devices()),
            "images_per_s": dali.images_per_s,
            "over_grain": dali.images_per_s / grain.images_per_s,
        }
    return result


def end_to_end(root: Path, per_device: int, size: int, width: int, loader: str) -> dict:
    """One pass over ``root`` with ``loader`` feeding the ResNet-50 step on the first device
    (uint8 images normalised on the device), against as many steps on a resident batch."""
    device = jax.devices()[0]
    mesh = jax.sharding.Mesh(np.asarray([device]), ("data",))
    config = DataConfig(
        source="folder",
        root=str(root),
        image_size=size,
        dtype="uint8",
        loader=loader,
        worker_count=0 if loader == "dali" else os.cpu_count() or 1,
    )
    data = make_pipeline(config)
    data.batch_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    model = models.resnet50(num_classes=data.num_classes, width=width, dtype=jnp.bfloat16)
    applied = NormalizeOnDevice(model, data.mean, data.std)
    variables = model.init(jax.random.key(0), jnp.zeros((1, size, size, 3)), train=False)
    step = TrainStep(
        classifier_loss(applied, num_classes=data.num_classes),
        optim.sgd_momentum(0.1),
        mesh,
        data_axes="data",
    )
    params = variables.pop("params")
    state = step.init(params, dict(variables))
    key = jax.random.key(0)
    steps = data.num_train_examples // per_device
    with data.train_iterator(per_device, num_epochs=1) as batches:
        resident = step.shard_batch(next(batches))
        for _ in range(2):  # compile and warm up
            state, metrics = step(state, resident, key)
        jax.block_until_ready(metrics)
        start = time.perf_counter()
        for _ in range(steps):
            state, metrics = step(state, resident, key)
        jax.block_until_ready(metrics)
        step_alone = time.perf_counter() - start
    with data.train_iterator(per_device, num_epochs=1) as batches:
        start = time.perf_counter()
        for batch in batches:
            state, metrics = step(state, step.shard_batch(batch), key)
        jax.block_until_ready(metrics)
        with_input = time.perf_counter() - start
    return {
        "loader": loader,
        "per_device_batch": per_device,
        "steps": steps,
        "step_alone_s": step_alone,
        "end_to_end_s": with_input,
        "end_to_end_over_step_alone": with_input / step_alone,
    }


def peak_memory() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="a narrow model, 32x32, batches 4, 8")
    parser.add_argument("--chip", default=None, help="chip table entry to predict for")
    parser.add_argument(
        "--batches",
        default=None,
        help="per-device batches, comma-separated (default 128,256; small 4,8)",
    )
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    device = jax.devices()[0]
    size, width = (32, 8) if args.small else (224, 64)
    batches = (4, 8) if args.small else (128, 256)
    if args.batches:
        batches = tuple(int(b) for b in args.batches.split(","))
    steps, rounds = (1, 2) if args.small else (5, 3)
    chip = chip_for(device.device_kind, args.chip)
    result = {
        "device": device.device_kind,
        "platform": device.platform,
        "jax": jax.__version__,
        "model": "resnet50" + ("" if width == 64 else f" width {width}"),
        "image_size": size,
        "dtype": "bfloat16",
        "steps": [],
    }
    for per_device in batches:
        print(f"timing per-device batch {per_device} ...", file=sys.stderr, flush=True)
        row = step_rates(per_device, size, width, steps, rounds)
        if chip is not None:
            row.update(predicted(per_device, size, width, chip))
            row["measured_over_predicted"] = row["jaxdist_step_ms"] / row["predicted_step_ms"]
        result["steps"].append(row)
    print("timing the transformer LM ...", file=sys.stderr, flush=True)
    result["lm"] = lm_step(args.small, chip, steps=2 if args.small else 10, rounds=rounds)
    result["peak_memory_bytes"] = peak_memory()
    print("timing the input pipelines and an epoch end to end ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = write_photo_folder(Path(tmp), 64 if args.small else 2048, args.small)
        result["input_pipeline"] = pipeline_rates(root, size, batches[0], args.small)
        loader = "dali" if "dali" in result["input_pipeline"] else "grain"
        per_device = 8 if args.small else max(batches)
        result["end_to_end"] = end_to_end(root, per_device, size, width, loader)
    result["seconds"] = time.perf_counter() - started
    print(
        f"{device.device_kind} ({device.platform}), {result['model']} at {size}x{size}, "
        f"bfloat16; input pipeline {result['input_pipeline']['images_per_s']:,.0f} images/s "
        f"({result['input_pipeline']['workers']} workers)"
    )
    if "dali" in result["input_pipeline"]:
        dali = result["input_pipeline"]["dali"]
        print(
            f"DALI loader ({dali['decode']} decode): {dali['images_per_s']:,.0f} images/s, "
            f"{dali['over_grain']:.2f}x grain's"
        )
    e2e = result["end_to_end"]
    print(
        f"an epoch of {e2e['steps']} steps at {e2e['per_device_batch']} per device with the "
        f"{e2e['loader']} loader: {e2e['end_to_end_s']:.2f} s, "
        f"{e2e['end_to_end_over_step_alone']:.3f}x the step alone"
    )
    print(
        f"{'batch':>6} {'jaxdist img/s':>14} {'flax ex. img/s':>15} {'ratio':>6} "
        f"{'predicted ms':>13} {'measured ms':>12}"
    )
    for row in result["steps"]:
        guess = f"{row['predicted_step_ms']:.3g}" if "predicted_step_ms" in row else "-"
        print(
            f"{row['per_device_batch']:>6} {row['jaxdist_images_per_s']:>14,.1f} "
            f"{row['flax_example_images_per_s']:>15,.1f} "
            f"{row['jaxdist_over_flax_example']:>6.3f} {guess:>13} "
            f"{row['jaxdist_step_ms']:>12.1f}"
        )
    lm = result["lm"]
    guess = f", predicted {lm['predicted_step_ms']:.3g} ms" if "predicted_step_ms" in lm else ""
    share = f", {lm['share_of_peak']:.1%} of peak" if "share_of_peak" in lm else ""
    if "model_flops_utilization" in lm:
        share += f" ({lm['model_flops_utilization']:.1%} model FLOPs utilization)"
    print(
        f"transformer LM {lm['num_layers']}x{lm['d_model']}, context {lm['seq_len']}, batch "
        f"{lm['batch']}: {lm['step_ms']:.1f} ms{guess}{share}, "
        f"{lm['tokens_per_s']:,.0f} tokens/s"
    )
    if result["peak_memory_bytes"] is not None:
        print(f"peak memory in use: {result['peak_memory_bytes'] / 2**30:.2f} GiB")
    print(f"took {result['seconds']:.0f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Train-step benchmark: jaxdist's data-parallel step against the step a user would write.

The baseline is the plain data-parallel step of the flax examples, written with ``shard_map``:
``jax.grad`` on each device's shard, ``lax.pmean`` of the gradients, the optax update. Every
variant trains the same small ResNet with cross-replica BatchNorm on the same batches and mesh.

Each variant also runs with its gradient communication removed (the baseline without its
pmean, jaxdist with ``allreduce="none"``); the difference is the time the allreduce adds to a
step -- Poseidon's compute / communication split. Variants are timed in interleaved rounds so
that load from other processes on a shared machine hits all of them alike.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist import models
from jaxdist.bench import timing
from jaxdist.comm import buckets as bucketing
from jaxdist.comm import hybrid
from jaxdist.training import step_checks
from jaxdist.training import train_step as ts
from jaxdist.training.classifier_loss import classifier_loss
from jaxdist.training.step_options import NO_ALLREDUCE, Communication

__all__ = [
    "Measurement",
    "run",
]


@dataclass
class Measurement:
    variant: str
    step_seconds: float  # median
    images_per_second: float
    vs_baseline: float  # images/s over the baseline's
    compute_seconds: float  # median step time without gradient communication
    # step_seconds - compute_seconds: the time the gradient allreduce adds to a step. Near 0,
    # or below it, where the allreduce overlaps the backward pass or is lost in noise.
    communication_seconds: float
    # Half the range, over the timing rounds, of the step's time minus its compute-only
    # twin's in the same round: how far communication_seconds can be trusted.
    communication_spread_seconds: float = 0.0


def small_resnet(axes, width: int, num_classes: int) -> nn.Module:
    """ResNet-18 with the small (CIFAR-sized) stem and cross-replica BatchNorm over ``axes``."""
    norm = models.default_norm
    return models.resnet18(
        stem="small",
        width=width,
        num_classes=num_classes,
        norm=lambda **kw: norm(axis_name=axes, **kw),
    )


def baseline_step(
    model: nn.Module,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    axes: str | tuple[str, ...],
    communicate: bool = True,
    *,
    weight_decay: float = 0.0,
    donate: bool | None = None,
) -> Callable:
    """The hand-written data-parallel step of the flax examples (``examples/imagenet``'s
    ``train_step``), as ``jit`` of a ``shard_map`` over ``axes``:
    ``(params, batch_stats, opt_state, batch) -> (params, batch_stats, opt_state, metrics)``.

    Cross-entropy on one-hot labels plus ``0.5 * weight_decay * sum(w**2)`` over ``ndim > 1``
    parameters, ``value_and_grad``, ``lax.pmean`` of the gradients (left out when not
    ``communicate``: the compute-only twin), the optax update; ``metrics`` are the loss and
    accuracy averaged over ``axes``. BatchNorm statistics are as the model leaves them (the
    same on every device with cross-replica BatchNorm). ``donate``: the state is donated;
    ``None`` donates exactly when :class:`~jaxdist.training.train_step.TrainStep` does, so a
    comparison with it is like for like.
    """

    def body(params, batch_stats, opt_state, batch):
        def loss_fn(params):
            logits, new_state = model.apply(
                {"params": params, "batch_stats": batch_stats},
                batch["image"],
                train=True,
                mutable=["batch_stats"],
            )
            one_hot = jax.nn.one_hot(batch["label"], logits.shape[-1])
            loss = optax.softmax_cross_entropy(logits, one_hot).mean()
            total = loss
            if weight_decay:
                l2 = sum(jnp.sum(p**2) for p in jax.tree.leaves(params) if p.ndim > 1)
                total = loss + 0.5 * weight_decay * l2
            return total, (new_state["batch_stats"], logits, loss)

        (_, (batch_stats, logits, loss)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        if communicate:
            grads = lax.pmean(grads, axes)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["label"])
        metrics = lax.pmean({"loss": loss, "accuracy": accuracy}, axes)
        return params, batch_stats, opt_state, metrics

    sharded = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(), P(), P(), P(axes)),
        out_specs=(P(), P(), P(), P()),
        check_vma=False,
    )
    if donate is None:
        donate = step_checks.donation_default(mesh)
    return jax.jit(sharded, donate_argnums=(0, 1, 2) if donate else ())


def run(
    mesh: Mesh,
    algorithms: Sequence[str] = ("native", "ring", "torus2d"),
    *,
    per_device_batch: int = 16,
    image_size: int = 32,
    width: int = 16,
    num_classes: int = 10,
    steps: int = 3,
    rounds: int = 5,
    bucket_bytes: int | None = bucketing.DEFAULT_BUCKET_BYTES,
    wait_free: bool = False,
    progress: Callable[[str], None] | None = None,
) -> list[Measurement]:
    """Images/s of each variant; the baseline is the first row. With ``wait_free``, every
    permute schedule also runs paced beside backward (``jaxdist ALGORITHM wait-free``),
    timed in the same rounds as the step that leaves the order to the compiler."""
    say = progress or (lambda _msg: None)
    names = tuple(mesh.axis_names)
    axes = names[0] if len(names) == 1 else names
    model = small_resnet(axes, width, num_classes)
    init_model = small_resnet(None, width, num_classes)
    global_batch = per_device_batch * mesh.size
    rng = np.random.default_rng(0)
    host_batch = {
        "image": rng.standard_normal((global_batch, image_size, image_size, 3)).astype(np.float32),
        "label": rng.integers(0, num_classes, global_batch).astype(np.int32),
    }
    # On the host, so that every variant gets device buffers of its own to donate.
    variables = jax.device_get(
        models.init_variables(init_model, jax.random.key(0), host_batch["image"][:2])
    )
    optimizer = optax.sgd(0.1, momentum=0.9)
    batch = ts.shard_batch(mesh, axes, host_batch)
    runners = {
        **_baseline_runners(model, optimizer, mesh, axes, variables, batch),
        **_jaxdist_runners(
            model,
            optimizer,
            mesh,
            algorithms,
            variables,
            batch,
            num_classes,
            bucket_bytes,
            wait_free,
        ),
    }
    timing.warm_up(
        runners, warmup=1, on_compiled=lambda name, s: say(f"  compiled {name} ({s:.1f} s)")
    )
    say(f"  timing {len(runners)} variants in {rounds} interleaved rounds of {steps} steps")
    times = timing.interleaved_rounds(runners, steps, rounds)
    return _measurements(times, global_batch)


def _baseline_runners(model, optimizer, mesh, axes, variables, batch) -> dict[str, Callable]:
    """One step of the plain jit + pmean baseline, with (``baseline``) and without
    (``baseline/none``) its gradient pmean, each on its own copy of the state."""
    replicated = NamedSharding(mesh, P())
    runners = {}
    for communicate in (True, False):
        step = baseline_step(model, optimizer, mesh, axes, communicate)
        carry = jax.device_put(
            [variables["params"], variables["batch_stats"], optimizer.init(variables["params"])],
            replicated,
        )

        def run_baseline(step=step, carry=carry):
            params, stats, opt_state, _ = step(*carry, batch)
            carry[:] = [params, stats, opt_state]
            jax.block_until_ready(params)

        runners["baseline" + ("" if communicate else "/none")] = run_baseline
    return runners


def _jaxdist_runners(
    model, optimizer, mesh, algorithms, variables, batch, num_classes, bucket_bytes, wait_free
) -> dict[str, Callable]:
    """One step of jaxdist's TrainStep per algorithm (``jaxdist ALGORITHM``), the same step
    with no allreduce (``jaxdist ALGORITHM/none``) and, with ``wait_free``, the schedule
    paced beside backward (``jaxdist ALGORITHM wait-free``), each on its own state."""
    runners = {}
    for name, allreduce, paced in _jaxdist_variants(algorithms, wait_free):
        step = ts.TrainStep(
            classifier_loss(model, num_classes=num_classes),
            optimizer,
            mesh,
            communication=Communication(allreduce, bucket_bytes=bucket_bytes, wait_free=paced),
        )
        holder = [step.init(variables["params"], {"batch_stats": variables["batch_stats"]})]

        def run_jaxdist(step=step, holder=holder):
            holder[0], _ = step(holder[0], batch, jax.random.key(0))
            jax.block_until_ready(holder[0].params)

        runners[name] = run_jaxdist
    return runners


def _jaxdist_variants(algorithms: Sequence[str], wait_free: bool) -> list[tuple[str, str, bool]]:
    """``(name, allreduce, paced)`` of each jaxdist step the benchmark times: per algorithm the
    step, its compute-only twin (``/none``) and, with ``wait_free``, the step paced beside
    backward, for the permute schedules only (``native`` and ``auto`` have no steps to pace)."""
    variants = []
    for algorithm in algorithms:
        variants += [
            (f"jaxdist {algorithm}", algorithm, False),
            (f"jaxdist {algorithm}/none", NO_ALLREDUCE, False),
        ]
        if wait_free and algorithm not in ("native", hybrid.AUTO):
            variants.append((f"jaxdist {algorithm} wait-free", algorithm, True))
    return variants


def _measurements(times: dict[str, list[float]], global_batch: int) -> list[Measurement]:
    """One row per variant that communicates, from its per-round step times; its ``/none``
    twin's time, taken in the same rounds, is its compute (a wait-free variant's twin is that
    of the same schedule)."""
    median = {name: statistics.median(t) for name, t in times.items()}
    results = []
    for name in [n for n in times if not n.endswith("/none")]:
        twin = f"{name.removesuffix(' wait-free')}/none"
        step_s, compute_s = median[name], median[twin]
        differences = [a - b for a, b in zip(times[name], times[twin])]
        results.append(
            Measurement(
                variant=name,
                step_seconds=step_s,
                images_per_second=global_batch / step_s,
                vs_baseline=median["baseline"] / step_s,
                compute_seconds=compute_s,
                communication_seconds=step_s - compute_s,
                communication_spread_seconds=(max(differences) - min(differences)) / 2,
            )
        )
    return results


def format_table(results: list[Measurement], mesh: Mesh, global_batch: int) -> str:
    lines = [
        f"# train step on mesh {dict(mesh.shape)} ({mesh.size} {mesh.devices.flat[0].platform} "
        f"devices), global batch {global_batch}",
        f"{'variant':<28s} {'step(ms)':>9s} {'images/s':>9s} {'x baseline':>10s} "
        f"{'compute(ms)':>11s} {'comm(ms)':>9s} {'+-(ms)':>7s}",
    ]
    for m in results:
        lines.append(
            f"{m.variant:<28s} {m.step_seconds * 1e3:9.1f} {m.images_per_second:9.1f} "
            f"{m.vs_baseline:10.3f} {m.compute_seconds * 1e3:11.1f} "
            f"{m.communication_seconds * 1e3:9.1f} {m.communication_spread_seconds * 1e3:7.1f}"
        )
    lines.append(
        "# compute: the same step without its gradient allreduce; comm = step - compute, the "
        "time the allreduce adds (medians over rounds). +-: half its spread across rounds. A "
        "comm within its +- of 0, or below 0, means the allreduce is hidden behind the backward "
        "pass or lost in the noise, not that it is free."
    )
    return "\n".join(lines)


def to_json(results: list[Measurement]) -> list[dict]:
    return [asdict(m) for m in results]


def schedule_summary(compiled_hlo: str) -> dict:
    """Where gradient ``collective-permute`` ops sit among the convolutions in XLA's scheduled
    entry computation (compiled HLO lists instructions in execution order)."""
    entry = compiled_hlo[compiled_hlo.index("\nENTRY") :]
    kinds = []
    for line in entry.splitlines()[1:]:
        match = re.match(r"\s*(?:ROOT )?%(\S+) = .*? ([a-z][a-z0-9-]*)\(", line)
        if match:
            name, kind = match.groups()
            kinds.append("convolution" if "convolution" in name or kind == "convolution" else kind)
    convolutions = [i for i, k in enumerate(kinds) if k == "convolution"]
    permutes = [i for i, k in enumerate(kinds) if k == "collective-permute"]
    first = permutes[0] if permutes else None
    return {
        "instructions": len(kinds),
        "convolutions": len(convolutions),
        "collective_permutes": len(permutes),
        "all_reduces": kinds.count("all-reduce"),
        "first_permute_at": first,
        "last_convolution_at": convolutions[-1] if convolutions else None,
        "convolutions_after_first_permute": sum(c > first for c in convolutions) if permutes else 0,
    }


def compiled_step_hlo(
    mesh: Mesh,
    algorithm: str,
    *,
    bucket_bytes: int,
    width: int = 16,
    per_device_batch: int = 8,
    image_size: int = 32,
) -> tuple[str, int]:
    """Compiled HLO text of one jaxdist train step, and its number of gradient buckets."""
    names = tuple(mesh.axis_names)
    axes = names[0] if len(names) == 1 else names
    model, init_model = small_resnet(axes, width, 10), small_resnet(None, width, 10)
    images = np.zeros((per_device_batch * mesh.size, image_size, image_size, 3), np.float32)
    variables = jax.device_get(models.init_variables(init_model, jax.random.key(0), images[:2]))
    step = ts.TrainStep(
        classifier_loss(model, num_classes=10),
        optax.sgd(0.1),
        mesh,
        communication=Communication(algorithm, bucket_bytes=bucket_bytes),
    )
    state = step.init(variables["params"], {"batch_stats": variables["batch_stats"]})
    batch = step.shard_batch({"image": images, "label": np.zeros(len(images), np.int32)})
    lowered = step.lower(state, batch, jax.random.key(0))
    return lowered.compile().as_text(), len(step.buckets)


def gradient_plan(
    mesh: Mesh,
    algorithm: str,
    *,
    links: str | None,
    sfb_layers: str | tuple[str, ...] | None,
    bucket_bytes: int,
    width: int = 16,
    per_device_batch: int = 16,
    image_size: int = 32,
    num_classes: int = 10,
) -> ts.GradientPlan:
    """The gradient plan of the benchmark's step (buckets, schedules, dense layers sent as
    factors), from shapes only: nothing is compiled or run."""
    names = tuple(mesh.axis_names)
    axes = names[0] if len(names) == 1 else names
    model, init_model = (
        small_resnet(axes, width, num_classes),
        small_resnet(None, width, num_classes),
    )
    images = jax.ShapeDtypeStruct(
        (per_device_batch * mesh.size, image_size, image_size, 3), np.float32
    )
    variables = jax.eval_shape(lambda x: init_model.init(jax.random.key(0), x, train=False), images)
    step = ts.TrainStep(
        classifier_loss(model, num_classes=num_classes),
        optax.sgd(0.1),
        mesh,
        communication=Communication(
            algorithm, bucket_bytes=bucket_bytes, links=links, sfb_layers=sfb_layers
        ),
    )
    state = step.abstract_init(variables["params"], {"batch_stats": variables["batch_stats"]})
    labels = jax.ShapeDtypeStruct((images.shape[0],), np.int32)
    return step.plan(state, {"image": images, "label": labels})

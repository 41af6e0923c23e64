"""Sharded-state benchmark: one transformer LM step replicated, as ZeRO-1, as FSDP with a
schedule of the family, and as XLA's own FSDP, on the same mesh and batches.

XLA's own FSDP is how MaxText shards a model: the step is a plain ``jax.jit`` of the loss, the
gradient and the optax update, its parameters and optimizer state placed with a
``NamedSharding`` split along the same dimension jaxdist splits
(:class:`~jaxdist.training.sharding.Placement`), and the SPMD partitioner inserts the
all-gathers and reduce-scatters. Every variant reports its median step time over
interleaved rounds (machines are shared: rounds alternate so load hits every variant alike),
its ratio to XLA's FSDP and to the replicated step, and per device the bytes of its state
(parameters and optimizer state) and the compiler's peak (arguments, temporaries and
outputs less what is aliased).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.bench import timing
from jaxdist.models.nnx_model import NnxModel
from jaxdist.models.transformer import Transformer
from jaxdist.tasks.language_model import VOCAB, inputs_of, next_byte_nll
from jaxdist.training import train_step as ts
from jaxdist.training.step_options import Communication, StateSharding

__all__ = ["Measurement", "format_table", "run"]

XLA_FSDP = "XLA FSDP (jit + NamedSharding)"


@dataclass
class Measurement:
    variant: str
    step_seconds: float  # median over rounds
    vs_xla_fsdp: float  # step time over XLA's FSDP's
    vs_replicated: float  # step time over the replicated step's
    state_bytes: int  # parameters and optimizer state held per device
    peak_bytes: int  # the compiler's arguments + temporaries + outputs - aliased, per device
    final_loss: float  # after the timed steps: every variant trains the same model


def _model(num_layers: int, d_model: int, seq_len: int) -> NnxModel:
    module = Transformer(
        vocab_size=VOCAB,
        max_len=seq_len,
        num_layers=num_layers,
        d_model=d_model,
        num_heads=max(1, d_model // 32),
        rngs=nnx.Rngs(0),
    )
    return NnxModel(module)


def _loss_fn(model: NnxModel) -> Callable:
    def loss_fn(params, model_state, batch, rng):
        logits, model_state = model.apply(
            params, model_state, inputs_of(batch["tokens"]), rng=rng, train=True
        )
        loss = next_byte_nll(logits, batch["tokens"]).mean()
        return loss, (model_state, {})

    return loss_fn


def _peak(compiled) -> int:
    m = compiled.memory_analysis()
    return int(
        m.argument_size_in_bytes
        + m.temp_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
    )


def _state_bytes(state) -> int:
    """Bytes one device holds of the state's parameters and optimizer state."""
    leaves = jax.tree.leaves((state.params, state.opt_state))
    return int(sum(leaf.addressable_shards[0].data.nbytes for leaf in leaves))


def _xla_fsdp(step: ts.TrainStep, state, batch, rng):
    """The same model, optimizer and placement as ``step`` (an FSDP TrainStep), stepped by a plain
    ``jax.jit`` that leaves every collective to XLA's SPMD partitioner."""
    shardings = step.state_shardings(state)
    batch_sharding = NamedSharding(step.mesh, P(step.data_axes))

    def train(state, batch, rng):
        def objective(params):
            loss, (model_state, _) = step.loss_fn(params, state.model_state, batch, rng)
            return loss, model_state

        (loss, model_state), grads = jax.value_and_grad(objective, has_aux=True)(state.params)
        updates, opt_state = step.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new = state.replace(
            step=state.step + 1, params=params, model_state=model_state, opt_state=opt_state
        )
        return new, {"loss": loss}

    compiled = (
        jax.jit(
            train,
            in_shardings=(shardings, batch_sharding, NamedSharding(step.mesh, P())),
            out_shardings=(shardings, NamedSharding(step.mesh, P())),
        )
        .lower(state, batch, rng)
        .compile()
    )
    return compiled


def run(
    mesh: Mesh,
    algorithm: str,
    *,
    num_layers: int = 2,
    d_model: int = 256,
    seq_len: int = 128,
    per_device_batch: int = 4,
    steps: int = 3,
    rounds: int = 5,
    progress: Callable[[str], None] = lambda _: None,
) -> list[Measurement]:
    """Time one LM step per variant on ``mesh`` (every axis splitting the batch); see the
    module docstring."""
    model = _model(num_layers, d_model, seq_len)
    params, model_state = model.variables()
    optimizer = optax.adamw(1e-3, weight_decay=0.01)
    loss_fn = _loss_fn(model)
    global_batch = per_device_batch * mesh.devices.size
    tokens = np.random.default_rng(0).integers(0, VOCAB, (global_batch, seq_len + 1), np.uint8)
    rng = jax.random.key(0)
    variants = {"replicated": "replicated", "zero1": "zero1", f"fsdp ({algorithm})": "fsdp"}
    communication = Communication(algorithm)
    runners, compiled, holders = {}, {}, {}
    for name, kind in variants.items():
        step = ts.TrainStep(
            loss_fn,
            optimizer,
            mesh,
            communication=communication,
            sharding=StateSharding(kind),
        )
        holders[name] = [step.init(params, model_state)]
        batch = step.shard_batch({"tokens": tokens})
        compiled[name] = step.lower(holders[name][0], batch, rng).compile()
        runners[name] = _runner(step, holders[name], batch, rng)
        progress(f"compiled {name}")
    fsdp_step = ts.TrainStep(
        loss_fn,
        optimizer,
        mesh,
        communication=Communication(algorithm),
        sharding=StateSharding("fsdp"),
    )
    holders[XLA_FSDP] = [fsdp_step.init(params, model_state)]
    batch = fsdp_step.shard_batch({"tokens": tokens})
    compiled[XLA_FSDP] = _xla_fsdp(fsdp_step, holders[XLA_FSDP][0], batch, rng)
    runners[XLA_FSDP] = _runner(compiled[XLA_FSDP], holders[XLA_FSDP], batch, rng)
    progress(f"compiled {XLA_FSDP}")
    timing.warm_up(runners, warmup=1)
    seconds = {
        k: statistics.median(v)
        for k, v in timing.interleaved_rounds(runners, steps, rounds).items()
    }
    results = []
    for name in runners:
        loss = float(jax.device_get(runners[name]()["loss"]))
        results.append(
            Measurement(
                variant=name,
                step_seconds=seconds[name],
                vs_xla_fsdp=seconds[name] / seconds[XLA_FSDP],
                vs_replicated=seconds[name] / seconds["replicated"],
                state_bytes=_state_bytes(holders[name][0]),
                peak_bytes=_peak(compiled[name]),
                final_loss=loss,
            )
        )
    return results


def _runner(step: Callable, holder: list, batch, rng) -> Callable:
    """One step of ``step(state, batch, rng) -> (state, metrics)`` on the state in ``holder``."""

    def one():
        holder[0], metrics = step(holder[0], batch, rng)
        return metrics

    return one


def format_table(results: list[Measurement], mesh: Mesh, describe: str) -> str:
    lines = [
        f"# {describe}, {mesh.devices.size} devices",
        f"{'variant':<34} {'step ms':>9} {'vs XLA FSDP':>12} {'vs replicated':>14} "
        f"{'state MiB/dev':>14} {'peak MiB/dev':>13} {'loss':>8}",
    ]
    for r in results:
        lines.append(
            f"{r.variant:<34} {r.step_seconds * 1e3:>9.2f} {r.vs_xla_fsdp:>12.2f} "
            f"{r.vs_replicated:>14.2f} {r.state_bytes / 2**20:>14.2f} "
            f"{r.peak_bytes / 2**20:>13.2f} {r.final_loss:>8.4f}"
        )
    return "\n".join(lines)


def to_json(results: list[Measurement]) -> list[dict]:
    return [asdict(r) for r in results]

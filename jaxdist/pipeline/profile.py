"""Per-layer costs of a model, the input of the stage partitioner, as PipeDream profiles them.

A :class:`Profile` lists, for each layer of a network that runs spans of its layers (a
``layers=(start, stop)`` field and ``num_layers``, as :class:`jaxdist.models.ResNet` has), for
one micro-batch: the forward time, the backward time (the pipeline's backward op: the
forward recomputed and pulled back, :mod:`jaxdist.pipeline.passes`), the bytes of its output
activation, and the bytes of its parameters, optimizer state and model state.

:func:`measure_profile` times each layer on this machine's first device, on arrays already in
memory (the input pipeline is not part of it): each layer compiled alone, warmed up, then
timed in interleaved rounds, every layer once per round, and the median taken. :mod:`jaxdist.aot.layer_profile` makes one from the
compiler for a chip that is not here. Profiles are JSON (:meth:`Profile.write`,
:func:`read_profile`); :meth:`Profile.check_matches` refuses one made for another model.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxdist.pipeline.stages import flax_stages, split_module, split_variables

__all__ = [
    "LayerCost",
    "Profile",
    "ProfileMismatchError",
    "interleaved_seconds",
    "layer_calls",
    "layer_sizes",
    "measure_profile",
    "pass_functions",
    "profile_layers",
    "read_profile",
    "with_times",
]


class ProfileMismatchError(ValueError):
    """A profile of another model, or a file that is not a profile."""

    exit_code = 2


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """One layer's costs for one micro-batch (times in seconds, sizes in bytes)."""

    name: str
    forward_s: float
    backward_s: float
    activation_bytes: int
    param_bytes: int
    optimizer_bytes: int
    model_state_bytes: int
    flops: float = 0.0  # forward and backward, when the compiler counted them


@dataclasses.dataclass(frozen=True)
class Profile:
    """Per-layer costs of ``model`` (a description: its name and the fields that shape it)
    at ``micro_batch`` images, measured on ``device`` (``source``: ``measured`` or
    ``compiler``)."""

    model: dict[str, Any]
    micro_batch: int
    device: str
    source: str
    layers: tuple[LayerCost, ...]

    def write(self, path: str | Path) -> None:
        record = dataclasses.asdict(self)
        Path(path).write_text(json.dumps(record, indent=1) + "\n")

    def check_matches(self, model: dict[str, Any], micro_batch: int, sizes: Sequence[int]) -> None:
        """Refuse this profile for another model: ``model`` is the description a profile of
        it would carry and ``sizes`` its layers' parameter bytes (:func:`layer_sizes`)."""
        if len(sizes) != len(self.layers):
            raise ProfileMismatchError(
                f"the profile has {len(self.layers)} layers, the model {len(sizes)}: it was made "
                f"for {self.model}, not {model}"
            )
        for index, (layer, size) in enumerate(zip(self.layers, sizes, strict=True)):
            if layer.param_bytes != size:
                raise ProfileMismatchError(
                    f"layer {index} ({layer.name}) has {layer.param_bytes} parameter bytes in "
                    f"the profile and {size} in the model: it was made for {self.model}, not "
                    f"{model}"
                )
        if micro_batch != self.micro_batch:
            raise ProfileMismatchError(
                f"the profile is of micro-batches of {self.micro_batch} images, the pipeline "
                f"runs {micro_batch}: profile it again at {micro_batch}"
            )


def read_profile(path: str | Path) -> Profile:
    """A profile written by :meth:`Profile.write`, or one line on what is wrong with it."""
    try:
        record = json.loads(Path(path).read_text())
        layers = tuple(LayerCost(**layer) for layer in record.pop("layers"))
        return Profile(**record, layers=layers)
    except OSError as err:
        raise ProfileMismatchError(f"cannot read profile {path}: {err.strerror}") from err
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        raise ProfileMismatchError(
            f"{path} is not a layer profile (written by `jaxdist pipeline profile`): {err}"
        ) from err


def _bytes(tree: Any) -> int:
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def layer_sizes(model: nn.Module, example: jax.ShapeDtypeStruct) -> list[int]:
    """Parameter bytes of each layer of ``model`` for inputs like ``example``."""
    modules = split_module(model, stages=model.num_layers)
    shapes = jax.eval_shape(lambda x: model.init(jax.random.key(0), x, train=False), example)
    params, _ = split_variables(shapes, modules, example)
    return [_bytes(p) for p in params]


def pass_functions(apply: Callable, key: jax.Array, first: bool) -> tuple[Callable, Callable]:
    """``(forward, backward)`` of a stage function, both ``(params, model_state, x)``: the
    pipeline's forward op, and its backward op (the forward recomputed, then pulled back to
    the parameters and, but for the ``first`` stage, whose input is the batch, the input)."""

    def forward(p, s, x):
        return apply(p, s, x, key)[0]

    def backward(p, s, x):
        run = lambda p, x: apply(p, s, x, key)[0]  # noqa: E731
        if first:
            out, pull = jax.vjp(lambda p: run(p, x), p)
        else:
            out, pull = jax.vjp(run, p, x)
        return pull(jnp.ones_like(out))

    return forward, backward


Call = tuple[Callable, tuple]  # a compiled function and its arguments


def interleaved_seconds(calls: Sequence[Call], rounds: int, warmup: int = 3) -> list[float]:
    """The median time of each call over ``rounds`` rounds, each round timing every call once,
    after ``warmup`` calls of each (the first compiles; the next few still run slower).

    Interleaving spreads a shared machine's slow spells over every call alike, where timing
    one call many times and then the next would pin a spell on whichever ran during it."""
    for fn, args in calls:
        for _ in range(warmup):
            jax.block_until_ready(fn(*args))
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(rounds):
        for i, (fn, args) in enumerate(calls):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


# What a profile needs of one layer: (forward seconds, backward seconds, FLOPs, output) from
# its forward and backward functions and their arguments (params, model state, input).
LayerTimer = Callable[[Callable, Callable, tuple], tuple[float, float, float, Any]]


def profile_layers(
    model: nn.Module,
    example: Any,
    optimizer: Any,
    timer: LayerTimer,
    *,
    description: dict[str, Any],
    device: str,
    source: str,
    progress: Callable[[str], None] | None = None,
    boundaries: Sequence[int] | None = None,
) -> Profile:
    """A :class:`Profile` of every layer of ``model`` on ``example`` (one micro-batch of
    inputs, an array or a ``ShapeDtypeStruct``), timed by ``timer``; ``optimizer`` sizes the
    optimizer state, ``progress`` gets a line per layer. With ``boundaries`` (first layers)
    the entries are those spans, each run as one, as a pipeline's stages run."""
    if boundaries is None:
        modules = split_module(model, stages=model.num_layers)
    else:
        modules = split_module(model, boundaries=boundaries)
    init = lambda x: model.init(jax.random.key(0), x, train=False)  # noqa: E731
    abstract = isinstance(example, jax.ShapeDtypeStruct)
    variables = jax.eval_shape(init, example) if abstract else jax.jit(init)(example)
    params, states = split_variables(variables, modules, example)
    key = jax.random.key(0)
    layers, x = [], example
    for index, (apply, p, s) in enumerate(zip(flax_stages(modules), params, states, strict=True)):
        forward, backward = pass_functions(apply, key, first=index == 0)
        forward_s, backward_s, flops, y = timer(forward, backward, (p, s, x))
        layers.append(
            LayerCost(
                name=",".join(sorted(p)) or f"layer{index}",
                forward_s=forward_s,
                backward_s=backward_s,
                activation_bytes=_bytes(y),
                param_bytes=_bytes(p),
                optimizer_bytes=_bytes(jax.eval_shape(optimizer.init, p)),
                model_state_bytes=_bytes(s),
                flops=flops,
            )
        )
        if progress is not None:
            c = layers[-1]
            progress(
                f"layer {index:>3} {c.name[:40]:<40} forward {c.forward_s * 1e3:9.3f} ms  "
                f"backward {c.backward_s * 1e3:9.3f} ms"
            )
        x = y
    return Profile(description, int(example.shape[0]), device, source, tuple(layers))


def layer_calls(
    model: nn.Module,
    example: jax.Array,
    optimizer: Any,
    *,
    description: dict[str, Any],
    boundaries: Sequence[int] | None = None,
) -> tuple[Profile, list[Call]]:
    """A profile of ``model`` on ``example`` with every time 0, and the compiled forward and
    backward of each layer (or span, with ``boundaries``) with its arguments (entry i's are
    calls 2i and 2i + 1), to be timed by :func:`interleaved_seconds`, with other calls if need
    be."""
    device = jax.devices()[0]
    calls: list[Call] = []

    def collect(forward, backward, args):
        forward, backward = jax.jit(forward), jax.jit(backward)
        calls.extend([(forward, args), (backward, args)])
        return 0.0, 0.0, 0.0, forward(*args)

    profile = profile_layers(
        model,
        jax.device_put(example, device),
        optimizer,
        collect,
        description=description,
        device=device.device_kind,
        source="measured",
        boundaries=boundaries,
    )
    return profile, calls


def with_times(profile: Profile, seconds: Sequence[float]) -> Profile:
    """``profile`` with layer i's forward and backward times ``seconds[2i]``, ``[2i + 1]``."""
    layers = tuple(
        dataclasses.replace(layer, forward_s=seconds[2 * i], backward_s=seconds[2 * i + 1])
        for i, layer in enumerate(profile.layers)
    )
    return dataclasses.replace(profile, layers=layers)


def measure_profile(
    model: nn.Module,
    example: jax.Array,
    optimizer: Any,
    *,
    description: dict[str, Any],
    repeats: int = 11,
    progress: Callable[[str], None] | None = None,
) -> Profile:
    """Time every layer of ``model`` on ``example`` (one micro-batch of inputs) on this
    machine's first device, each layer's forward and backward compiled alone and timed in
    ``repeats`` interleaved rounds (:func:`interleaved_seconds`)."""
    profile, calls = layer_calls(model, example, optimizer, description=description)
    profile = with_times(profile, interleaved_seconds(calls, repeats))
    if progress is not None:
        for index, c in enumerate(profile.layers):
            progress(
                f"layer {index:>3} {c.name[:40]:<40} forward {c.forward_s * 1e3:9.3f} ms  "
                f"backward {c.backward_s * 1e3:9.3f} ms"
            )
    return profile

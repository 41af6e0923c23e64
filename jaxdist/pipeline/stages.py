"""A model as a list of stages, and the flat padded buffers stages share a program through.

A stage is a function ``apply(params, model_state, x, rng) -> (y, new_model_state)``. Stages
may differ in everything: a stem, blocks of different widths, a head. One SPMD program runs
them all, so whatever differs in shape crosses the program as one flat vector per stage,
padded to the largest stage's size (:class:`FlatPacking`): parameters, optimizer state, model
state, and the activations sent between stages.

For flax: :func:`cut` splits a list of layers into stages (equal counts, or at given
boundaries) to wrap in :class:`Chain`; :func:`split_module` cuts a network that can run spans
of its layers (ResNet) and :func:`split_variables` hands each stage its part of the whole
network's variables (:func:`variable_splitter` lets a pipeline step do it at init);
:func:`flax_stages` turns stage modules into stage functions and :func:`init_flax_stages`
initialises them one after the other on an example input.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from jaxdist.comm import collectives

__all__ = [
    "Chain",
    "StageFn",
    "cut",
    "flax_stages",
    "full_stage",
    "init_flax_stages",
    "spans",
    "split_module",
    "split_variables",
    "variable_splitter",
]

StageFn = Callable[[Any, Any, jax.Array, jax.Array], tuple[jax.Array, Any]]


def full_stage(fn: Callable) -> StageFn:
    """``fn`` as a :data:`StageFn`: a stateless ``(params, x) -> y`` (two positional
    parameters) gets the model state and rng it ignores; any other ``fn`` is one already."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a C function): take it as it is
        return fn
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) != 2 or any(p.kind == p.VAR_POSITIONAL for p in parameters):
        return fn

    def stage(params, model_state, x, rng):
        return fn(params, x), model_state

    return stage


class FlatPacking:
    """Pytrees of different structures, one per stage, as flat vectors of one length and dtype.

    ``flatten(tree)`` ravels a stage's tree and pads it with zeros to :attr:`size`;
    ``unflatten(i, flat)`` undoes it. The dtype is the promoted dtype of all leaves (float32
    for float32 parameters with an int32 step counter); leaves go back to their own dtypes.
    """

    def __init__(self, trees: Sequence[Any]):
        self.sizes: list[int] = []
        self._unravel: list[Callable] = []
        dtypes = []
        for tree in trees:
            zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), tree)
            flat, unravel = ravel_pytree(zeros)
            self.sizes.append(int(flat.size))
            self._unravel.append(unravel)
            dtypes.append(flat.dtype)
        self.size = max([*self.sizes, 1])  # a zero-length buffer would be a special case
        self.dtype = jnp.result_type(*dtypes) if dtypes else jnp.float32

    def flatten(self, tree: Any) -> jax.Array:
        return collectives.pack(jax.tree.leaves(tree), self.dtype, self.size)

    def unflatten(self, index: int, flat: jax.Array) -> Any:
        return self._unravel[index](flat[: self.sizes[index]])


@dataclass(frozen=True)
class ActivationPacking:
    """Shapes of the activations between stages, for one micro-batch: ``shapes[v]`` is what
    virtual stage v sends to v + 1. Messages are flat vectors of :attr:`size` elements."""

    shapes: tuple[jax.ShapeDtypeStruct, ...]

    @property
    def size(self) -> int:
        return max([1, *(int(np.prod(s.shape)) for s in self.shapes)])

    @property
    def dtype(self) -> Any:
        return jnp.result_type(*(s.dtype for s in self.shapes)) if self.shapes else jnp.float32

    def flatten(self, y: jax.Array) -> jax.Array:
        flat = y.reshape(-1).astype(self.dtype)
        return jnp.pad(flat, (0, self.size - flat.size))

    def unflatten(self, v: int, flat: jax.Array) -> jax.Array:
        shape = self.shapes[v]
        return flat[: int(np.prod(shape.shape))].reshape(shape.shape).astype(shape.dtype)


# --------------------------------------------------------------------------- flax layers


class Chain(nn.Module):
    """Layers applied one after the other, each called as ``layer(x, train=train)``."""

    layers: Sequence[nn.Module]

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
        for layer in self.layers:
            x = layer(x, train=train)
        return x


def spans(
    num_layers: int, stages: int | None = None, boundaries: Sequence[int] | None = None
) -> list[tuple[int, int]]:
    """``(start, stop)`` of each stage over ``num_layers`` layers: ``stages`` equal groups, or
    groups starting at each index of ``boundaries`` (which starts at 0, rises, and stays below
    ``num_layers``)."""
    n = num_layers
    if (stages is None) == (boundaries is None):
        raise ValueError("give exactly one of stages= (a count) or boundaries= (first layers)")
    if stages is not None:
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
            raise ValueError(f"stages must be a positive integer, got {stages!r}")
        if n % stages:
            raise ValueError(
                f"{n} layers do not divide into {stages} equal stages; pass boundaries= "
                f"(the first layer of each stage) to cut them unevenly"
            )
        boundaries = list(range(0, n, n // stages))
    bounds = [int(b) for b in boundaries]
    if (
        not bounds
        or bounds[0] != 0
        or any(b >= c for b, c in itertools.pairwise(bounds))
        or bounds[-1] >= n
    ):
        raise ValueError(
            f"boundaries must start at 0, rise strictly and stay below the {n} layers, so that "
            f"every stage gets at least one layer; got {bounds}"
        )
    return list(zip(bounds, [*bounds[1:], n]))


def cut(
    layers: Sequence[Any], stages: int | None = None, boundaries: Sequence[int] | None = None
) -> list[list[Any]]:
    """``layers`` split into groups, as :func:`spans` says."""
    return [list(layers[a:b]) for a, b in spans(len(layers), stages, boundaries)]


def split_module(
    module: nn.Module, stages: int | None = None, boundaries: Sequence[int] | None = None
) -> list[nn.Module]:
    """Stage modules of a network that runs spans of its layers (a ``layers=(start, stop)``
    field and a ``num_layers`` property, as :class:`jaxdist.models.resnet.ResNet` has)."""
    return [module.clone(layers=span) for span in spans(module.num_layers, stages, boundaries)]


def split_variables(
    variables: Mapping[str, Any], modules: Sequence[nn.Module], example_input: jax.Array
) -> tuple[list[Any], list[Any]]:
    """A whole network's variables as ``(params, model_state)`` per stage of
    :func:`split_module`: each stage gets the subtrees its module's variables are named by, so
    a pipeline starts from the same initialisation as the whole network."""
    params, states = [], []
    x = jax.ShapeDtypeStruct(example_input.shape, example_input.dtype)
    for module in modules:
        shapes = jax.eval_shape(lambda x, m=module: m.init(jax.random.key(0), x, train=False), x)
        own = {
            collection: {name: variables[collection][name] for name in tree}
            for collection, tree in shapes.items()
        }
        params.append(own.pop("params", {}))
        states.append(own)
        x = jax.eval_shape(lambda v, x, m=module: m.apply(v, x, train=False), shapes, x)
    return params, states


def variable_splitter(
    modules: Sequence[nn.Module], example_input: jax.Array
) -> Callable[[Any, Any], tuple[list[Any], list[Any]]]:
    """``split`` for :class:`~jaxdist.pipeline.step.PipelineStep`: the whole network's
    ``(params, model_state)`` to each stage's part, as :func:`split_variables` hands them."""

    def split(params: Any, model_state: Any) -> tuple[list[Any], list[Any]]:
        return split_variables({"params": params, **model_state}, modules, example_input)

    return split


def flax_stages(modules: Sequence[nn.Module]) -> list[StageFn]:
    """Stage functions of flax modules called as ``module(x, train=True)``, with their
    model state (BatchNorm statistics) as mutable collections and ``rng`` as ``dropout``."""

    def stage(module: nn.Module) -> StageFn:
        def apply(params, model_state, x, rng):
            y, new_state = module.apply(
                {"params": params, **model_state},
                x,
                train=True,
                mutable=list(model_state),
                rngs={"dropout": rng},
            )
            return y, dict(new_state)

        return apply

    return [stage(m) for m in modules]


def init_flax_stages(
    modules: Sequence[nn.Module], rng: jax.Array, example_input: jax.Array
) -> tuple[list[Any], list[Any]]:
    """``(params, model_state)`` per stage: each module is initialised on the previous one's
    output for ``example_input``."""

    # One compiled program rather than one per op, as jaxdist.models.init_variables does.
    @jax.jit
    def init_all(rng, example_input):
        params, states = [], []
        x = example_input
        for index, module in enumerate(modules):
            variables = dict(module.init(jax.random.fold_in(rng, index), x, train=False))
            params.append(variables.pop("params", {}))
            states.append(variables)
            x = module.apply({"params": params[-1], **variables}, x, train=False)
        return params, states

    return init_all(rng, example_input)

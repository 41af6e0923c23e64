"""A flax NNX module as the pure functions a train step takes.

A step's state is plain pytrees: parameters, model state (BatchNorm statistics and the like),
optimizer state. :class:`NnxModel` splits an ``nnx.Module`` once into its graph definition and
those trees, as nested dicts of arrays (``nnx.to_pure_dict``), so that every step (every
allreduce, accumulation, ZeRO-1, mixed precision, the pipeline), checkpoints and resumes see
the same kind of trees as for a linen model::

    model = NnxModel(Transformer(config, rngs=nnx.Rngs(0)))
    params, model_state = model.variables()

    def loss_fn(params, model_state, batch, rng):
        logits, model_state = model.apply(params, model_state, batch["x"], rng=rng)
        return cross_entropy(logits, batch["y"]), (model_state, {})

Inside the step the module is rebuilt from the trees (``nnx.merge`` on values of the current
trace, so it may update its state) and split again after the call: what changed in it is
the new model state. Randomness comes from the step's ``rng``: every RNG stream of the module
(``nnx.Rngs`` held by ``nnx.Dropout`` and the like) is re-seeded from it at each call, so a
resumed run draws what an uninterrupted one would, and no key-typed arrays sit in the state.

Train the module with an optax transformation given to the step, not an ``nnx.Optimizer``:
the step keeps the optimizer state itself. :meth:`NnxModel.module` gives back an
``nnx.Module`` holding trained values, to evaluate or export with NNX code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

__all__ = ["NnxModel"]

# Split order: trained parameters, RNG streams (re-seeded per call), everything else.
_FILTERS = (nnx.Param, nnx.RngState, ...)


def _fresh(template: nnx.State, values: Any) -> nnx.State:
    """A new state shaped like ``template`` holding ``values`` (a pure dict)."""
    state = jax.tree.map(lambda leaf: leaf, template)
    nnx.replace_by_pure_dict(state, values)
    return state


def _reseeded(rng_state: nnx.State, rng: jax.Array | None) -> nnx.State:
    """``rng_state`` with each stream's key folded from ``rng`` (default: key 0) by its
    position in the state, and its count at zero."""
    if rng is None:
        rng = jax.random.key(0)
    if not jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
        rng = jax.random.wrap_key_data(rng)
    leaves, treedef = jax.tree.flatten(nnx.to_pure_dict(rng_state))
    fresh = []
    for index, leaf in enumerate(leaves):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            key = jax.random.fold_in(rng, index)
            # A stream of stacked layers (nnx.vmap) holds one key per layer.
            fresh.append(jax.random.split(key, leaf.shape) if leaf.shape else key)
        else:
            fresh.append(jax.numpy.zeros_like(leaf))
    return _fresh(rng_state, jax.tree.unflatten(treedef, fresh))


class NnxModel:
    """An ``nnx.Module`` split into a graph definition and plain trees (see the module
    docstring). The module is not kept: its values live in the trees the step carries."""

    def __init__(self, module: nnx.Module) -> None:
        """``module`` may be abstract (``nnx.eval_shape``): only its structure is kept."""
        if not isinstance(module, nnx.Module):
            raise TypeError(f"NnxModel wraps an nnx.Module, got {type(module).__name__}")
        self.graphdef, params, rngs, rest = nnx.split(module, *_FILTERS)
        self._params, self._rngs, self._rest = params, rngs, rest

    def variables(self) -> tuple[dict, dict]:
        """``(params, model_state)`` as nested dicts of arrays: the module's ``nnx.Param``
        values, and every other variable but its RNG streams."""
        return nnx.to_pure_dict(self._params), nnx.to_pure_dict(self._rest)

    def logical_axes(self) -> dict:
        """A tree like :meth:`variables`' params: per parameter, the names of its dimensions
        from flax's partitioning metadata (``nnx.with_partitioning``), None per unnamed
        dimension."""

        def names(variable: nnx.Variable) -> tuple[str | None, ...]:
            named = variable.get_metadata().get("out_sharding")
            return tuple(named) if named else (None,) * len(variable.shape)

        named = jax.tree.map(names, self._params, is_leaf=lambda x: isinstance(x, nnx.Variable))
        return nnx.to_pure_dict(named) if isinstance(named, nnx.State) else named

    def module(self, params: Any, model_state: Any, rng: jax.Array | None = None) -> nnx.Module:
        """The module holding ``params`` and ``model_state``; its RNG streams seeded from
        ``rng`` (default: key 0)."""
        return nnx.merge(
            self.graphdef,
            _fresh(self._params, params),
            _reseeded(self._rngs, rng),
            _fresh(self._rest, model_state),
        )

    def apply(
        self,
        params: Any,
        model_state: Any,
        *args: Any,
        rng: jax.Array | None = None,
        train: bool = True,
        method: Callable[..., Any] | None = None,
        **kwargs: Any,
    ) -> tuple[Any, dict]:
        """``(output, new_model_state)`` of calling the module (or ``method(module, *args)``)
        in train mode (dropout on, batch statistics updated) or, with ``train=False``, eval
        mode."""
        module = self.module(params, model_state, rng)
        module.train() if train else module.eval()
        out = module(*args, **kwargs) if method is None else method(module, *args, **kwargs)
        _, _, _, rest = nnx.split(module, *_FILTERS)
        return out, nnx.to_pure_dict(rest)

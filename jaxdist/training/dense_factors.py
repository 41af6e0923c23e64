"""Dense layers whose weight gradient leaves the backward pass as its sufficient factors.

A flax ``nn.Dense`` computes ``y = x @ kernel + bias``; over the rows of ``x`` its kernel's
gradient is ``x^T dL/dy``. The train step gets ``x`` and ``dL/dy`` without any change to the
model or the loss function: while it differentiates, a flax method interceptor
(``nn.intercept_methods``) taps each chosen layer's call, keeps its input and adds a zero
*probe* to its output. The gradient of the loss with respect to the probe is ``dL/dy``, and the
kernel enters the loss through ``stop_gradient``, so backward never forms the ``m x n``
gradient at all. :mod:`jaxdist.comm.sufficient_factors` then rebuilds the mean over every
device from the gathered factors.

What this needs from a loss function: it applies a flax linen model with the parameters it was
given as the ``params`` collection (as :func:`jaxdist.training.train_step.classifier_loss`
does), and each tapped layer runs once per call, outside ``nn.scan``/``nn.remat``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
    "DenseLayer",
    "find_dense_layers",
]


@dataclass(frozen=True)
class DenseLayer:
    """A dense layer seen in one trace of the loss: its module ``path`` (``"head"``,
    ``"block/Dense_0"``), where its kernel sits in the parameters, its sizes, the rows one call
    sees on one device (one micro-batch), and its output's shape and dtype."""

    path: str
    kernel_path: tuple[str, ...]
    in_features: int
    out_features: int
    rows: int
    output_shape: tuple[int, ...]
    output_dtype: Any
    itemsize: int

    @property
    def kernel_bytes(self) -> int:
        return self.in_features * self.out_features * self.itemsize

    def factor_bytes(self, rows: int, itemsize: int = 4) -> int:
        """Bytes of ``rows`` rows of factors (input and output gradient) at ``itemsize``."""
        return rows * (self.in_features + self.out_features) * itemsize

    @property
    def shape_text(self) -> str:
        return f"{self.in_features}x{self.out_features}"


@dataclass(frozen=True)
class _Seen:
    """What one trace saw: every module called (path -> class name), how often each dense
    layer ran, the dense layers found with a kernel in the parameters, and the traced loss
    (a jaxpr whose first inputs are the parameter leaves)."""

    modules: dict[str, str]
    calls: dict[str, int]
    dense: dict[str, DenseLayer]
    jaxpr: Any = None


def key_names(key_path) -> tuple[str, ...]:
    """A pytree key path as plain names: ``("head", "kernel")``, as a layer's kernel is found."""
    return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in key_path)


def _kernel_at(params: Any, keys: tuple[str, ...]) -> Any:
    node = params
    for key in keys:
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    return node


def find_dense_layers(
    loss_fn: Callable,
    params: Any,
    model_state: Any,
    batch: Any,
    rng: Any,
    axis_env: Sequence[tuple[str, int]] = (),
) -> _Seen:
    """Trace ``loss_fn(params, model_state, batch, rng)`` abstractly (nothing runs) and record
    every flax module it calls and each ``nn.Dense`` whose kernel is in ``params``."""
    modules: dict[str, str] = {}
    calls: dict[str, int] = {}
    dense: dict[str, DenseLayer] = {}

    def record(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        module = context.module
        if context.method_name != "__call__" or not module.path:
            return out
        path = "/".join(module.path)
        modules.setdefault(path, type(module).__name__)
        if isinstance(module, nn.Dense):
            calls[path] = calls.get(path, 0) + 1
            x = args[0] if args else kwargs["inputs"]
            keys = (*module.path, "kernel")
            kernel = _kernel_at(params, keys)
            if kernel is not None and getattr(kernel, "ndim", 0) == 2:
                dense[path] = DenseLayer(
                    path=path,
                    kernel_path=keys,
                    in_features=int(kernel.shape[0]),
                    out_features=int(kernel.shape[1]),
                    rows=math.prod(x.shape[:-1]),
                    output_shape=tuple(out.shape),
                    output_dtype=out.dtype,
                    itemsize=jnp.dtype(kernel.dtype).itemsize,
                )
        return out

    def fresh(*args):  # a new function each time: a cached trace would record nothing
        return loss_fn(*args)

    with nn.intercept_methods(record):
        closed = jax.make_jaxpr(fresh, axis_env=list(axis_env))(params, model_state, batch, rng)
    return _Seen(modules, calls, dense, closed.jaxpr)


def select_dense_layers(seen: _Seen, requested: str | Sequence[str] | None) -> list[DenseLayer]:
    """The layers ``requested`` names (``"all"``: every dense layer that runs once), checked:
    each must be a module of the model, a dense one, with its kernel in the parameters, run
    once per call."""
    once = [layer for path, layer in seen.dense.items() if seen.calls.get(path) == 1]
    if requested is None or requested == "all":
        return once
    if isinstance(requested, str):
        requested = [requested]
    dense_names = ", ".join(seen.dense) or "none"
    chosen = []
    for name in requested:
        path = name.strip("/")
        kind = seen.modules.get(path)
        if kind is None:
            raise ValueError(
                f"sfb_layers: the model has no module {name!r}; its dense layers are: {dense_names}"
            )
        if path not in seen.calls:
            raise ValueError(
                f"sfb_layers: {name!r} is a {kind}, not a dense layer: sufficient "
                f"factors need an nn.Dense (x @ kernel); dense layers: {dense_names}"
            )
        if path not in seen.dense:
            raise ValueError(
                f"sfb_layers: the dense layer {name!r} has no 2-D kernel at "
                f"params[{'/'.join((*path.split('/'), 'kernel'))}]; the loss must "
                f"pass its params as the model's 'params' collection"
            )
        if seen.calls[path] != 1:
            raise ValueError(
                f"sfb_layers: {name!r} runs {seen.calls[path]} times per step; "
                f"sufficient factors need a layer that runs once"
            )
        chosen.append(seen.dense[path])
    return chosen


class FactorTap:
    """Taps ``layers`` while the loss is differentiated; see the module docstring."""

    def __init__(self, layers: Sequence[DenseLayer]):
        self.layers = {layer.path: layer for layer in layers}

    def zero_probes(self) -> dict[str, jax.Array]:
        """One zero array per layer, shaped like its output: the loss's gradient with respect
        to it is the layer's output gradient."""
        return {
            path: jnp.zeros(layer.output_shape, layer.output_dtype)
            for path, layer in self.layers.items()
        }

    def stop_kernel_gradients(self, params: Any) -> Any:
        """``params`` with the tapped kernels behind ``stop_gradient``: backward builds no
        dense gradient for them."""
        kernels = {layer.kernel_path for layer in self.layers.values()}
        return jax.tree_util.tree_map_with_path(
            lambda key_path, leaf: (
                lax.stop_gradient(leaf) if key_names(key_path) in kernels else leaf
            ),
            params,
        )

    @contextlib.contextmanager
    def tapped(self, probes: Mapping[str, jax.Array]) -> Iterator[dict[str, jax.Array]]:
        """While active, each tapped layer's output gets its probe added and its input is put
        in the yielded dict."""
        inputs: dict[str, jax.Array] = {}

        def tap(next_fun, args, kwargs, context):
            module = context.module
            if context.method_name != "__call__" or not isinstance(module, nn.Dense):
                return next_fun(*args, **kwargs)
            path = "/".join(module.path)
            if path not in self.layers:
                return next_fun(*args, **kwargs)
            inputs[path] = args[0] if args else kwargs["inputs"]
            return next_fun(*args, **kwargs) + probes[path]

        with nn.intercept_methods(tap):
            yield inputs

    def factors(
        self, inputs: Mapping[str, jax.Array], output_grads: Mapping[str, jax.Array]
    ) -> dict[str, tuple[jax.Array, jax.Array]]:
        """Per layer ``(x, dL/dy)`` as matrices of ``rows x in_features`` and
        ``rows x out_features``."""
        missing = sorted(set(self.layers) - set(inputs))
        if missing:
            raise ValueError(
                f"sufficient factors: dense layers {missing} did not run in this trace of the loss"
            )
        return {
            path: (
                inputs[path].reshape(-1, layer.in_features),
                output_grads[path].reshape(-1, layer.out_features),
            )
            for path, layer in self.layers.items()
        }

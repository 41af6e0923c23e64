"""ResNet v1.5 in flax linen, as used by the MLPerf and "ImageNet in minutes" results.

v1.5 differs from the original ResNet v1 (He et al. 2015) in one place: a bottleneck block that
downsamples does so in its 3x3 convolution (stride 2) rather than in its first 1x1 convolution,
so no activation is thrown away before it is looked at. Basic blocks (ResNet-18/34) are the
same in both versions.

Design choices:

* **linen, functional.** The train step calls
  ``model.apply(variables, x, train=True, mutable=["batch_stats"])`` and gets the new running
  statistics back as a value; nothing is hidden in module state.
* **Pluggable normalisation.** ``norm`` is a module factory, called with
  ``use_running_average=not train`` (plus ``dtype``, ``param_dtype``, ``name`` and, for the last
  norm of a block, ``scale_init``). Cross-replica BatchNorm is therefore a matter of building
  the model with ``norm=functools.partial(nn.BatchNorm, momentum=0.9, epsilon=1e-5,
  axis_name="data")`` inside ``jax.shard_map``; the model itself knows nothing of meshes.
* **Zero-initialised residual branches** (Goyal et al. 2017): with the scale of each block's
  last norm at 0 every block starts as the identity, which keeps the first steps of a very
  large-batch run stable.
* **Padding like the reference implementations.** Strided convolutions pad symmetrically
  (``(k-1)//2`` on each side) as torchvision and the MLPerf TensorFlow reference do, rather
  than XLA's ``SAME`` (which pads more on the bottom/right for even inputs).
* **1x1 convolutions as matrix products** (``pointwise_matmul``, on by default). A 1x1
  convolution is a matrix product over the channel axis; written as one (:class:`PointwiseConv`,
  same ``kernel`` parameter of shape ``(1, 1, in, out)``, same function) XLA:CPU runs them
  several times faster forward + backward than as convolutions (``benchmarks/conv1x1.py``
  times every 1x1 layer of ResNet-50 both ways). Two of the three convolutions of every
  bottleneck block are 1x1. On GPU/TPU both forms should become the same GEMM; set
  ``pointwise_matmul=False`` to compare.
* **Mixed precision.** ``dtype`` is the compute dtype (``jnp.bfloat16`` on accelerators);
  parameters stay in ``param_dtype`` (float32) and the logits come out in ``dtype``, so the
  loss should upcast them (:func:`jaxdist.training.optim.smoothed_cross_entropy` does).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
    "BasicBlock",
    "BottleneckBlock",
    "PointwiseConv",
    "ResNet",
]

Dtype = Any
ModuleFactory = Callable[..., nn.Module]

STEMS = ("imagenet", "small")
BLOCKS = ("basic", "bottleneck")

# He initialisation scaled by fan-out, as torchvision and the MLPerf reference initialise
# convolutions followed by ReLU.
conv_kernel_init = nn.initializers.variance_scaling(2.0, "fan_out", "normal")

default_norm: ModuleFactory = functools.partial(nn.BatchNorm, momentum=0.9, epsilon=1e-5)


def _symmetric_padding(kernel_size: int) -> tuple[tuple[int, int], tuple[int, int]]:
    pad = (kernel_size - 1) // 2
    return ((pad, pad), (pad, pad))


class PointwiseConv(nn.Module):
    """A bias-free 1x1 convolution (``VALID``, the same stride along height and width)
    computed as a matrix product over the channel axis.

    Same parameter as ``nn.Conv(features, (1, 1), strides, "VALID", use_bias=False)``
    (``kernel``, shape ``(1, 1, in, features)``) and the same function: a strided 1x1
    convolution reads every ``strides``-th pixel, then mixes channels.

    Attributes:
      features: output channels.
      strides: stride along height and width (a positive int).
      dtype: compute dtype; ``None`` promotes the input and kernel dtypes, as ``nn.Conv``.
      param_dtype: storage dtype of ``kernel``.
      precision: matmul precision, as ``nn.Conv``'s ``precision``.
      kernel_init: initialiser of ``kernel``; the ResNet's He fan-out by default (``nn.Conv``
        defaults to LeCun normal, so pass ``kernel_init`` to match a plain ``nn.Conv``).
    """

    features: int
    strides: int = 1
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    precision: Any = None
    kernel_init: Callable = conv_kernel_init

    @nn.compact
    def __call__(self, x_BxHxWxC: jax.Array) -> jax.Array:
        if not isinstance(self.strides, int) or self.strides < 1:
            raise ValueError(
                f"PointwiseConv strides must be a positive int (the same along height and "
                f"width), got {self.strides!r}"
            )
        channels = x_BxHxWxC.shape[-1]
        kernel = self.param(
            "kernel", self.kernel_init, (1, 1, channels, self.features), self.param_dtype
        )
        x, kernel = nn.dtypes.promote_dtype(x_BxHxWxC, kernel, dtype=self.dtype)
        if self.strides != 1:
            # The barrier keeps the strided pixels a buffer of their own: fused through the
            # reshape below into its matrix-product kernel, the slice made XLA's GPU compiler
            # (jaxlib 0.10.2) abort. On CPU it costs one copy of the (smaller) sliced input.
            x = lax.optimization_barrier(x[:, :: self.strides, :: self.strides, :])
        batch, height, width, _ = x.shape
        y = jnp.matmul(
            x.reshape(batch * height * width, channels),
            kernel.reshape(channels, self.features),
            precision=self.precision,
        )
        return y.reshape(batch, height, width, self.features)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions (ResNet-18/34); the first one downsamples when ``strides`` is 2.

    ``conv`` builds the 3x3 convolutions (``conv(features, kernel_size, strides, padding,
    name=)``), ``pointwise`` the 1x1 projection shortcut (``pointwise(features, strides,
    name=)``: :class:`PointwiseConv` or an ``nn.Conv`` wrapper, see :class:`ResNet`).
    """

    filters: int
    strides: int
    conv: ModuleFactory
    pointwise: ModuleFactory
    norm: ModuleFactory
    last_norm_scale_init: Callable

    @nn.compact
    def __call__(self, x_BxHxWxC: jax.Array) -> jax.Array:
        y = self.conv(self.filters, (3, 3), self.strides, _symmetric_padding(3), name="conv1")(
            x_BxHxWxC
        )
        y = nn.relu(self.norm(name="norm1")(y))
        y = self.conv(self.filters, (3, 3), 1, _symmetric_padding(3), name="conv2")(y)
        y = self.norm(scale_init=self.last_norm_scale_init, name="norm2")(y)
        shortcut = _shortcut(x_BxHxWxC, y.shape[-1], self.strides, self.pointwise, self.norm)
        return nn.relu(shortcut + y)


class BottleneckBlock(nn.Module):
    """1x1 reduce, 3x3 (strided in v1.5), 1x1 expand by 4 (ResNet-50/101/152).

    ``conv`` builds the 3x3 convolution, ``pointwise`` the 1x1 ones and the projection
    shortcut (same factory signatures as :class:`BasicBlock`).
    """

    filters: int
    strides: int
    conv: ModuleFactory
    pointwise: ModuleFactory
    norm: ModuleFactory
    last_norm_scale_init: Callable

    expansion = 4

    @nn.compact
    def __call__(self, x_BxHxWxC: jax.Array) -> jax.Array:
        y = self.pointwise(self.filters, 1, name="conv1")(x_BxHxWxC)
        y = nn.relu(self.norm(name="norm1")(y))
        y = self.conv(self.filters, (3, 3), self.strides, _symmetric_padding(3), name="conv2")(y)
        y = nn.relu(self.norm(name="norm2")(y))
        y = self.pointwise(self.filters * self.expansion, 1, name="conv3")(y)
        y = self.norm(scale_init=self.last_norm_scale_init, name="norm3")(y)
        shortcut = _shortcut(x_BxHxWxC, y.shape[-1], self.strides, self.pointwise, self.norm)
        return nn.relu(shortcut + y)


def _shortcut(
    x: jax.Array, features: int, strides: int, pointwise: ModuleFactory, norm: ModuleFactory
) -> jax.Array:
    """Identity when shapes match, else a projection (strided 1x1 conv + norm), as in v1.5."""
    if x.shape[-1] == features and strides == 1:
        return x
    x = pointwise(features, strides, name="shortcut_conv")(x)
    return norm(name="shortcut_norm")(x)


_BLOCK_CLASSES: dict[str, type[nn.Module]] = {"basic": BasicBlock, "bottleneck": BottleneckBlock}


class ResNet(nn.Module):
    """ResNet v1.5. Input ``(batch, height, width, channels)``, output logits ``(batch, classes)``.

    Attributes:
      stage_sizes: number of residual blocks in each stage, e.g. ``(3, 4, 6, 3)``.
      block: ``"basic"`` (two 3x3 convs) or ``"bottleneck"`` (1x1-3x3-1x1, 4x expansion).
      num_classes: size of the classifier output.
      width: filters of the first stage (64 in the paper); stage ``i`` has ``width * 2**i``.
        Small widths give tiny models for CPU tests.
      stem: ``"imagenet"`` (7x7 stride-2 conv + 3x3 stride-2 max-pool, for 224x224 inputs) or
        ``"small"`` (3x3 stride-1 conv, no pooling, for 28x28 / 32x32 inputs).
      zero_init_last_bn_scale: start each block's last norm scale at 0 (Goyal et al.).
      dtype: compute dtype of convolutions, norms and the classifier.
      param_dtype: dtype the parameters are stored in.
      norm: factory of the normalisation layer; see the module docstring.
      pointwise_matmul: compute 1x1 convolutions as matrix products (:class:`PointwiseConv`);
        ``False`` uses ``nn.Conv``. Same parameters and function either way.
      layers: ``(start, stop)``: run only layers ``start`` to ``stop - 1`` of the network's
        :attr:`num_layers` (the stem, each residual block, the pooled classifier), taking and
        returning the activations between them. A pipeline stage is such a span; its
        parameters are the same subtrees, by the same names, as in the whole network.
    """

    stage_sizes: Sequence[int]
    block: str = "bottleneck"
    num_classes: int = 1000
    width: int = 64
    stem: str = "imagenet"
    zero_init_last_bn_scale: bool = True
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    norm: ModuleFactory = default_norm
    pointwise_matmul: bool = True
    layers: tuple[int, int] | None = None

    @property
    def num_layers(self) -> int:
        """The stem, every residual block and the classifier: the units a span counts."""
        return 2 + sum(int(n) for n in self.stage_sizes)

    def __post_init__(self) -> None:
        if self.stem not in STEMS:
            raise ValueError(f"ResNet stem must be one of {STEMS}, got {self.stem!r}")
        if self.block not in BLOCKS:
            raise ValueError(f"ResNet block must be one of {BLOCKS}, got {self.block!r}")
        if not self.stage_sizes or any(int(n) < 1 for n in self.stage_sizes):
            raise ValueError(
                f"ResNet stage_sizes must be a non-empty sequence of positive block counts, "
                f"got {tuple(self.stage_sizes)!r}"
            )
        for field in ("num_classes", "width"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ResNet {field} must be a positive integer, got {value!r}")
        if self.layers is not None:
            start, stop = self.layers
            if not 0 <= start < stop <= self.num_layers:
                raise ValueError(
                    f"ResNet layers must be a span (start, stop) with 0 <= start < stop <= "
                    f"{self.num_layers}, got {tuple(self.layers)!r}"
                )
        super().__post_init__()

    def _layer_factories(self, train: bool) -> tuple[Callable, Callable, Callable, Callable]:
        """``(conv, pointwise, norm, last_norm_scale_init)``: how each layer of the network
        is made, in the model's dtypes (the blocks call them)."""
        conv = functools.partial(
            nn.Conv,
            use_bias=False,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=conv_kernel_init,
        )
        if self.pointwise_matmul:
            pointwise = functools.partial(
                PointwiseConv,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                kernel_init=conv_kernel_init,
            )
        else:

            def pointwise(features: int, strides: int, name: str) -> nn.Module:
                return conv(features, (1, 1), strides, "VALID", name=name)

        norm = functools.partial(
            self.norm,
            use_running_average=not train,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )
        last_norm_scale_init = (
            nn.initializers.zeros if self.zero_init_last_bn_scale else nn.initializers.ones
        )

        return conv, pointwise, norm, last_norm_scale_init

    @nn.compact
    def __call__(self, x_BxHxWxC: jax.Array, *, train: bool) -> jax.Array:
        start, stop = self.layers or (0, self.num_layers)
        runs = lambda layer: start <= layer < stop  # noqa: E731
        if start == 0 and x_BxHxWxC.ndim != 4:
            raise ValueError(
                f"ResNet expects images shaped (batch, height, width, channels), "
                f"got shape {x_BxHxWxC.shape}"
            )
        conv, pointwise, norm, last_norm_scale_init = self._layer_factories(train)
        x = x_BxHxWxC.astype(self.dtype) if start == 0 else x_BxHxWxC
        if runs(0) and self.stem == "imagenet":
            x = conv(self.width, (7, 7), 2, _symmetric_padding(7), name="stem_conv")(x)
            x = nn.relu(norm(name="stem_norm")(x))
            x = nn.max_pool(x, (3, 3), strides=(2, 2), padding=_symmetric_padding(3))
        elif runs(0):
            x = conv(self.width, (3, 3), 1, _symmetric_padding(3), name="stem_conv")(x)
            x = nn.relu(norm(name="stem_norm")(x))

        block_cls = _BLOCK_CLASSES[self.block]
        layer = 0
        for stage, num_blocks in enumerate(self.stage_sizes):
            for index in range(num_blocks):
                layer += 1
                if not runs(layer):
                    continue
                # The first block of every stage but the first halves the resolution.
                strides = 2 if stage > 0 and index == 0 else 1
                x = block_cls(
                    filters=self.width * 2**stage,
                    strides=strides,
                    conv=conv,
                    pointwise=pointwise,
                    norm=norm,
                    last_norm_scale_init=last_norm_scale_init,
                    name=f"stage{stage + 1}_block{index + 1}",
                )(x)

        if not runs(layer + 1):
            return x
        features_BxF = jnp.mean(x, axis=(1, 2))
        return nn.Dense(
            self.num_classes, dtype=self.dtype, param_dtype=self.param_dtype, name="head"
        )(features_BxF)


# Blocks per stage, from He et al. 2015, Table 1; ResNet-10, one basic block per stage, is not
# in the paper: the smallest of the family, for quick trials (its programs compile in about
# two thirds of ResNet-18's time).
ARCHITECTURES: dict[str, tuple[str, tuple[int, ...]]] = {
    "resnet10": ("basic", (1, 1, 1, 1)),
    "resnet18": ("basic", (2, 2, 2, 2)),
    "resnet34": ("basic", (3, 4, 6, 3)),
    "resnet50": ("bottleneck", (3, 4, 6, 3)),
    "resnet101": ("bottleneck", (3, 4, 23, 3)),
    "resnet152": ("bottleneck", (3, 8, 36, 3)),
}


def _factory(name: str) -> Callable[..., ResNet]:
    block, stage_sizes = ARCHITECTURES[name]

    def make(**kwargs: Any) -> ResNet:
        return ResNet(stage_sizes=stage_sizes, block=block, **kwargs)

    make.__name__ = name
    make.__qualname__ = name
    make.__doc__ = (
        f"{name.replace('resnet', 'ResNet-')} v1.5 ({block} blocks {stage_sizes}); keyword "
        f"arguments are :class:`ResNet` fields (num_classes, width, stem, dtype, norm, ...)."
    )
    return make


resnet10 = _factory("resnet10")
resnet18 = _factory("resnet18")
resnet34 = _factory("resnet34")
resnet50 = _factory("resnet50")
resnet101 = _factory("resnet101")
resnet152 = _factory("resnet152")

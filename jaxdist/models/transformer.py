"""A decoder-only transformer in flax NNX: token and position embeddings, pre-norm blocks of
causal self-attention and an MLP, a final norm and a linear head over the vocabulary.

::

    model = Transformer(vocab_size=256, max_len=128, num_layers=2, d_model=128, num_heads=4,
                        rngs=nnx.Rngs(0))
    logits = model(tokens)                    # [batch, length] int -> [batch, length, vocab]

``remat`` chooses what each block keeps for the backward pass (activation checkpointing,
``nnx.remat``): ``"none"`` keeps every activation; ``"full"`` only the block's input, running
its forward again in backward (the activations a step holds fall from every block's to one
block's, for about a quarter more compute); ``"dots"`` the outputs of its matrix products
(``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``), recomputing the cheap
element-wise work between them.

With ``scan_layers=True`` the blocks are one module whose parameters carry a leading layer
axis (``blocks.attention.query.kernel`` is ``[num_layers, d_model, heads, head_dim]``), made
with ``nnx.vmap`` and run with ``nnx.scan``: the compiled program holds one block whatever
the depth, so compile time and code size stay flat as the model deepens.
:func:`stack_blocks` and :func:`unstack_blocks` turn one layout's parameters into the
other's (the same model either way).

Unscanned, layers are kept as a list (``blocks``), so spans of them can run on their own
(:class:`TransformerSpan`, :meth:`Transformer.span`): the embedding is layer 0, block ``i``
layer ``i + 1`` and the final norm with the head the last layer, the convention the
pipeline's stage cuts use.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jaxdist.comm import vocab_parallel
from jaxdist.comm.tensor_parallel import (
    column_product,
    from_sequence_shard,
    row_product,
    sequence_parallel,
    shared,
    to_sequence_shard,
    vocabulary_axis,
)

__all__ = [
    "REMAT_POLICIES",
    "TENSOR_PARALLEL",
    "VOCABULARY",
    "Block",
    "BlockShape",
    "Transformer",
    "TransformerSpan",
    "stack_blocks",
    "unstack_blocks",
]

# What a block keeps for backward, by name: None keeps everything (no remat).
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def remat_policy_name(remat: bool | str) -> str:
    """``remat`` as one of :data:`REMAT_POLICIES`' names (``True``/``False``: full/none)."""
    if isinstance(remat, bool):
        return "full" if remat else "none"
    if remat not in REMAT_POLICIES:
        raise ValueError(f"model.remat must be one of {', '.join(REMAT_POLICIES)}; got {remat!r}")
    return remat


@dataclass(frozen=True)
class BlockShape:
    """What a block is made of, beside its width ``d_model``.

    Attributes:
      num_heads: query heads.
      head_dim: each head's width (None: ``d_model // num_heads``); the attention's width is
        ``num_heads * head_dim``, which need not be ``d_model``.
      num_kv_heads: key and value heads (None: ``num_heads``); fewer is grouped-query
        attention, each shared by ``num_heads // num_kv_heads`` query heads.
      mlp_dim: the MLP's hidden width (None: ``mlp_ratio * d_model``).
      mlp_ratio: the hidden width over ``d_model`` when ``mlp_dim`` is None.
      mlp: ``"gelu"`` (up, GELU, down) or ``"swiglu"`` (``down(silu(gate(x)) * up(x))``).
      norm: ``"layernorm"`` or ``"rmsnorm"``.
      rotary: rotary position embeddings on queries and keys (the model then learns no
        position embedding).
      attention_chunk: queries per block of attention (0: all at once). Blocked, a block's
        scores exist only while it runs and are computed again in backward, so a step holds
        ``attention_chunk`` rows of the ``length x length`` scores instead of all of them,
        for one more pass over them; the same values either way.
    """

    num_heads: int
    head_dim: int | None = None
    num_kv_heads: int | None = None
    mlp_dim: int | None = None
    mlp_ratio: int = 4
    mlp: str = "gelu"
    norm: str = "layernorm"
    rotary: bool = False
    attention_chunk: int = 0

    def check(self, d_model: int) -> None:
        """One line naming the setting that cannot build a block of width ``d_model``."""
        if self.mlp not in MLPS:
            raise ValueError(f"model.mlp must be one of {', '.join(MLPS)}; got {self.mlp!r}")
        if self.norm not in NORMS:
            raise ValueError(f"model.norm must be one of {', '.join(NORMS)}; got {self.norm!r}")
        if self.head_dim is None and d_model % self.num_heads:
            raise ValueError(
                f"model.d_model={d_model} must divide by model.num_heads="
                f"{self.num_heads}, or give model.head_dim"
            )
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"model.num_heads={self.num_heads} must divide by "
                f"model.num_kv_heads={self.kv_heads}"
            )
        if self.attention_chunk < 0:
            raise ValueError(f"model.attention_chunk must be >= 0; got {self.attention_chunk}")
        if self.rotary and self.width_per_head(d_model) % 2:
            raise ValueError(
                f"rotary positions turn pairs of a head's features: head_dim "
                f"{self.width_per_head(d_model)} must be even"
            )

    def width_per_head(self, d_model: int) -> int:
        return self.head_dim or d_model // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    def hidden(self, d_model: int) -> int:
        return self.mlp_dim or self.mlp_ratio * d_model


MLPS = ("gelu", "swiglu")
# Stacked blocks' leading dimension is named "layers" (never split over a mesh axis).
LAYERS_AXIS = {nnx.PARTITION_NAME: "layers"}
# The logical dimensions a block computes tensor-parallel.
TENSOR_PARALLEL = ("heads", "kv_heads", "mlp")
# The vocabulary's dimension: the embedding, head and loss may split it over a tensor axis.
VOCABULARY = "vocab"
NORMS = {"layernorm": nnx.LayerNorm, "rmsnorm": nnx.RMSNorm}
ROTARY_BASE = 10_000.0


def rotary(x: jax.Array) -> jax.Array:
    """Rotary position embedding (Su et al.) of ``x`` ``[..., length, heads, head_dim]``: each
    pair of features ``(i, i + head_dim / 2)`` turned by an angle of its position times
    ``ROTARY_BASE ** (-2 i / head_dim)``, in float32."""
    length, half = x.shape[-3], x.shape[-1] // 2
    frequencies = ROTARY_BASE ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = jnp.arange(length, dtype=jnp.float32)[:, None] * frequencies  # [length, half]
    cos, sin = (f(angles)[:, None, :] for f in (jnp.cos, jnp.sin))  # over the heads
    first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    turned = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], -1)
    return turned.astype(x.dtype)


def _attention_fn(turned: bool, chunk: int):
    """Dot-product attention (``nnx.dot_product_attention``'s arguments), the queries and keys
    ``turned`` by their positions (:func:`rotary`) first, the queries in blocks of ``chunk``
    if it is not 0 (see :class:`BlockShape`)."""

    def attention(query, key, value, *, mask=None, **kwargs):
        if turned:
            query, key = rotary(query), rotary(key)
        length = query.shape[-3]
        if not chunk or chunk >= length:
            return nnx.dot_product_attention(query, key, value, mask=mask, **kwargs)
        if length % chunk:
            raise ValueError(f"model.attention_chunk={chunk} must divide the {length} positions")

        def block(part):
            rows, rows_mask = part
            return nnx.dot_product_attention(rows, key, value, mask=rows_mask, **kwargs)

        # [..., length, heads, dim] -> [blocks, ..., chunk, heads, dim]; the mask's rows alike.
        rows = jnp.moveaxis(query.reshape(*query.shape[:-3], -1, chunk, *query.shape[-2:]), -4, 0)
        masks = None
        if mask is not None:
            masks = jnp.moveaxis(mask.reshape(*mask.shape[:-2], -1, chunk, mask.shape[-1]), -3, 0)
        out = lax.map(jax.checkpoint(block), (rows, masks))
        return jnp.moveaxis(out, 0, -4).reshape(*query.shape[:-1], value.shape[-1])

    return attention


def name_dims(variable: nnx.Variable, *names: str | None) -> None:
    """Record ``variable``'s logical dimension names (flax's partitioning metadata), which
    the recipe's rules map to mesh axes (:mod:`jaxdist.training.logical_axes`)."""
    variable.set_metadata("out_sharding", names)


def _name_norm(norm: nnx.Module) -> None:
    """A norm's scale (and bias, if it has one) span the model's width."""
    for variable in (norm.scale, getattr(norm, "bias", None)):
        if variable is not None:
            name_dims(variable, "embed")


class Block(nnx.Module):
    """Pre-norm causal self-attention and MLP, each added to the residual stream.

    The attention's query, key and value and the MLP's first layer are column-parallel
    products, the attention's output and the MLP's second layer row-parallel ones
    (:mod:`jaxdist.comm.tensor_parallel`): split over a ``tensor`` axis by heads and
    hidden units, plain products otherwise. Parameters are those of ``nnx.MultiHeadAttention``
    and ``nnx.Linear``, named ``embed``, ``heads``, ``kv_heads``, ``head_dim`` and ``mlp``.
    """

    def __init__(
        self, d_model: int, shape: BlockShape, dropout: float, dtype, rngs: nnx.Rngs
    ) -> None:
        norm = NORMS[shape.norm]
        hidden = shape.hidden(d_model)
        self.norm1 = norm(d_model, dtype=dtype, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(
            shape.num_heads,
            d_model,
            qkv_features=shape.num_heads * shape.width_per_head(d_model),
            out_features=d_model,
            num_kv_heads=shape.kv_heads,
            attention_fn=_attention_fn(shape.rotary, shape.attention_chunk),
            dtype=dtype,
            decode=False,
            rngs=rngs,
        )
        self.norm2 = norm(d_model, dtype=dtype, rngs=rngs)
        self.gated = shape.mlp == "swiglu"
        if self.gated:
            self.gate = nnx.Linear(d_model, hidden, dtype=dtype, rngs=rngs)
        self.up = nnx.Linear(d_model, hidden, dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(hidden, d_model, dtype=dtype, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)
        self.dtype = dtype
        self._name_dims()

    def _name_dims(self) -> None:
        attention = self.attention
        name_dims(attention.query.kernel, "embed", "heads", "head_dim")
        name_dims(attention.query.bias, "heads", "head_dim")
        for kv in (attention.key, attention.value):
            name_dims(kv.kernel, "embed", "kv_heads", "head_dim")
            name_dims(kv.bias, "kv_heads", "head_dim")
        name_dims(attention.out.kernel, "heads", "head_dim", "embed")
        name_dims(attention.out.bias, "embed")
        for layer in (self.up, *([self.gate] if self.gated else [])):
            name_dims(layer.kernel, "embed", "mlp")
            name_dims(layer.bias, "mlp")
        name_dims(self.down.kernel, "mlp", "embed")
        name_dims(self.down.bias, "embed")
        _name_norm(self.norm1)
        _name_norm(self.norm2)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.dropout(self._attend(_own_positions_norm(self.norm1, x)))
        h = _own_positions_norm(self.norm2, x)
        if self.gated:
            gate, up = self._column(h, self.gate, self.up)
            h = nnx.silu(gate) * up
        else:
            (up,) = self._column(h, self.up)
            h = nnx.gelu(up)
        return x + self.dropout(self._row(h, self.down, contracted=1))

    def _attend(self, x: jax.Array) -> jax.Array:
        """Causal self-attention of ``x`` over this device's heads (all of them unsplit)."""
        attention = self.attention
        query, key, value = self._column(x, attention.query, attention.key, attention.value)
        mask = nnx.make_causal_mask(query[..., 0, 0])  # every position, whatever x holds
        heads = attention.attention_fn(query, key, value, mask=mask, dtype=self.dtype)
        return self._row(heads, attention.out, contracted=2)

    def _column(self, x: jax.Array, *layers: nnx.Module) -> list[jax.Array]:
        """Column-parallel products of ``x`` with ``layers`` (kernels ``[d, *features]``),
        each plus its bias, in the block's dtype."""
        kernels = [layer.kernel[...].astype(self.dtype) for layer in layers]
        outs = column_product(x.astype(self.dtype), kernels)
        return [out + layer.bias[...].astype(self.dtype) for out, layer in zip(outs, layers)]

    def _row(self, h: jax.Array, layer: nnx.Module, contracted: int) -> jax.Array:
        """The row-parallel product of ``h``'s last ``contracted`` dimensions with ``layer``,
        plus its bias once the partial products are summed."""
        out = row_product(h.astype(self.dtype), layer.kernel[...].astype(self.dtype), contracted)
        return out + shared(layer.bias[...]).astype(self.dtype)


def _own_positions_norm(norm: nnx.Module, x: jax.Array) -> jax.Array:
    """``norm(x)``; under sequence parallelism with its parameters :func:`shared`, as it
    sees this device's positions alone."""
    if not sequence_parallel():
        return norm(x)
    graphdef, state = nnx.split(norm)
    return nnx.merge(graphdef, jax.tree.map(shared, state))(x)


class Transformer(nnx.Module):
    """A causal language model over ``vocab_size`` tokens, sequences up to ``max_len``;
    ``remat`` names what each block keeps for backward (:data:`REMAT_POLICIES`; ``True`` is
    ``"full"``), ``scan_layers`` stacks the blocks and scans over them, and
    ``tie_embeddings`` takes the logits from the token embedding's table (no separate head,
    as GPT-2 and MaxText's 2023 models do)."""

    def __init__(
        self,
        *,
        vocab_size: int,
        max_len: int,
        num_layers: int,
        d_model: int,
        num_heads: int,
        mlp_ratio: int = 4,
        shape: BlockShape | None = None,
        dropout: float = 0.0,
        dtype=jnp.float32,
        remat: bool | str = False,
        scan_layers: bool = False,
        tie_embeddings: bool = False,
        rngs: nnx.Rngs,
    ) -> None:
        self.remat = remat_policy_name(remat)
        self.scan_layers = scan_layers
        self.tie_embeddings = tie_embeddings
        self.depth = num_layers
        shape = shape or BlockShape(num_heads, mlp_ratio=mlp_ratio)
        shape.check(d_model)
        self.token_embed = nnx.Embed(vocab_size, d_model, dtype=dtype, rngs=rngs)
        if not shape.rotary:
            self.position_embed = nnx.Embed(max_len, d_model, dtype=dtype, rngs=rngs)
        make = lambda rngs: Block(d_model, shape, dropout, dtype, rngs)  # noqa: E731
        if scan_layers:
            # Each block drawn as the unrolled model draws it, then stacked into the scanned
            # module: both start from the same values (and train to them).
            drawn = [nnx.to_pure_dict(nnx.state(make(rngs), nnx.Param)) for _ in range(num_layers)]
            vmapped = nnx.vmap(make, in_axes=0, out_axes=0, transform_metadata=LAYERS_AXIS)
            self.blocks = nnx.split_rngs(splits=num_layers)(vmapped)(nnx.Rngs(0))
            stacked = nnx.state(self.blocks, nnx.Param)
            nnx.replace_by_pure_dict(stacked, jax.tree.map(lambda *xs: jnp.stack(xs), *drawn))
            nnx.update(self.blocks, stacked)
        else:
            self.blocks = nnx.List([make(rngs) for _ in range(num_layers)])
        self.norm = NORMS[shape.norm](d_model, dtype=dtype, rngs=rngs)
        if not tie_embeddings:
            self.head = nnx.Linear(d_model, vocab_size, dtype=dtype, rngs=rngs)
            name_dims(self.head.kernel, "embed", VOCABULARY)
            name_dims(self.head.bias, VOCABULARY)
        name_dims(self.token_embed.embedding, VOCABULARY, "embed")
        if not shape.rotary:
            name_dims(self.position_embed.embedding, "positions", "embed")
        _name_norm(self.norm)

    @property
    def num_layers(self) -> int:
        """Layers a stage cut counts: the embedding, each block, the head."""
        return self.depth + 2

    def check_cuttable(self) -> None:
        """Refuse, in one line, a model that cannot be cut into spans of layers (pipeline
        stages): scanned blocks are one stacked module, and a tied head is the first
        layer's table."""
        if self.scan_layers:
            raise ValueError(
                "pipeline stages cut the transformer between blocks, which "
                "model.scan_layers=True stacks into one; set model.scan_layers=False"
            )
        if self.tie_embeddings:
            raise ValueError(
                "pipeline stages give the token embedding to the first stage and the head to "
                "the last, which model.tie_embeddings=True makes one table; set "
                "model.tie_embeddings=False"
            )

    def span(self, start: int, stop: int) -> TransformerSpan:
        """Layers ``[start, stop)`` as a module of their own, sharing this one's layers."""
        self.check_cuttable()
        return TransformerSpan(self, start, stop)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return _run(self, tokens, 0, self.num_layers, self.num_layers)


class TransformerSpan(nnx.Module):
    """Layers ``[start, stop)`` of a :class:`Transformer`: tokens in when ``start == 0``,
    logits out when ``stop`` is the last layer, the residual stream in between. Its
    parameters are named as in the whole model, but for ``blocks``, counted from the span's
    first block."""

    def __init__(self, model: Transformer, start: int, stop: int) -> None:
        if not 0 <= start < stop <= model.num_layers:
            raise ValueError(
                f"a span of layers [{start}, {stop}) of a transformer with "
                f"{model.num_layers} layers"
            )
        self.start, self.stop, self.total = start, stop, model.num_layers
        self.remat, self.scan_layers, self.tie_embeddings = model.remat, False, False
        if start == 0:
            self.token_embed = model.token_embed
            if hasattr(model, "position_embed"):
                self.position_embed = model.position_embed
        self.blocks = nnx.List(list(model.blocks[max(start - 1, 0) : stop - 1]))
        if stop == model.num_layers:
            self.norm, self.head = model.norm, model.head

    def __call__(self, x: jax.Array) -> jax.Array:
        return _run(self, x, self.start, self.stop, self.total)


def _call(block: Block, x: jax.Array) -> jax.Array:
    return block(x)


def _block_fn(remat: str):
    """``(block, x) -> block(x)``, keeping for backward what the ``remat`` policy saves."""
    if remat == "none":
        return _call
    return nnx.remat(_call, policy=REMAT_POLICIES[remat])


def _run(
    layers: Transformer | TransformerSpan, x: jax.Array, start: int, stop: int, total: int
) -> jax.Array:
    """Layers ``[start, stop)`` of ``total``, from what ``layers`` holds of them."""
    if start == 0:
        tokens = x
        x = _embed_tokens(layers.token_embed, tokens)
        if hasattr(layers, "position_embed"):  # else rotary, inside each block's attention
            x = x + layers.position_embed(jnp.arange(tokens.shape[-1]))
        if stop > 1:  # blocks follow: each device of a sequence-parallel axis its positions
            x = to_sequence_shard(x)
    block_fn = _block_fn(layers.remat)
    if layers.scan_layers:
        scan = nnx.scan(
            block_fn, in_axes=(0, nnx.Carry), out_axes=nnx.Carry, transform_metadata=LAYERS_AXIS
        )
        x = scan(layers.blocks, x)
    else:
        for block in layers.blocks:
            x = block_fn(block, x)
    if stop == total:
        x = _logits(layers, x, positions_split=start < total - 1 and sequence_parallel())
    return x


def _embed_tokens(embed: nnx.Embed, tokens: jax.Array) -> jax.Array:
    """The tokens' rows of the embedding, in its dtype (as ``nnx.Embed``): looked up on the
    device that holds each row where the vocabulary is split over a tensor axis."""
    table = _vocabulary_table(embed.embedding[...], embed.num_embeddings, rows_dim=0)
    return vocab_parallel.embed(table.astype(embed.dtype), tokens)


def _vocabulary_table(table: jax.Array, vocab_size: int, rows_dim: int) -> jax.Array:
    """``table``, checked to hold the whole vocabulary along ``rows_dim`` exactly when the
    step keeps it whole: one line for a step that splits its rules' vocabulary without
    saying so (``TensorParallel.vocabulary``), or says so of a whole one."""
    split = vocabulary_axis() is not None
    if (table.shape[rows_dim] < vocab_size) != split:
        raise ValueError(
            f"the model reads {table.shape[rows_dim]} of its {vocab_size} vocabulary rows, "
            f"but the step {'splits' if split else 'keeps'} the vocabulary "
            f"{'over' if split else 'whole on'} its tensor axis: give "
            f"TensorParallel(vocabulary=...) what the rules do to the vocabulary"
        )
    return table


def _logits(
    layers: Transformer | TransformerSpan, x: jax.Array, positions_split: bool
) -> jax.Array:
    """The final norm and the head of the residual stream ``x`` (each device its own
    positions where ``positions_split``), float32 logits. With the vocabulary split over a
    tensor axis the head is a column-parallel product, each device its vocabulary's logits;
    under sequence parallelism it gathers the positions itself, so the norm runs on this
    device's own."""
    if vocabulary_axis() is None:
        if positions_split:
            x = from_sequence_shard(x)
        x = layers.norm(x)
        x = layers.token_embed.attend(x) if layers.tie_embeddings else layers.head(x)
        return x.astype(jnp.float32)
    if sequence_parallel() and not positions_split:
        x = to_sequence_shard(x)  # what the column-parallel product expects
    x = _own_positions_norm(layers.norm, x)
    if layers.tie_embeddings:
        embed = layers.token_embed
        kernel, dtype = embed.embedding[...].T, embed.dtype
        vocab_size = embed.num_embeddings
    else:
        kernel = layers.head.kernel[...]
        dtype = layers.head.dtype or kernel.dtype
        vocab_size = layers.head.out_features
    kernel = _vocabulary_table(kernel, vocab_size, rows_dim=1)
    (logits,) = column_product(x.astype(dtype), [kernel.astype(dtype)])
    if not layers.tie_embeddings:
        logits = logits + layers.head.bias[...].astype(dtype)
    return logits.astype(jnp.float32)


def stack_blocks(params: dict) -> dict:
    """An unscanned transformer's parameters (``blocks`` a dict of layers ``0..L-1``) laid
    out for ``scan_layers=True``: every block leaf stacked along a new leading layer axis."""
    blocks = params["blocks"]
    layers = [blocks[i] for i in sorted(blocks)]
    return {**params, "blocks": jax.tree.map(lambda *xs: jnp.stack(xs), *layers)}


def unstack_blocks(params: dict) -> dict:
    """A scanned transformer's parameters laid out as the unscanned model's (the inverse of
    :func:`stack_blocks`)."""
    stacked = params["blocks"]
    depth = jax.tree.leaves(stacked)[0].shape[0]
    return {
        **params,
        "blocks": {i: jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(depth)},
    }

"""A decoder-only transformer in flax NNX: token and position embeddings, pre-norm blocks of
causal self-attention and an MLP, a final norm and a linear head over the vocabulary.

::

    model = Transformer(vocab_size=256, max_len=128, num_layers=2, d_model=128, num_heads=4,
                        rngs=nnx.Rngs(0))
    logits = model(tokens)                    # [batch, length] int -> [batch, length, vocab]

With ``remat=True`` each block keeps only its input for the backward pass and runs its
forward again there (``nnx.remat``, activation checkpointing): the activations a step holds
fall from every block's to one block's, for about a quarter more compute.

Layers are kept as a list (``blocks``), so spans of them can run on their own
(:class:`TransformerSpan`, :meth:`Transformer.span`): the embedding is layer 0, block ``i``
layer ``i + 1`` and the final norm with the head the last layer, the convention the
pipeline's stage cuts use.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["Block", "Transformer", "TransformerSpan"]


class Block(nnx.Module):
    """Pre-norm causal self-attention and MLP, each added to the residual stream."""

    def __init__(self, d_model: int, num_heads: int, mlp_ratio: int, dropout: float,
                 dtype, rngs: nnx.Rngs) -> None:  # fmt: skip
        self.norm1 = nnx.LayerNorm(d_model, dtype=dtype, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(
            num_heads, d_model, dtype=dtype, decode=False, rngs=rngs
        )
        self.norm2 = nnx.LayerNorm(d_model, dtype=dtype, rngs=rngs)
        self.up = nnx.Linear(d_model, mlp_ratio * d_model, dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(mlp_ratio * d_model, d_model, dtype=dtype, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        mask = nnx.make_causal_mask(x[..., 0])
        x = x + self.dropout(self.attention(self.norm1(x), mask=mask))
        return x + self.dropout(self.down(nnx.gelu(self.up(self.norm2(x)))))


class Transformer(nnx.Module):
    """A causal language model over ``vocab_size`` tokens, sequences up to ``max_len``;
    ``remat`` recomputes each block's activations in the backward pass instead of keeping
    them."""

    def __init__(
        self,
        *,
        vocab_size: int,
        max_len: int,
        num_layers: int,
        d_model: int,
        num_heads: int,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
        dtype=jnp.float32,
        remat: bool = False,
        rngs: nnx.Rngs,
    ) -> None:
        self.remat = remat
        self.token_embed = nnx.Embed(vocab_size, d_model, dtype=dtype, rngs=rngs)
        self.position_embed = nnx.Embed(max_len, d_model, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List(
            [Block(d_model, num_heads, mlp_ratio, dropout, dtype, rngs) for _ in range(num_layers)]
        )
        self.norm = nnx.LayerNorm(d_model, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(d_model, vocab_size, dtype=dtype, rngs=rngs)

    @property
    def num_layers(self) -> int:
        """Layers a stage cut counts: the embedding, each block, the head."""
        return len(self.blocks) + 2

    def span(self, start: int, stop: int) -> TransformerSpan:
        """Layers ``[start, stop)`` as a module of their own, sharing this one's layers."""
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
            raise ValueError(f"a span of layers [{start}, {stop}) of a transformer with "
                             f"{model.num_layers} layers")  # fmt: skip
        self.start, self.stop, self.total = start, stop, model.num_layers
        self.remat = model.remat
        if start == 0:
            self.token_embed, self.position_embed = model.token_embed, model.position_embed
        self.blocks = nnx.List(list(model.blocks[max(start - 1, 0) : stop - 1]))
        if stop == model.num_layers:
            self.norm, self.head = model.norm, model.head

    def __call__(self, x: jax.Array) -> jax.Array:
        return _run(self, x, self.start, self.stop, self.total)


@nnx.remat
def _rematerialised(block: Block, x: jax.Array) -> jax.Array:
    """``block(x)``, its activations recomputed in the backward pass."""
    return block(x)


def _run(layers: Transformer | TransformerSpan, x: jax.Array, start: int, stop: int,
         total: int) -> jax.Array:  # fmt: skip
    """Layers ``[start, stop)`` of ``total``, from what ``layers`` holds of them."""
    if start == 0:
        positions = jnp.arange(x.shape[-1])
        x = layers.token_embed(x) + layers.position_embed(positions)
    for block in layers.blocks:
        x = _rematerialised(block, x) if layers.remat else block(x)
    if stop == total:
        x = layers.head(layers.norm(x)).astype(jnp.float32)
    return x

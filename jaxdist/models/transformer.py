"""A decoder-only transformer in flax NNX: token and position embeddings, pre-norm blocks of
causal self-attention and an MLP, a final norm and a linear head over the vocabulary.

::

    model = Transformer(vocab_size=256, max_len=128, num_layers=2, d_model=128, num_heads=4,
                        rngs=nnx.Rngs(0))
    logits = model(tokens)                    # [batch, length] int -> [batch, length, vocab]

Layers are kept as a list (``blocks``), so spans of them can run on their own
(:meth:`Transformer.run_span`): the embedding is layer 0, block ``i`` layer ``i + 1`` and the
head the last layer, the convention the pipeline's stage cuts use.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["Block", "Transformer"]


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
    """A causal language model over ``vocab_size`` tokens, sequences up to ``max_len``."""

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
        rngs: nnx.Rngs,
    ) -> None:
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

    def run_span(self, x: jax.Array, start: int, stop: int) -> jax.Array:
        """Layers ``[start, stop)``: tokens in when ``start == 0``, logits out when ``stop``
        is :attr:`num_layers`, the residual stream in between."""
        if start == 0:
            positions = jnp.arange(x.shape[-1])
            x = self.token_embed(x) + self.position_embed(positions)
        for block in self.blocks[max(start - 1, 0) : stop - 1]:
            x = block(x)
        if stop == self.num_layers:
            x = self.head(self.norm(x)).astype(jnp.float32)
        return x

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.run_span(tokens, 0, self.num_layers)

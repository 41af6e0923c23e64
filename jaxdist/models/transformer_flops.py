"""A decoder-only transformer's training FLOPs as MaxText counts them today: per token,
6 x (the parameters of its matrix products, the unembedding's included) + 6 x layers x query
heads x head_dim x context (the attention's scores and their use, forward and backward, over
the causal half of the square). Model FLOPs utilization is this count per chip per second
over the chip's peak: the figure MaxText's and torchtitan's tables publish."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["TransformerShape"]


@dataclass(frozen=True)
class TransformerShape:
    """A decoder-only transformer, as its FLOPs count needs it."""

    num_layers: int
    d_model: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    mlp_matrices: int  # 2 for an MLP of up and down, 3 for a gated one (SwiGLU)
    vocab_size: int
    seq_len: int

    @classmethod
    def of_run(cls, run: Mapping[str, Any]) -> TransformerShape:
        gated = run["mlp"] == "swiglu"
        return cls(
            run["num_layers"],
            run["d_model"],
            run["num_heads"],
            run["num_kv_heads"] or run["num_heads"],
            run["head_dim"],
            run["mlp_dim"],
            3 if gated else 2,
            run["vocab_size"],
            run["seq_len"],
        )

    @property
    def layer_matmul_parameters(self) -> int:
        """One block's matrix-product weights: queries, keys, values, output, MLP."""
        attention = self.d_model * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        return attention + self.mlp_matrices * self.d_model * self.mlp_dim

    @property
    def matmul_parameters(self) -> int:
        """Every block's matrix-product weights and the unembedding."""
        return self.num_layers * self.layer_matmul_parameters + self.d_model * self.vocab_size

    @property
    def attention_per_token(self) -> int:
        """``layers x heads x head_dim x context``: the scores' and their use's share of a
        token's forward FLOPs over a full square is 4x this (forward and backward 12x)."""
        return self.num_layers * self.num_heads * self.head_dim * self.seq_len

    def training_flops_per_token(self) -> float:
        """MaxText's definition: 6 N + 12 L h hd T / 2 (the causal half)."""
        return 6.0 * self.matmul_parameters + 6.0 * self.attention_per_token

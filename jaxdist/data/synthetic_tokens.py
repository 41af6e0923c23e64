"""Windows of uniformly random tokens from a vocabulary of any size: a language model's
stand-in data when its vocabulary is not the 256 bytes of a text corpus (a 32,000-token
model's throughput, memory or plan). Nothing can be learnt from them: the held-out
cross-entropy stays at ``log2(vocab_size)`` bits per token, the baseline a model reaches by
predicting the uniform distribution."""

from __future__ import annotations

import math

import numpy as np

from jaxdist.data.records import ArrayRecords

__all__ = ["SyntheticTokens"]


class SyntheticTokens:
    """``train_windows`` and ``eval_windows`` windows of ``seq_len + 1`` tokens drawn
    uniformly from ``[0, vocab_size)`` by a generator seeded with ``seed`` (the same on
    every machine); ``uint8`` while the vocabulary fits in a byte, else ``int32``."""

    def __init__(
        self, vocab_size: int, seq_len: int, *, train_windows: int, eval_windows: int, seed: int = 0
    ) -> None:
        if vocab_size < 2 or seq_len < 1 or train_windows < 1 or eval_windows < 1:
            raise ValueError(
                f"synthetic tokens need vocab_size >= 2, seq_len >= 1 and at least one window "
                f"per split; got {vocab_size}, {seq_len}, {train_windows} and {eval_windows}"
            )
        self.vocab_size, self.seq_len = vocab_size, seq_len
        self.dtype = np.dtype(np.uint8 if vocab_size <= 256 else np.int32)
        rng = np.random.default_rng(seed)
        self._windows = {
            split: rng.integers(0, vocab_size, (count, seq_len + 1)).astype(self.dtype)
            for split, count in (("train", train_windows), ("eval", eval_windows))
        }

    @property
    def baseline_bits(self) -> float:
        """Bits per token of the uniform prediction: all a model can reach on these."""
        return math.log2(self.vocab_size)

    def records(self, split: str) -> ArrayRecords:
        """The ``train`` or ``eval`` windows as records ``{"tokens": [seq_len + 1]}``."""
        return ArrayRecords({"tokens": self._windows[split]}, name=f"synthetic tokens {split}")

"""A byte-level causal language model: a flax NNX :class:`~jaxdist.models.transformer.Transformer`
trained to predict the next byte of text (:mod:`jaxdist.data.byte_corpus`; by default the
Python standard library's sources), evaluated by held-out bits per byte beside the baseline of
the training bytes' frequencies.

Recipe fields it reads: ``model.num_layers``, ``d_model``, ``num_heads``, ``mlp_ratio``,
``dropout``, ``dtype``, ``remat`` (what each block keeps for the backward pass: ``none``,
``full`` or ``dots``, the products' outputs), ``scan_layers`` (the blocks stacked and
scanned: a program that does not grow with depth); ``data.root`` (``""``: the standard
library), ``pattern``, ``seq_len``, ``held_out_every``, ``max_train_bytes``,
``max_eval_bytes``, ``seed`` (the shuffle); ``seed`` (the initial weights). ``recipes/transformer_lm.py`` is its recipe.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx

from jaxdist.data.byte_corpus import ByteCorpus, unigram_bits_per_byte
from jaxdist.data.records import RecordData
from jaxdist.models.nnx_model import NnxModel
from jaxdist.models.transformer import Transformer, remat_policy_name
from jaxdist.pipeline import stages as pipeline_stages
from jaxdist.tasks.image_classification import DTYPES
from jaxdist.tasks.task import PipelineParts, Replicas, Task

__all__ = ["LanguageModel", "data_fields", "model_fields"]

VOCAB = 256  # bytes


def model_fields() -> ml_collections.ConfigDict:
    """The ``model`` section of a language-model recipe, with defaults."""
    return ml_collections.ConfigDict(
        dict(
            name="transformer_lm",
            num_layers=2,
            d_model=128,
            num_heads=4,
            mlp_ratio=4,
            dropout=0.0,
            dtype="float32",
            remat="none",
            scan_layers=False,
        )
    )


def data_fields() -> ml_collections.ConfigDict:
    """The ``data`` section of a language-model recipe, with defaults."""
    return ml_collections.ConfigDict(
        dict(
            root="",
            pattern="*.py",
            seq_len=128,
            held_out_every=20,
            max_train_bytes=0,
            max_eval_bytes=0,
            seed=0,
        )
    )


def inputs_of(tokens: jax.Array) -> jax.Array:
    """What the model reads of a window: every byte but the last."""
    return tokens[:, :-1].astype(jnp.int32)


def next_byte_nll(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Negative log-likelihood (nats) of each next byte of the windows ``tokens`` under the
    model's ``logits`` for its inputs."""
    targets = tokens[:, 1:].astype(jnp.int32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


class _SpanStage:
    """A pipeline stage of the transformer: layers ``[start, stop)``, called as
    ``(params, model_state, x, rng) -> (y, model_state)`` on its part of the whole model's
    trees (named as in the whole model, so the parts join back by name)."""

    def __init__(self, whole: Transformer, start: int, stop: int) -> None:
        span = whole.span(start, stop)
        self.model = NnxModel(span)
        self.first_block = max(start - 1, 0)
        self.blocks = range(self.first_block, self.first_block + len(span.blocks))
        self.names = {"token_embed", "position_embed"} if start == 0 else set()
        if stop == whole.num_layers:
            self.names |= {"norm", "head"}

    def part(self, tree: dict) -> dict:
        """The stage's part of a whole-model tree, block indices as in the whole model."""
        own = {name: tree[name] for name in self.names if name in tree}
        blocks = {i: tree["blocks"][i] for i in self.blocks if i in tree.get("blocks", {})}
        return {**own, "blocks": blocks} if blocks else own

    @staticmethod
    def _blocks_shifted(tree: dict, offset: int) -> dict:
        """``tree`` with its block indices moved by ``offset``: whole-model numbering to the
        span's (``-first_block``) and back (``+first_block``)."""
        if "blocks" not in tree:
            return tree
        return {**tree, "blocks": {i + offset: v for i, v in tree["blocks"].items()}}

    def __call__(self, params, model_state, x, rng):
        own = -self.first_block
        y, model_state = self.model.apply(self._blocks_shifted(params, own),
                                          self._blocks_shifted(model_state, own), x, rng=rng)  # fmt: skip
        return y, self._blocks_shifted(model_state, self.first_block)


class LanguageModel(Task):
    """Next-byte prediction with a decoder-only NNX transformer.

    Attributes:
      corpus: the text, split into train and held-out windows.
      model: the transformer as pure functions (:class:`~jaxdist.models.nnx_model.NnxModel`).
      baseline_bits_per_byte: the held-out bits per byte of the training byte frequencies.
    """

    headline = "bits_per_byte"
    higher_is_better = False
    unit = "sequences"

    def __init__(self, config: ml_collections.ConfigDict, replicas: Replicas) -> None:
        m, d = config.model, config.data
        if m.dtype not in DTYPES:
            raise ValueError(f"model.dtype must be one of {sorted(DTYPES)}, got {m.dtype!r}")
        remat_policy_name(m.remat)  # one line naming the choices, before anything is built
        if m.d_model % m.num_heads:
            raise ValueError(
                f"model.d_model={m.d_model} must divide by model.num_heads={m.num_heads}"
            )
        self.name = m.name
        self.corpus = ByteCorpus(d.root or None, pattern=d.pattern, seq_len=d.seq_len,
                                 held_out_every=d.held_out_every, max_train_bytes=d.max_train_bytes,
                                 max_eval_bytes=d.max_eval_bytes)  # fmt: skip
        self.data = RecordData(self.corpus.records("train"), self.corpus.records("eval"),
                               seed=d.seed)  # fmt: skip
        targets = self.corpus.windows(self.corpus.eval_bytes)[:, 1:]
        self.baseline_bits_per_byte = unigram_bits_per_byte(self.corpus.train_bytes, targets)
        self._make = lambda key: Transformer(
            vocab_size=VOCAB, max_len=d.seq_len, num_layers=m.num_layers, d_model=m.d_model,
            num_heads=m.num_heads, mlp_ratio=m.mlp_ratio, dropout=m.dropout,
            dtype=DTYPES[m.dtype], remat=m.remat, scan_layers=m.scan_layers, rngs=nnx.Rngs(key),
        )  # fmt: skip
        self._abstract = nnx.eval_shape(lambda: self._make(jax.random.key(0)))  # structure only
        self.model = NnxModel(self._abstract)

    def stacked_layers(self) -> Any:
        """With ``model.scan_layers``, every leaf under ``blocks`` is stacked over the blocks."""
        if not self._abstract.scan_layers:
            return None
        params, _ = self.model.variables()
        return {
            name: jax.tree.map(lambda _, n=name: n == "blocks", tree)
            for name, tree in params.items()
        }

    def init_variables(self, rng: jax.Array) -> tuple[Any, Any]:
        return jax.jit(lambda key: NnxModel(self._make(key)).variables())(rng)

    def _nll(self, params, model_state, tokens, rng, train):
        logits, model_state = self.model.apply(
            params, model_state, inputs_of(tokens), rng=rng, train=train
        )
        return next_byte_nll(logits, tokens), model_state

    def loss(self, params, model_state, batch, rng):
        nll, model_state = self._nll(params, model_state, batch["tokens"], rng, train=True)
        loss = nll.mean()
        return loss, (model_state, {"bits_per_byte": loss / math.log(2)})

    def eval_sums(self, params, model_state, batch):
        nll, _ = self._nll(params, model_state, batch["tokens"], None, train=False)
        mask = batch["mask"].astype(jnp.float32)
        return {"nll": jnp.sum(nll.sum(-1) * mask), "count": jnp.sum(mask) * nll.shape[-1]}

    def eval_metrics(self, totals: dict[str, float]) -> dict[str, float]:
        return {
            "bits_per_byte": totals["nll"] / totals["count"] / math.log(2),
            "unigram_bits_per_byte": self.baseline_bits_per_byte,
        }

    def pipeline_parts(
        self, virtual_stages: int, boundaries: Sequence[int] | None
    ) -> PipelineParts:
        """The transformer cut into spans of layers (embedding, blocks, norm and head); the
        next-byte cross-entropy on the last stage's logits."""
        whole = self._abstract
        if whole.scan_layers:  # before the stage count is checked against the layers
            raise ValueError(
                "pipeline stages cut the transformer between blocks, which "
                "model.scan_layers=True stacks into one; set model.scan_layers=False"
            )
        cuts = pipeline_stages.spans(whole.num_layers, None if boundaries else virtual_stages,
                                     boundaries)  # fmt: skip
        stages = [_SpanStage(whole, start, stop) for start, stop in cuts]

        def loss(logits, micro_batch):
            value = next_byte_nll(logits, micro_batch["tokens"]).mean()
            return value, {"bits_per_byte": value / math.log(2)}

        def split(params, model_state):
            return [s.part(params) for s in stages], [s.part(model_state) for s in stages]

        return PipelineParts(
            stages=stages,
            loss=loss,
            inputs=lambda batch: inputs_of(batch["tokens"]),
            split=split,
        )

    def batch_spec(self, global_batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        return {"tokens": jax.ShapeDtypeStruct((global_batch_size, self.corpus.seq_len + 1),
                                               jnp.uint8)}  # fmt: skip

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "seq_len": self.corpus.seq_len}

"""A byte-level causal language model: a flax NNX :class:`~jaxdist.models.transformer.Transformer`
trained to predict the next byte of text (:mod:`jaxdist.data.byte_corpus`; by default the
Python standard library's sources), evaluated by held-out bits per byte beside the baseline of
the training bytes' frequencies.

Recipe fields it reads: ``model.num_layers``, ``d_model``, ``num_heads``, ``head_dim``,
``num_kv_heads`` (grouped-query attention), ``mlp_dim`` (or ``mlp_ratio``), ``mlp``
(``gelu`` or ``swiglu``), ``norm`` (``layernorm`` or ``rmsnorm``), ``positions``
(``learned`` or ``rotary``), ``attention_chunk`` (queries per block of attention),
``vocab_size``, ``tie_embeddings`` (the logits from the token embedding's own table, no
separate head), ``dropout``, ``dtype``, ``remat`` (what each
block keeps for the backward pass: ``none``, ``full`` or ``dots``, the products' outputs),
``scan_layers`` (the blocks stacked and scanned: a program that does not grow with depth);
``data.source`` (``corpus``: the text files below; ``synthetic``: uniformly random tokens
of the model's vocabulary, :mod:`jaxdist.data.synthetic_tokens`, ``synthetic_train_windows``
and ``synthetic_eval_windows`` of them), ``root`` (``""``: the standard library),
``pattern``, ``seq_len``, ``held_out_every``, ``max_train_bytes``, ``max_eval_bytes``,
``seed`` (the shuffle, and the synthetic tokens); ``seed`` (the initial weights).
``recipes/transformer_lm.py`` is its recipe. The defaults are the recipe's small byte-level
model; ``bits_per_byte`` is bits per token where the tokens are not bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from jaxdist.comm import vocab_parallel
from jaxdist.data.byte_corpus import ByteCorpus, unigram_bits_per_byte
from jaxdist.data.records import RecordData
from jaxdist.data.synthetic_tokens import SyntheticTokens
from jaxdist.models.nnx_model import NnxModel
from jaxdist.models.transformer import (
    TENSOR_PARALLEL,
    VOCABULARY,
    BlockShape,
    Transformer,
    remat_policy_name,
)
from jaxdist.models.transformer_flops import TransformerShape
from jaxdist.pipeline import stages as pipeline_stages
from jaxdist.tasks.image_classification import DTYPES
from jaxdist.tasks.task import PipelineParts, Replicas, Task
from jaxdist.training.logical_axes import LogicalAxes

__all__ = ["LanguageModel", "data_fields", "model_fields"]

VOCAB = 256  # bytes
POSITIONS = ("learned", "rotary")


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
            head_dim=0,  # 0: d_model // num_heads
            num_kv_heads=0,  # 0: num_heads
            mlp_dim=0,  # 0: mlp_ratio * d_model
            mlp="gelu",
            norm="layernorm",
            positions="learned",
            attention_chunk=0,  # 0: every query at once
            vocab_size=VOCAB,
            tie_embeddings=False,  # True: the head is the token embedding's table
        )
    )


def data_fields() -> ml_collections.ConfigDict:
    """The ``data`` section of a language-model recipe, with defaults."""
    return ml_collections.ConfigDict(
        dict(
            source="corpus",
            root="",
            pattern="*.py",
            seq_len=128,
            held_out_every=20,
            max_train_bytes=0,
            max_eval_bytes=0,
            seed=0,
            synthetic_train_windows=4096,
            synthetic_eval_windows=256,
        )
    )


def inputs_of(tokens: jax.Array) -> jax.Array:
    """What the model reads of a window: every byte but the last."""
    return tokens[:, :-1].astype(jnp.int32)


def next_byte_nll(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Negative log-likelihood (nats) of each next byte of the windows ``tokens`` under the
    model's ``logits`` for its inputs."""
    targets = tokens[:, 1:].astype(jnp.int32)
    return vocab_parallel.cross_entropy(logits, targets)


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
        y, model_state = self.model.apply(
            self._blocks_shifted(params, own), self._blocks_shifted(model_state, own), x, rng=rng
        )
        return y, self._blocks_shifted(model_state, self.first_block)


def _windows(d: ml_collections.ConfigDict, vocab_size: int) -> tuple[Any, Any, float, np.dtype]:
    """``(train records, held-out records, baseline bits per token, token dtype)`` of the
    recipe's ``data`` section for a model of ``vocab_size`` tokens."""
    if d.source == "synthetic":
        tokens = SyntheticTokens(
            vocab_size,
            d.seq_len,
            train_windows=d.synthetic_train_windows,
            eval_windows=d.synthetic_eval_windows,
            seed=d.seed,
        )
        return tokens.records("train"), tokens.records("eval"), tokens.baseline_bits, tokens.dtype
    if d.source == "corpus":
        if vocab_size < VOCAB:
            raise ValueError(
                f"model.vocab_size={vocab_size} is below the {VOCAB} byte values "
                "of a text corpus; give data.source=synthetic for a smaller "
                "vocabulary"
            )
        corpus = ByteCorpus(
            d.root or None,
            pattern=d.pattern,
            seq_len=d.seq_len,
            held_out_every=d.held_out_every,
            max_train_bytes=d.max_train_bytes,
            max_eval_bytes=d.max_eval_bytes,
        )
        targets = corpus.windows(corpus.eval_bytes)[:, 1:]
        baseline = unigram_bits_per_byte(corpus.train_bytes, targets)
        return corpus.records("train"), corpus.records("eval"), baseline, np.dtype(np.uint8)
    raise ValueError(f"data.source must be corpus or synthetic; got {d.source!r}")


class LanguageModel(Task):
    """Next-byte prediction with a decoder-only NNX transformer.

    Attributes:
      data: the train and held-out windows (of the text corpus or synthetic tokens).
      model: the transformer as pure functions (:class:`~jaxdist.models.nnx_model.NnxModel`).
      baseline_bits_per_byte: the held-out bits per byte of the training byte frequencies
        (synthetic tokens: ``log2(vocab_size)``).
    """

    headline = "bits_per_byte"
    higher_is_better = False
    unit = "sequences"

    def __init__(self, config: ml_collections.ConfigDict, replicas: Replicas) -> None:
        m, d = config.model, config.data
        if m.dtype not in DTYPES:
            raise ValueError(f"model.dtype must be one of {sorted(DTYPES)}, got {m.dtype!r}")
        remat_policy_name(m.remat)  # one line naming the choices, before anything is built
        if m.positions not in POSITIONS:
            raise ValueError(
                f"model.positions must be one of {', '.join(POSITIONS)}; got {m.positions!r}"
            )
        shape = BlockShape(
            m.num_heads,
            head_dim=m.head_dim or None,
            num_kv_heads=m.num_kv_heads or None,
            mlp_dim=m.mlp_dim or None,
            mlp_ratio=m.mlp_ratio,
            mlp=m.mlp,
            norm=m.norm,
            rotary=m.positions == "rotary",
            attention_chunk=m.attention_chunk,
        )
        shape.check(m.d_model)
        self.shape = TransformerShape(
            m.num_layers,
            m.d_model,
            shape.num_heads,
            shape.kv_heads,
            shape.width_per_head(m.d_model),
            shape.hidden(m.d_model),
            3 if shape.mlp == "swiglu" else 2,
            m.vocab_size,
            d.seq_len,
        )
        self.name = m.name
        self.seq_len = d.seq_len
        train, held_out, self.baseline_bits_per_byte, self.token_dtype = _windows(d, m.vocab_size)
        self.data = RecordData(train, held_out, seed=d.seed)
        self._make = lambda key: Transformer(
            vocab_size=m.vocab_size,
            max_len=d.seq_len,
            num_layers=m.num_layers,
            d_model=m.d_model,
            num_heads=m.num_heads,
            shape=shape,
            dropout=m.dropout,
            dtype=DTYPES[m.dtype],
            remat=m.remat,
            scan_layers=m.scan_layers,
            tie_embeddings=m.tie_embeddings,
            rngs=nnx.Rngs(key),
        )
        self._abstract = nnx.eval_shape(lambda: self._make(jax.random.key(0)))  # structure only
        self.model = NnxModel(self._abstract)

    def model_flops_per_example(self) -> float:
        """MaxText's training FLOPs of one sequence (:mod:`jaxdist.models.transformer_flops`)."""
        return self.shape.training_flops_per_token() * self.seq_len

    def stacked_layers(self) -> Any:
        """With ``model.scan_layers``, every leaf under ``blocks`` is stacked over the blocks."""
        if not self._abstract.scan_layers:
            return None
        params, _ = self.model.variables()
        return {
            name: jax.tree.map(lambda _, n=name: n == "blocks", tree)
            for name, tree in params.items()
        }

    def logical_axes(self) -> LogicalAxes:
        """The transformer's named dimensions; heads, key/value heads and MLP units split
        over a ``tensor`` axis, and the vocabulary where the rules say."""
        return LogicalAxes(self.model.logical_axes(), TENSOR_PARALLEL, VOCABULARY)

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
        whole.check_cuttable()  # before the stage count is checked against the layers
        cuts = pipeline_stages.spans(
            whole.num_layers, None if boundaries else virtual_stages, boundaries
        )
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
        shape = (global_batch_size, self.seq_len + 1)
        return {"tokens": jax.ShapeDtypeStruct(shape, self.token_dtype)}

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "seq_len": self.seq_len}

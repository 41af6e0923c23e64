"""The transformer's shapes and scanned layers (``model.scan_layers``): the same model as the
unrolled one, and under FSDP each layer's slice of the stacked parameters gathered inside the
scan; rotary positions and attention in blocks of queries."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxdist import meshes
from jaxdist.models.transformer import stack_blocks, unstack_blocks
from jaxdist.tasks import Replicas
from jaxdist.tasks.language_model import LanguageModel
from jaxdist.training.sharding import Placement
from jaxdist.training.step_options import Communication, StateSharding
from jaxdist.training.train_step import TrainStep
from tests.test_tasks import corpus_root, lm_config  # noqa: F401  (the fixture)

STEPS = 2


def _batches(task, count=STEPS):
    it = task.data.train_iterator(16)
    batches = [next(it) for _ in range(count)]
    it.close()
    return batches


def _train(task, params, model_state, batches, **options):
    step = TrainStep(
        task.loss,
        optax.sgd(0.5, momentum=0.9),
        meshes.ring(4),
        communication=Communication("ring"),
        stacked_layers=task.stacked_layers(),
        **options,
    )
    state = step.init(params, model_state)
    for batch in batches:
        state, metrics = step(state, step.shard_batch(batch), jax.random.key(1))
    return step, state, metrics


def _assert_close(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=2e-6)


# A block as Llama makes one, small: 4 query heads of 16 (an attention 64 wide on a 32-wide
# stream) sharing 2 key-value heads, a gated MLP of 96, RMSNorm, rotary positions; a
# vocabulary of 1,000 synthetic tokens.
LLAMA_LIKE = {
    "model.num_layers": 3,
    "model.d_model": 32,
    "model.num_heads": 4,
    "model.head_dim": 16,
    "model.num_kv_heads": 2,
    "model.mlp_dim": 96,
    "model.mlp": "swiglu",
    "model.norm": "rmsnorm",
    "model.positions": "rotary",
    "model.vocab_size": 1000,
    "data.source": "synthetic",
    "data.synthetic_train_windows": 64,
    "data.synthetic_eval_windows": 16,
}


def test_scanned_fsdp_equals_the_unrolled_model_and_gathers_one_layer_at_a_time(corpus_root):  # noqa: F811
    """Three Llama-like blocks, every block recomputed in backward (``remat=full``): the
    scanned model starts from the unrolled one's values and, under FSDP over 4 devices,
    after two steps, is the unrolled replicated
    model's; its stacked leaves are split below the layer axis, and the scan is one of the
    loss's paced segments, whatever the depth."""
    shape = LLAMA_LIKE
    unrolled = LanguageModel(lm_config(corpus_root, **shape), Replicas("data", 4))
    scanned = LanguageModel(
        lm_config(corpus_root, **shape, **{"model.scan_layers": True, "model.remat": "full"}),
        Replicas("data", 4),
    )
    params, model_state = unrolled.init_variables(jax.random.key(0))
    # The scanned model draws each block as the unrolled one does: the same start.
    drawn, _ = scanned.init_variables(jax.random.key(0))
    for a, b in zip(jax.tree.leaves(drawn), jax.tree.leaves(stack_blocks(params)), strict=True):
        np.testing.assert_array_equal(a, b)
    batches = _batches(unrolled)
    _, expected, _ = _train(unrolled, params, model_state, batches)
    step, state, _ = _train(
        scanned, stack_blocks(params), model_state, batches, sharding=StateSharding("fsdp")
    )
    _assert_close(unstack_blocks(jax.device_get(state.params)), expected.params)

    placement = step.placement
    blocks = [i for i, path in enumerate(placement.paths) if path.startswith("blocks.")]
    assert all(placement.stacked[i] for i in blocks)
    assert {placement.dims[i] for i in blocks} - {None} and all(
        placement.dims[i] != 0 for i in blocks
    )  # split, and never along the layers
    # The embeddings, the scan over every block, the final norm, the head.
    assert step.paced_layers == 4
    blocks = state.params["blocks"]
    kernel = blocks["up"]["kernel"]
    assert kernel.shape == (3, 32, 96) and blocks["gate"]["kernel"].shape == (3, 32, 96)
    assert kernel.addressable_shards[0].data.shape == (3, 8, 96)  # every layer, a quarter
    attention = blocks["attention"]
    assert attention["query"]["kernel"].shape == (3, 32, 4, 16)
    assert attention["key"]["kernel"].shape == attention["value"]["kernel"].shape == (3, 32, 2, 16)
    assert attention["out"]["kernel"].shape == (3, 4, 16, 32)
    assert set(blocks["norm1"]) == {"scale"}  # RMSNorm: no bias
    assert "position_embed" not in state.params  # rotary
    assert state.params["token_embed"]["embedding"].shape == (1000, 32)
    assert scanned.batch_spec(8)["tokens"].dtype == np.int32
    assert scanned.baseline_bits_per_byte == pytest.approx(np.log2(1000))


def test_tied_embeddings_under_fsdp_gather_the_table_on_each_side_of_the_scan(corpus_root):  # noqa: F811
    """The head read from the token embedding's table (``model.tie_embeddings``): the logits
    are the final norm's output against the table, FSDP over 4 devices trains as the
    replicated model does, and the scan between the table's two reads stays a segment of
    its own (each side gathers the table; their gradients' shards add up)."""
    tied = {**LLAMA_LIKE, "model.tie_embeddings": True, "model.scan_layers": True}
    task = LanguageModel(lm_config(corpus_root, **tied), Replicas("data", 4))
    params, model_state = task.init_variables(jax.random.key(0))
    assert "head" not in params
    batches = _batches(task)
    _, expected, _ = _train(task, params, model_state, batches)
    step, state, _ = _train(task, params, model_state, batches, sharding=StateSharding("fsdp"))
    _assert_close(jax.device_get(state.params), expected.params)
    assert step.paced_layers == 3  # the embedding, the scan, the norm with the tied head
    with pytest.raises(ValueError, match=r"model\.tie_embeddings=True makes one table"):
        LanguageModel(
            lm_config(corpus_root, **{**tied, "model.scan_layers": False}), Replicas("data", 4)
        ).pipeline_parts(2, None)


def test_scanned_bfloat16_blocks_recomputed_gather_their_kernels_as_bfloat16(
    corpus_root,  # noqa: F811
    monkeypatch,
):
    """Blocks computing in bfloat16 and recomputed in backward (the recipe's ``remat=full``)
    read each float32 parameter through a cast inside the checkpoint: FSDP gathers the casts
    inside the scan and, with each gradient reduce-scattered one layer behind, trains
    exactly as when it gathers float32 and scatters each gradient in turn."""
    from jaxdist.training import fsdp_scan

    overrides = {
        "model.num_layers": 2,
        "model.d_model": 32,
        "model.scan_layers": True,
        "model.remat": "full",
        "model.dtype": "bfloat16",
    }
    task = LanguageModel(lm_config(corpus_root, **overrides), Replicas("data", 4))
    params, model_state = task.init_variables(jax.random.key(0))
    batches = _batches(task)

    def train(scatter_behind):
        sharding = StateSharding("fsdp", scatter_behind=scatter_behind)
        step, state, metrics = _train(task, params, model_state, batches, sharding=sharding)
        text = step.lower(state, step.shard_batch(batches[0]), jax.random.key(1)).as_text()
        sent = re.findall(r"collective_permute.*: \(tensor<[\dx]*x(\w+)>\)", text)
        return state, metrics, sent.count("bf16")

    narrow, narrow_metrics, narrow_bf16 = train(scatter_behind=True)
    own_dtypes = lambda params, eqns: [jnp.dtype(p.aval.dtype) for p in params]  # noqa: E731
    monkeypatch.setattr(fsdp_scan, "gather_dtypes", own_dtypes)
    wide, wide_metrics, wide_bf16 = train(scatter_behind=False)
    assert narrow_bf16 > wide_bf16  # the scanned blocks' gathers travel as bfloat16
    assert float(narrow_metrics["loss"]) == float(wide_metrics["loss"])
    for a, b in zip(jax.tree.leaves(narrow.params), jax.tree.leaves(wide.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow  # two scanned runs with dropout: about 25 s
def test_scanned_fsdp_with_dropout_and_saved_products_equals_its_replicated_run(corpus_root):  # noqa: F811
    """Dropout draws per layer from keys scanned beside the parameters, and ``remat=dots``
    keeps the products' outputs: FSDP over 4 devices equals the replicated scanned model;
    the program's collectives do not grow with depth."""
    overrides = {
        "model.d_model": 32,
        "model.scan_layers": True,
        "model.remat": "dots",
        "model.dropout": 0.1,
    }
    task = LanguageModel(
        lm_config(corpus_root, **overrides, **{"model.num_layers": 2}), Replicas("data", 4)
    )
    params, model_state = task.init_variables(jax.random.key(0))
    batches = _batches(task)
    _, expected, expected_metrics = _train(task, params, model_state, batches)
    _, state, metrics = _train(task, params, model_state, batches, sharding=StateSharding("fsdp"))
    _assert_close(state.params, expected.params)
    np.testing.assert_allclose(float(metrics["loss"]), float(expected_metrics["loss"]), atol=2e-6)

    def permutes(num_layers):
        deeper = LanguageModel(
            lm_config(corpus_root, **overrides, **{"model.num_layers": num_layers}),
            Replicas("data", 4),
        )
        p, m = deeper.init_variables(jax.random.key(0))
        s = TrainStep(
            deeper.loss,
            optax.sgd(0.1),
            meshes.ring(4),
            communication=Communication("ring"),
            sharding=StateSharding("fsdp"),
            stacked_layers=deeper.stacked_layers(),
        )
        state = s.init(p, m)
        text = s.lower(state, s.shard_batch(batches[0]), jax.random.key(1)).as_text()
        return text.count("collective_permute")

    assert permutes(2) == permutes(6) > 0


def test_stacked_leaves_split_below_the_layer_axis_and_scans_refuse_stage_cuts(corpus_root):  # noqa: F811
    params = {"stack": np.zeros((4, 8, 256)), "embed": np.zeros((4, 512))}
    flat = Placement.of(params, 4, unit_bytes=None)
    assert flat.dims == (0, 0)
    stacked = Placement.of(params, 4, unit_bytes=None, stacked={"stack": True, "embed": False})
    assert stacked.dims == (0, 1)  # tree order: embed, stack
    task = LanguageModel(lm_config(corpus_root, **{"model.scan_layers": True}), Replicas("data", 1))
    with pytest.raises(ValueError, match=r"model.scan_layers=True .*set model.scan_layers=False"):
        task.pipeline_parts(2, None)
    with pytest.raises(
        ValueError, match=r"model.remat must be one of none, full, dots; got 'some'"
    ):
        LanguageModel(lm_config(corpus_root, **{"model.remat": "some"}), Replicas("data", 1))


def test_rotary_positions_make_scores_depend_on_the_distance_alone():
    """Turned by rotary positions, a query at m and a key at n score alike for every pair at
    the same distance m - n; unturned, they would score alike at every distance."""
    from jaxdist.models.transformer import rotary

    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(2, 1, 1, 8)).astype(np.float32)
    length = 12
    turned_q = rotary(np.broadcast_to(q, (length, 1, 8)))[:, 0]
    turned_k = rotary(np.broadcast_to(k, (length, 1, 8)))[:, 0]
    scores = np.asarray(turned_q @ turned_k.T)  # [m, n]
    for distance in (0, 3, 7):
        diagonal = np.diagonal(scores, offset=-distance)
        np.testing.assert_allclose(diagonal, diagonal[0], rtol=1e-5, atol=1e-5)
    assert not np.allclose(scores[5, 5], scores[5, 2])


@pytest.mark.slow  # blocked and whole attention trained: about 20 s
def test_attention_in_blocks_of_queries_is_the_whole_attention():
    """Queries in blocks of 4 (each block's scores recomputed in backward) give the loss and
    gradients of attention over all 16 at once, with grouped-query heads and rotary
    positions."""
    from flax import nnx

    from jaxdist.models.nnx_model import NnxModel
    from jaxdist.models.transformer import BlockShape, Transformer

    def model(chunk):
        shape = BlockShape(4, head_dim=8, num_kv_heads=2, rotary=True, attention_chunk=chunk)
        return NnxModel(
            Transformer(
                vocab_size=32,
                max_len=16,
                num_layers=2,
                d_model=16,
                num_heads=4,
                shape=shape,
                rngs=nnx.Rngs(0),
            )
        )

    whole, blocked = model(0), model(4)
    params, model_state = whole.variables()
    tokens = np.random.default_rng(0).integers(0, 32, (2, 16))

    def loss(m):
        return lambda p: (m.apply(p, model_state, tokens)[0] ** 2).mean()

    expected, expected_grads = jax.jit(jax.value_and_grad(loss(whole)))(params)
    value, grads = jax.jit(jax.value_and_grad(loss(blocked)))(params)
    np.testing.assert_allclose(float(value), float(expected), rtol=1e-6)
    _assert_close(grads, expected_grads)
    text = str(jax.make_jaxpr(jax.grad(loss(blocked)))(params))
    assert "checkpoint" in text or "remat" in text  # each block's scores recomputed
    with pytest.raises(ValueError, match=r"model\.attention_chunk=5 must divide the 16 positions"):
        model(5).apply(params, model_state, tokens)

"""Tasks that are not image classification through the whole trainer: the NNX byte-level
language model (data-parallel steps equal one-device training, a resume is bitwise exact) and
a recipe that defines its own task inline; NNX modules with dropout and BatchNorm in a step."""

import json
import math
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxdist import meshes
from jaxdist.data.byte_corpus import ByteCorpus, stdlib_root, unigram_bits_per_byte
from jaxdist.models.nnx_model import NnxModel
from jaxdist.run.config import load_recipe, recipe_task
from jaxdist.run.trainer import Trainer
from jaxdist.tasks import Replicas
from jaxdist.tasks.language_model import LanguageModel
from jaxdist.training.step_options import Communication
from jaxdist.training.train_step import TrainStep
from tests._procs import JAXDIST, clean_env
from tests._step_options import records

ROOT = Path(__file__).resolve().parents[1]
LM_RECIPE = ROOT / "recipes" / "transformer_lm.py"


@pytest.fixture(scope="module")
def corpus_root(tmp_path_factory):
    """A few small text files: a corpus that reads in no time."""
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "x", "y", "(", ")"]
    for i in range(24):
        lines = [" ".join(rng.choice(words, 8)) for _ in range(40)]
        (root / f"module_{i:02d}.py").write_text("\n".join(lines))
    return root


def lm_config(corpus_root, **overrides):
    config = load_recipe(LM_RECIPE)
    # The small model unrolled, keeping its activations; a test that scans or recomputes
    # says so (the recipe's own defaults are tested by the recipe tests).
    config.model.scan_layers, config.model.remat = False, "none"
    config.data.root = str(corpus_root)
    config.data.held_out_every = 4
    config.data.seq_len = 16
    config.data.max_train_bytes = config.data.max_eval_bytes = 0
    config.model.num_layers, config.model.d_model, config.model.num_heads = 1, 32, 2
    config.batch_size = 8
    config.eval_batch_size = 16
    config.max_steps = 6
    config.checkpoint.every_steps = 3
    config.checkpoint.async_save = False
    config.log_every_steps = 2
    config.eval_every_epochs = 0.0
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node = config
        for name in parents:
            node = node[name]
        node[leaf] = value
    return config


def test_the_corpus_split_is_fixed_by_file_names_and_the_baseline_is_the_byte_entropy(
    corpus_root,
):
    corpus = ByteCorpus(corpus_root, seq_len=16, held_out_every=4)
    again = ByteCorpus(corpus_root, seq_len=16, held_out_every=4)
    np.testing.assert_array_equal(corpus.train_bytes, again.train_bytes)
    assert 0 < len(corpus.eval_bytes) < len(corpus.train_bytes)
    windows = corpus.windows(corpus.train_bytes)
    assert windows.shape[1] == 17 and windows.size <= len(corpus.train_bytes)
    # One byte value only: the baseline is log2 of the smoothed probability of that value.
    data = np.full(1000, 65, np.uint8)
    expected = -math.log2(1001 / (1000 + 256))
    assert unigram_bits_per_byte(data, data[:10]) == pytest.approx(expected)
    assert stdlib_root().joinpath("os.py").is_file()  # the default corpus is where we look


def test_the_language_model_data_parallel_step_equals_one_device_training(corpus_root):
    """Two devices with the ring schedule and one device, the same global batches: the
    gradients are means over equal shards, so the parameters agree to float rounding. (SGD:
    Adam's first step scales each gradient to +-lr, also the attention key bias's, whose
    gradient is zero but for rounding.)"""
    config = lm_config(corpus_root)
    task = LanguageModel(config, Replicas("data", 2))
    params, model_state = task.init_variables(jax.random.key(0))
    it = task.data.train_iterator(8)
    batches = [next(it) for _ in range(3)]
    it.close()

    def train(mesh, **options):
        step = TrainStep(task.loss, optax.sgd(0.5, momentum=0.9), mesh, **records(**options))
        state = step.init(params, model_state)
        for batch in batches:
            state, metrics = step(state, step.shard_batch(batch), jax.random.key(1))
        return state, metrics

    one, _ = train(meshes.ring(1, axis_name="data"))
    two, metrics = train(meshes.ring(2, axis_name="data"), allreduce="ring", bucket_bytes=4096)
    for a, b in zip(jax.tree.leaves(two.params), jax.tree.leaves(one.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=2e-6)
    assert np.isfinite(float(metrics["loss"])) and "bits_per_byte" in metrics


def test_the_language_model_resumes_bitwise_and_reports_bits_per_byte(corpus_root, tmp_path):
    """A run stopped after step 4 (checkpoint at 3) and resumed ends with the bits of an
    uninterrupted run; the eval reports bits per byte beside the unigram baseline."""
    config = lm_config(corpus_root, allreduce="ring")
    task = recipe_task(LM_RECIPE)
    whole = Trainer(config, tmp_path / "whole", task=task)
    summary = whole.run()
    assert 0 < summary["bits_per_byte"] < 9  # six steps: far from trained, but finite
    assert summary["unigram_bits_per_byte"] == pytest.approx(
        whole.parts.task.baseline_bits_per_byte
    )

    class Stop(Exception):
        pass

    def stop_at_4(step, state):
        if step == 4:
            raise Stop

    with pytest.raises(Stop):
        Trainer(config, tmp_path / "resumed", task=task).run(on_step=stop_at_4)
    resumed = Trainer(config, tmp_path / "resumed", task=task)
    resumed.run()
    for a, b in zip(jax.tree.leaves(resumed.state), jax.tree.leaves(whole.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    evals = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").open()]
    assert [e for e in evals if e["kind"] == "eval"][-1]["bits_per_byte"] > 0


class TinyNet(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 3, rngs=rngs)
        self.norm = nnx.BatchNorm(3, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.dropout(self.norm(self.dense(x)))


def test_an_nnx_module_with_dropout_and_batchnorm_trains_in_a_step():
    """Its RNG streams stay out of the state (no key-typed arrays for the step to place), the
    step's rng drives dropout, and the BatchNorm statistics come back as model state."""
    model = NnxModel(TinyNet(nnx.Rngs(0)))
    params, model_state = model.variables()

    def loss_fn(params, model_state, batch, rng):
        out, model_state = model.apply(params, model_state, batch["x"], rng=rng)
        return jnp.mean(out**2), (model_state, {})

    step = TrainStep(loss_fn, optax.sgd(0.1), meshes.ring(2, axis_name="data"))
    state = step.init(params, model_state)
    batch = {"x": np.arange(32, dtype=np.float32).reshape(8, 4) / 32}
    state, _ = step(state, step.shard_batch(batch), jax.random.key(1))
    assert not np.allclose(state.model_state["norm"]["mean"], 0)
    a, _ = model.apply(state.params, state.model_state, batch["x"], rng=jax.random.key(1))
    b, _ = model.apply(state.params, state.model_state, batch["x"], rng=jax.random.key(2))
    assert not np.array_equal(a, b)  # dropout follows the rng it is given
    evaluated, _ = model.apply(state.params, state.model_state, batch["x"], train=False)
    assert np.all(np.asarray(evaluated) != 0)  # no dropout in eval mode
    with pytest.raises(TypeError, match=r"optax GradientTransformation.*pass tx"):
        TrainStep(
            loss_fn,
            nnx.Optimizer(TinyNet(nnx.Rngs(0)), optax.sgd(0.1), wrt=nnx.Param),
            meshes.ring(2, axis_name="data"),
        )


def test_a_recipe_with_its_own_task_trains_with_jaxdist_train(tmp_path):
    """The README's bring-your-own-model recipe, outside the package, through the command."""
    proc = subprocess.run(
        [
            *JAXDIST,
            "--cpu-devices",
            "2",
            "train",
            str(ROOT / "examples" / "own_task.py"),
            "--workdir",
            str(tmp_path),
            "--set",
            "num_epochs=5.0",
            "--set",
            "eval_every_epochs=5.0",
        ],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "done: step 320, epoch 5.00; mse" in proc.stdout
    evals = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    mse = [e["mse"] for e in evals if e["kind"] == "eval"][-1]
    assert mse < 0.1  # sin(3x) has variance ~0.5: the MLP fitted it
    # Throughput is named by the task's unit: samples here, not images.
    train = [e for e in evals if e["kind"] == "train"]
    assert all(e["samples_per_sec"] > 0 and "images_per_sec" not in e for e in train), train[0]
    assert " samples/s | " in proc.stdout
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model"]["name"] == "sine_mlp"


@pytest.mark.parametrize(
    "schedule, remat", [("gpipe", "none"), pytest.param("1f1b", "full", marks=pytest.mark.slow)]
)
def test_the_language_model_pipeline_step_equals_one_device_training(corpus_root, schedule, remat):
    """The NNX transformer cut into two stages over a data x stage mesh (4 x 2), two
    micro-batches per replica: the whole model after three steps is the one-device model
    (which keeps its activations; the 1F1B stages recompute theirs, ``model.remat``)."""
    from jaxdist.pipeline.step import PipelineStep

    config = lm_config(corpus_root, **{"model.num_layers": 2})
    task = LanguageModel(config, Replicas("data", 1))
    params, model_state = task.init_variables(jax.random.key(0))
    staged = LanguageModel(
        lm_config(corpus_root, **{"model.num_layers": 2, "model.remat": remat}), Replicas("data", 1)
    )
    it = task.data.train_iterator(16)
    batches = [next(it) for _ in range(3)]
    it.close()
    optimizer = optax.sgd(0.5, momentum=0.9)

    single = TrainStep(task.loss, optimizer, meshes.ring(1, axis_name="data"))
    expected = single.init(params, model_state)
    for batch in batches:
        expected, _ = single(expected, single.shard_batch(batch), jax.random.key(1))

    parts = staged.pipeline_parts(2, None)  # 4 layers: embedding, 2 blocks, head
    step = PipelineStep(
        parts.stages,
        parts.loss,
        optimizer,
        meshes.for_run("", stages=2),
        microbatches=2,
        schedule=schedule,
        inputs=parts.inputs,
        split=parts.split,
        communication=Communication("ring"),
    )
    state = step.init(params, model_state)
    for batch in batches:
        state, metrics = step(state, step.shard_batch(batch), jax.random.key(1))
    whole, _ = step.whole_variables(state)
    assert jax.tree.structure(whole) == jax.tree.structure(expected.params)
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(expected.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=2e-6)
    assert "bits_per_byte" in metrics


def test_stages_join_by_name_at_every_depth_and_refuse_what_would_be_lost():
    from jaxdist.pipeline.state import join_stages

    params, _ = join_stages(
        [{"blocks": {0: 1}, "embed": 2}, {"blocks": {1: 3}, "head": 4}], [{}, {}]
    )
    assert params == {"blocks": {0: 1, 1: 3}, "embed": 2, "head": 4}
    with pytest.raises(
        ValueError, match=r"stages 0 and 1 both hold parameters named 'layers_0/kernel'"
    ):
        join_stages([{"layers_0": {"kernel": 1}}, {"layers_0": {"kernel": 2}}], [{}, {}])
    with pytest.raises(
        ValueError, match=r"stage 1's parameters are a list; .* each must be a dict"
    ):
        join_stages([{"a": 1}, [1, 2, 3]], [{}, {}])


def test_the_nnx_language_model_trains_with_zero1_and_in_bfloat16(corpus_root):
    """ZeRO-1 (an element-wise optimizer, state sharded over 2 devices) gives the parameters
    of the replicated update; ``model.dtype=bfloat16`` computes in bfloat16 and keeps
    float32 parameters."""
    config = lm_config(corpus_root)
    task = LanguageModel(config, Replicas("data", 2))
    params, _ = task.init_variables(jax.random.key(0))
    it = task.data.train_iterator(8)
    batches = [next(it) for _ in range(2)]
    it.close()
    mesh = meshes.ring(2, axis_name="data")

    def train(task, **options):
        step = TrainStep(
            task.loss,
            optax.sgd(0.5, momentum=0.9),
            mesh,
            **records(allreduce="ring", **options),
        )
        state = step.init(*task.init_variables(jax.random.key(0)))
        for batch in batches:
            state, metrics = step(state, step.shard_batch(batch), jax.random.key(1))
        return state, metrics

    replicated, _ = train(task)
    sharded, _ = train(task, sharding="zero1")
    for a, b in zip(
        jax.tree.leaves(sharded.params), jax.tree.leaves(replicated.params), strict=True
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=2e-6)

    half = LanguageModel(lm_config(corpus_root, **{"model.dtype": "bfloat16"}), Replicas("data", 2))
    state, metrics = train(half)
    assert {leaf.dtype for leaf in jax.tree.leaves(state.params)} == {np.dtype("float32")}
    assert np.isfinite(float(metrics["loss"]))
    assert len(params) == len(state.params)


@pytest.mark.slow  # remat and plain steps compiled and read: about 20 s
def test_remat_recomputes_each_block_and_fsdp_paces_it_as_one_unit(corpus_root):
    """``model.remat=full`` keeps only each block's input and recomputes the block in the
    backward pass; under FSDP each block is then gathered whole. Two steps on 2 devices
    equal the replicated model that keeps its activations."""
    config = lm_config(corpus_root, **{"model.num_layers": 2})
    task = LanguageModel(config, Replicas("data", 2))
    remat = LanguageModel(
        lm_config(corpus_root, **{"model.num_layers": 2, "model.remat": "full"}),
        Replicas("data", 2),
    )
    params, model_state = task.init_variables(jax.random.key(0))
    it = task.data.train_iterator(8)
    batches = [next(it) for _ in range(2)]
    it.close()
    mesh = meshes.ring(2, axis_name="data")
    rng = jax.random.key(1)

    def backward(task):  # the gradient's program, as text
        return str(
            jax.make_jaxpr(jax.grad(lambda p: task.loss(p, model_state, batches[0], rng)[0]))(
                params
            )
        )

    assert "remat" in backward(remat) and "remat" not in backward(task)  # recomputed, not kept

    def train(task, **options):
        step = TrainStep(
            task.loss,
            optax.adam(1e-3),
            mesh,
            **records(allreduce="ring", **options),
        )
        state = step.init(params, model_state)
        for batch in batches:
            state, _ = step(state, step.shard_batch(batch), rng)
        return state

    replicated = train(task)
    sharded = train(remat, sharding="fsdp")
    for a, b in zip(
        jax.tree.leaves(sharded.params), jax.tree.leaves(replicated.params), strict=True
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=2e-6)


def test_the_task_docstring_example_trains(tmp_path):
    """jaxdist.tasks.task's example, as written there: it names what exists and fits the
    regression through the trainer."""
    import textwrap

    from jaxdist.run.config import base_config
    from jaxdist.tasks import task as task_module

    doc = task_module.__doc__
    start = doc.index("::\n\n") + 4
    end = doc.index("\n\n", doc.index("def get_task", start))
    rng = np.random.default_rng(0)
    x, xv = rng.standard_normal((512, 8), np.float32), rng.standard_normal((64, 8), np.float32)
    w = rng.standard_normal((8, 1), np.float32)
    namespace = {"x": x, "y": x @ w, "xv": xv, "yv": xv @ w}
    exec(textwrap.dedent(doc[start:end]), namespace)
    config = base_config()
    config.model.name = "regression"
    config.batch_size, config.num_epochs, config.lr.warmup_epochs = 64, 4.0, 0.0
    config.eval_every_epochs, config.eval_batch_size = 4.0, 64
    config.checkpoint.every_steps, config.tensorboard = 0, "off"
    summary = Trainer(config, tmp_path, task=namespace["get_task"]).run()
    assert summary["mse"] < 0.1 * float(np.mean((xv @ w) ** 2)), summary

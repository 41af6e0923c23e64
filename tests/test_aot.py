"""Deviceless TPU compilation: train steps compiled for TPU slices with the TPU compiler.

The compile tests need libtpu (``pip install -e '.[tpu]'``) and skip without it; the parsing,
bisection and schedule-reading tests run everywhere.
"""

import json
import subprocess
import sys
from types import SimpleNamespace

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

from jaxdist import meshes
from jaxdist.aot import compile as aot_compile
from jaxdist.aot.batch_search import largest_fitting_batch
from jaxdist.aot.plan import FIT_HINT
from jaxdist.aot.schedule import read_schedule
from jaxdist.aot.topology import (
    CompilerMissing,
    TopologyError,
    libtpu_available,
    parse_topology,
)
from jaxdist.comm import collectives
from jaxdist.training.step_options import Communication
from jaxdist.training.train_step import TrainStep
from tests._procs import REPO
from tests._step_options import records

needs_libtpu = pytest.mark.skipif(
    not libtpu_available(), reason="the TPU compiler is not installed (pip install -e '.[tpu]')"
)


class MLP(nn.Module):
    widths: tuple = (512, 384, 512, 256)

    @nn.compact
    def __call__(self, x):
        for w in self.widths:
            x = nn.relu(nn.Dense(w)(x))
        return nn.Dense(10)(x)


MODEL = MLP()
PARAMS = jax.eval_shape(lambda: MODEL.init(jax.random.key(0), jnp.zeros((1, 256)))["params"])


def loss_fn(params, model_state, batch, rng):
    logits = MODEL.apply({"params": params}, batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, (model_state, {})


# A recipe whose whole model is a two-layer MLP: plans that test the plan's mechanics (meshes,
# links, loops) rather than a model compile in a second instead of ResNet-18's ten.
OWN_TASK = str(REPO / "examples" / "own_task.py")


def batch_of(size):
    return {"x": ((size, 256), jnp.float32), "y": ((size,), jnp.int32)}


@pytest.fixture(scope="module")
def torus_2x2():
    devices = parse_topology("v5e:2x2").devices()
    return Mesh(np.asarray(devices).reshape(2, 2), ("y", "x"))


def compile_step(mesh, batch=64, **options):
    step = TrainStep(loss_fn, optax.sgd(0.1, 0.9), mesh, **records(**options))
    return aot_compile.compile_train_step(step, PARAMS, {}, batch_of(batch))


# ------------------------------------------------------------------ without libtpu


def test_topology_names_parse_and_bad_ones_say_what_is_expected():
    topo = parse_topology("v5p:12x12x24")
    assert (topo.generation, topo.shape, topo.num_chips, topo.num_hosts) == (
        "v5p",
        (12, 12, 24),
        3456,
        864,
    )
    two_slices = parse_topology("v5e:2x2/2")  # half a host of 8 chips each, on 2 hosts
    assert (two_slices.num_chips, two_slices.num_hosts, two_slices.network_groups) == (8, 2, 2)
    gpus = parse_topology("h100:4x8")
    assert (gpus.is_gpu, gpus.num_chips, gpus.num_hosts, gpus.network_groups) == (True, 32, 4, 4)
    with pytest.raises(TopologyError, match="GENERATION:SHAPE"):
        parse_topology("v5e-16")
    with pytest.raises(TopologyError, match="must be one of"):
        parse_topology("v9:2x2")
    with pytest.raises(TopologyError, match="has 3 dimensions"):
        parse_topology("v4:4x4")


def test_a_2d_torus_on_a_3d_slice_is_pointed_to_the_3d_torus():
    from jaxdist.aot.report import torus3d_hint

    def torus(*shape):
        return meshes.MeshSpec("t", "torus2d", tuple(zip(("y", "x"), shape)))

    # 1,024 chips: 32 x 32 takes 2 (32 + 32 - 2) = 124 steps, 8 x 8 x 16 2 (8 + 8 + 16 - 3).
    hint = torus3d_hint(parse_topology("v4:8x8x16"), torus(32, 32), "torus2d")
    assert hint == (
        "  a 3-D torus along the slice's dimensions takes 58 dependent steps a "
        "bucket where this 32 x 32 torus takes 124: --set mesh=torus-2x2x2 --set "
        "allreduce=torus3d"
    )
    # No shorter (v4:2x2x1: 4 steps either way), another schedule, a 2-D slice, GPUs: none.
    assert torus3d_hint(parse_topology("v4:2x2x1"), torus(2, 2), "torus2d") is None
    assert torus3d_hint(parse_topology("v4:8x8x16"), torus(32, 32), "ring") is None
    assert torus3d_hint(parse_topology("v5e:16x16"), torus(16, 16), "torus2d") is None
    assert torus3d_hint(parse_topology("h100:4x8"), torus(4, 8), "torus2d") is None


def test_missing_tpu_compiler_is_one_line_naming_the_install(monkeypatch):
    monkeypatch.setattr("jaxdist.aot.topology.libtpu_available", lambda: False)
    with pytest.raises(CompilerMissing, match=r"pip install 'jaxdist\[tpu\]'"):
        parse_topology("v5e:2x2").devices()


def test_largest_fitting_batch_bisects_to_the_boundary():
    memory = lambda b: 1000 + 37 * b  # noqa: E731
    batch, tried = largest_fitting_batch(memory, capacity=1000 + 37 * 100, start=8)
    assert batch == 100
    assert memory(batch + 1) > 1000 + 37 * 100
    assert len(tried) < 12
    assert largest_fitting_batch(memory, capacity=500, start=8)[0] == 0
    # Sizes the compiler refuses (None) count as not fitting.
    refused_above_50 = lambda b: memory(b) if b <= 50 else None  # noqa: E731
    batch, tried = largest_fitting_batch(refused_above_50, capacity=10**9, start=8)
    assert batch == 50 and tried[64] is None


def test_schedule_reader_finds_collectives_and_the_compute_between():
    text = """HloModule m, is_scheduled=true

%fused (p: f32[4,4]) -> f32[4,4] {
  %p = f32[4,4]{1,0} parameter(0)
  ROOT %c = f32[4,4]{1,0} convolution(%p, %p), dim_labels=bf_io->bf
}

ENTRY %main (a: f32[4,4]) -> f32[4,4] {
  %a = f32[4,4]{1,0} parameter(0)
  %f0 = f32[4,4]{1,0} fusion(%a), kind=kOutput, calls=%fused, metadata={op_name="jit(f)/jvp(m)/dot"}
  %s = (f32[16]{0}, f32[16]{0}, u32[]) collective-permute-start(%a), metadata={op_name="jit(f)/gradient_sync/ppermute"}
  %f1 = f32[4,4]{1,0} fusion(%f0), kind=kOutput, calls=%fused, metadata={op_name="jit(f)/transpose(jvp(m))/dot"}
  %d = f32[16]{0} collective-permute-done(%s)
  %r = f32[4]{0} all-reduce(%a), to_apply=%sum, metadata={op_name="jit(f)/psum"}
  ROOT %f2 = f32[4,4]{1,0} fusion(%f1), kind=kOutput, calls=%fused, metadata={op_name="jit(f)/transpose(jvp(m))/dot"}
}
"""
    schedule = read_schedule(text)
    grads, other = schedule.collectives
    assert (grads.kind, grads.role, grads.asynchronous, grads.nbytes) == (
        "collective-permute",
        "gradients",
        True,
        64,
    )
    assert (grads.backward_between, grads.compute_between) == (1, 1)
    assert (other.kind, other.role, other.asynchronous, other.nbytes) == (
        "all-reduce",
        "other",
        False,
        16,
    )
    assert (schedule.matmuls, schedule.backward_matmuls) == (3, 2)
    assert schedule.backward_during_gradients == 1
    assert schedule.overlapped_backward_fraction == 0.5


def test_schedule_reader_names_combined_collectives_and_library_matmuls():
    # XLA's combiner leaves a merged all-reduce without metadata: its role is its users'.
    # A GPU program hands convolutions to cuDNN as custom calls.
    text = """HloModule m, is_scheduled=true

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %s = f32[8]{0} all-reduce-start(%a), to_apply=%sum, metadata={scheduling_name="s"}
  %c = (f32[4,4]{1,0}, u8[0]{0}) custom-call(%a, %a), custom_call_target="__cudnn$convBackwardFilter", metadata={op_name="jit(f)/transpose(jvp(m))/conv"}
  %d = f32[8]{0} all-reduce-done(%s), metadata={scheduling_name="d"}
  ROOT %u = f32[8]{0} fusion(%d), kind=kLoop, calls=%slice, metadata={op_name="jit(f)/gradient_sync/psum"}
}
"""
    schedule = read_schedule(text)
    (grads,) = schedule.collectives
    assert (grads.role, grads.asynchronous, grads.backward_between) == ("gradients", True, 1)
    assert (schedule.matmuls, schedule.backward_matmuls) == (1, 1)


def test_schedule_reader_follows_an_all_reduce_offloaded_to_the_sparsecore():
    # The TPU compiler can hand an all-reduce to the SparseCore: a call-start / call-done pair
    # running the collective's computation on another thread while the TensorCore computes.
    text = """HloModule m, is_scheduled=true

%fused (p: f32[4,4]) -> f32[4,4] {
  %p = f32[4,4]{1,0} parameter(0)
  ROOT %c = f32[4,4]{1,0} convolution(%p, %p), dim_labels=bf_io->bf
}

%called_computation (p0: f32[3,8], p1: token[]) -> f32[3,8] {
  %p0 = f32[3,8]{1,0} parameter(0)
  %p1 = token[] parameter(1)
  ROOT %ar = f32[3,8]{1,0} all-reduce(%p0), replica_groups={{0,1,2,3}}, to_apply=%sum, metadata={op_name="jit(f)/shard_map/gradient_sync/psum"}
}

ENTRY %main (a: f32[3,8], t: token[]) -> f32[3,8] {
  %a = f32[3,8]{1,0} parameter(0)
  %t = token[] parameter(1)
  %s = ((f32[3,8]{1,0}, token[]), f32[3,8]{1,0}) call-start(%a, %t), async_execution_thread="sparsecore", to_apply=%called_computation
  %f1 = f32[4,4]{1,0} fusion(%a), kind=kOutput, calls=%fused, metadata={op_name="jit(f)/transpose(jvp(m))/dot"}
  %d = f32[3,8]{1,0} call-done(%s)
  ROOT %f2 = f32[4,4]{1,0} fusion(%d), kind=kOutput, calls=%fused, metadata={op_name="jit(f)/transpose(jvp(m))/dot"}
}
"""
    schedule = read_schedule(text, num_devices=8)
    (grads,) = schedule.collectives
    assert (grads.kind, grads.role, grads.asynchronous, grads.nbytes) == (
        "all-reduce",
        "gradients",
        True,
        96,
    )
    assert (grads.group_size, grads.backward_between) == (4, 1)
    assert schedule.overlapped_backward_fraction == 0.5


def test_schedule_reader_names_every_role_its_group_and_what_is_unexplained():
    text = """HloModule m, is_scheduled=true

%ar (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %r = f32[8]{0} all-reduce(%p), replica_groups={{0,1,2,3}}, to_apply=%sum, metadata={op_name="jit(f)/shard_map/gradient_sync/psum"}
}

%step (p: f32[8], q: f32[4,4]) -> f32[4,4] {
  %p = f32[8]{0} parameter(0)
  %q = f32[4,4]{1,0} parameter(1)
  ROOT %c = f32[4,4]{1,0} convolution(%q, %q), dim_labels=bf_io->bf
}

ENTRY %main (a: f32[8], w: f32[4,4]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %w = f32[4,4]{1,0} parameter(1)
  %b = f32[8]{0} all-reduce(%a), replica_groups={{0,1},{2,3}}, to_apply=%sum, metadata={op_name="jit(f)/shard_map/batchnorm_statistics/psum"}
  %m = f32[2]{0} all-reduce(%a), replica_groups=[1,4]<=[4], to_apply=%sum, metadata={op_name="jit(f)/shard_map/metrics_mean/psum"}
  %x = f32[8]{0} all-gather(%a), replica_groups={{0,1,2,3}}, dimensions={0}, metadata={op_name="jit(f)/shard_map/mystery/all_gather"}
  %async-collective-start.3 = (f32[8]{0}, u32[]) fusion(%a), kind=kCustom, calls=%ar
  %f = f32[4,4]{1,0} fusion(%a, %w), kind=kOutput, calls=%step, metadata={op_name="jit(f)/transpose(jvp(m))/dot"}
  ROOT %async-collective-done.3 = f32[8]{0} fusion(%async-collective-start.3), kind=kCustom, calls=%ar, metadata={op_name="jit(f)/shard_map/gradient_sync/psum"}
}
"""
    schedule = read_schedule(text, num_devices=4)
    by_role = {c.role: c for c in schedule.collectives}
    assert set(by_role) == {"batchnorm", "metrics", "other", "gradients"}
    assert by_role["batchnorm"].group_size == 2 and by_role["metrics"].group_size == 4
    assert schedule.unexplained_sources() == {"shard_map/mystery/all_gather": 1}
    # The TPU's async collective fusion: a start and a done fusion with compute between.
    grads = by_role["gradients"]
    assert (grads.kind, grads.asynchronous, grads.group_size, grads.backward_between) == (
        "all-reduce",
        True,
        4,
        1,
    )
    assert schedule.overlapped_backward_fraction == 1.0


def test_other_collectives_are_priced_by_kind_group_and_link():
    from jaxdist.aot.predict import collective_seconds, transfer_pricer
    from jaxdist.aot.schedule import Collective
    from jaxdist.comm.cost_model import Link, Network

    link = Link(alpha=1e-6, beta=1e-9)
    permute = Collective("collective-permute", 1000, False, "batchnorm")
    assert collective_seconds(permute, link) == pytest.approx(1e-6 + 1e-6)
    reduce = Collective("all-reduce", 4000, False, "batchnorm", group_size=4)
    ring = 2 * 3 * (1e-6 + 1000e-9)
    tree = 2 * 2 * (1e-6 + 4000e-9)
    assert collective_seconds(reduce, link) == pytest.approx(min(ring, tree))
    # On a 2-D TPU torus, 4 chips are 2 x 2: rings of 2 along each dimension.
    torus = Link(alpha=1e-6, beta=1e-9, ports=2)
    assert collective_seconds(reduce, torus, torus_dims=2) == pytest.approx(
        2 * 2 * 1 * 1e-6 + 2 * 3 / 4 * 4000e-9 / 2
    )
    gather = Collective("all-gather", 4000, False, "metrics", group_size=4)
    slow = Link(alpha=1e-5, beta=1e-8)
    price = transfer_pricer(Network(link, slow), fast_group=2)
    # Groups of 4 cross the slow network when the fast links join 2 devices: an all-reduce
    # as the library runs it across hosts (inside each pair, then between the pairs).
    inside = min(2 * 1 * (1e-6 + 2000e-9), 2 * 1 * (1e-6 + 4000e-9))
    between = min(2 * 1 * (1e-5 + 1000e-8), 2 * 1 * (1e-5 + 2000e-8))
    assert price(reduce, None) == pytest.approx(inside + between)
    assert price(gather, None) == pytest.approx(3 * (1e-5 + 1000e-8))
    # A permute crosses when one of its pairs joins two groups.
    pairs = lambda text: SimpleNamespace(rest=f"%x), source_target_pairs={text}")  # noqa: E731
    assert price(permute, pairs("{{0,1},{1,0}}")) == pytest.approx(1e-6 + 1000e-9)
    assert price(permute, pairs("{{1,2},{2,1}}")) == pytest.approx(1e-5 + 1000e-8)


def test_cpu_runs_never_load_the_tpu_compiler():
    # The test set-up pins JAX to the CPU; with libtpu installed nothing may probe for a TPU.
    code = (
        "import jax; from jax._src.lib import xla_client; jax.devices(); import jaxdist.aot.topology; "
        "print(jax.default_backend(), xla_client.pjrt_plugin_loaded('tpu'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"},
    )
    assert out.stdout.split() == ["cpu", "False"]
    assert "TPU" not in out.stderr


# ------------------------------------------------------------------ with libtpu


@needs_libtpu
def test_the_tpus_fused_reduce_scatter_is_read_and_priced_as_one(torus_2x2):
    """On a slice of one host the TPU compiler runs a reduce-scatter of rows as an
    ``all-reduce-scatter`` fusion with no metadata: the plan reads it as a reduce-scatter of
    the fusion's bytes over its group, in the role the traced reduce-scatter had, and its
    walk prices it (before, neither saw it: the sequence-parallel sums of ``native`` tensor
    parallelism went uncounted)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxdist.aot.schedule import read_schedule, rewritten_scatter_roles
    from jaxdist.aot.timeline import walk
    from jaxdist.comm.scopes import GRADIENT_SCOPE

    spec = P(("y", "x"))
    rows = jax.ShapeDtypeStruct(
        (4 * 128, 1024), jnp.bfloat16, sharding=NamedSharding(torus_2x2, spec)
    )

    def step(g):
        with jax.named_scope(GRADIENT_SCOPE):
            return jax.lax.psum_scatter(jnp.tile(g, (4, 1)) * 2, ("y", "x"), tiled=True)

    lowered = jax.jit(jax.shard_map(step, mesh=torus_2x2, in_specs=spec, out_specs=spec)).lower(
        rows
    )
    text = lowered.compile().as_text()
    assert "all-reduce-scatter" in text
    roles = rewritten_scatter_roles(lowered.as_text(dialect="hlo", debug_info=True), 4)
    [scatter] = read_schedule(text, num_devices=4, scatter_roles=roles).collectives
    assert (scatter.kind, scatter.nbytes, scatter.group_size, scatter.role) == (
        "reduce-scatter",
        128 * 1024 * 2,
        4,
        "gradients",
    )
    timeline = walk(
        text,
        1e-3,
        lambda collective, inst: 2e-3,
        peak_flops=1e14,
        hbm_bandwidth=1e11,
        num_devices=4,
        scatter_roles=roles,
    )
    assert timeline.gradient_seconds == pytest.approx(2e-3)


@needs_libtpu
def test_fsdp_native_gathers_stay_all_gathers_on_the_tpu(torus_2x2, monkeypatch):
    """A unit whose pieces end mid-tile (1,037 bfloat16 values a device) is padded to whole
    1,024-element tiles before XLA's all-gather: unpadded, the TPU compiler turns the gather
    into an all-reduce of a zero-filled whole-sized buffer (three whole-sized buffers and
    twice the bytes)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxdist.training import sharding

    blocks = [
        jax.ShapeDtypeStruct(
            (4 * 25, 40), jnp.bfloat16, sharding=NamedSharding(torus_2x2, P(("y", "x")))
        ),
        jax.ShapeDtypeStruct(
            (4 * 37,), jnp.bfloat16, sharding=NamedSharding(torus_2x2, P(("y", "x")))
        ),
    ]

    def gathered_sum(a, b):
        whole = sharding.gather_unit([a, b], [0, 0], ("y", "x"), "native", {})
        assert [w.shape for w in whole] == [(100, 40), (148,)]
        return sum(w.astype(jnp.float32).sum() for w in whole)[None]

    def compiled_text():
        step = jax.shard_map(
            gathered_sum, mesh=torus_2x2, in_specs=(P(("y", "x")),) * 2, out_specs=P(("y", "x"))
        )
        return jax.jit(step).lower(*blocks).compile().as_text()

    text = compiled_text()
    assert "all-gather" in text and "all-reduce" not in text
    monkeypatch.setattr(collectives.sharded, "GATHER_ALIGNMENT", 1)
    assert "all-reduce" in compiled_text()  # what the padding prevents


@needs_libtpu
@pytest.mark.parametrize(
    "algorithm", [a for a in collectives.ALGORITHMS if a not in collectives.THREE_LEVEL]
)
def test_every_allreduce_compiles_for_a_tpu_slice(torus_2x2, algorithm):
    report = compile_step(torus_2x2, allreduce=algorithm, data_axes=("y", "x"))
    grads = [c for c in report.schedule.collectives if c.role == "gradients"]
    assert grads, "no gradient collective in the compiled program"
    assert report.flops > 0 and report.memory.total > 0


@needs_libtpu
@pytest.mark.slow  # a ResNet compile for a v4 slice: about 30 s
def test_the_3d_torus_is_laid_over_a_v4_slice_and_paced_beside_backward(capsys):
    from jaxdist.cli import main

    # The recipe's torus3d layout (a mesh of 8) over a slice of 16 chips: its dimensions,
    # the last outermost; every ring step of every bucket a permute of the compiled step.
    code = main(
        [
            "plan",
            "mnist_small_batch",
            "--topology",
            "v4:2x2x4",
            "--efficiency",
            "0.3",
            "--set",
            "mesh=torus-2x2x2",
            "--set",
            "allreduce=torus3d",
            "--set",
            "wait_free=True",
            "--set",
            "eval_batch_size=1024",
            "--json",
        ]
    )
    assert code == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["mesh"] == {"z": 4, "y": 2, "x": 2}
    assert "torus3d layout over the slice" in plan["mesh_note"]
    stage = plan["stages"][0]
    grads = [c for c in stage["collectives"] if c["role"] == "gradients"]
    assert {c["kind"] for c in grads} == {"collective-permute"}
    assert 0 < stage["gradient_hidden_fraction"] <= 1
    # A slice of two dimensions has no third to lay it over: one line, the usage exit code.
    code = main(
        [
            "plan",
            "mnist_small_batch",
            "--topology",
            "v5e:2x2",
            "--set",
            "mesh=torus-2x2x2",
            "--set",
            "allreduce=torus3d",
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "laid over one TPU slice of three dimensions (v4, v5p), not v5e:2x2" in err
    assert len(err.strip().splitlines()) == 1


@needs_libtpu
@pytest.mark.parametrize(
    "generation", ["v5e:2x2", pytest.param("v4:2x2x1", marks=pytest.mark.slow)]
)
def test_zero1_and_accumulation_compile(generation):
    mesh = Mesh(np.asarray(parse_topology(generation).devices()), ("data",))
    assert compile_step(mesh, sharding="zero1").flops > 0
    assert compile_step(mesh, accumulation_steps=2).flops > 0


@needs_libtpu
def test_gradient_collectives_are_async_and_overlap_backward_with_several_buckets(torus_2x2):
    several = compile_step(torus_2x2, allreduce="ring", data_axes=("y", "x"), bucket_bytes=1 << 19)
    grads = [c for c in several.schedule.collectives if c.role == "gradients"]
    assert all(c.asynchronous for c in grads)
    assert any(c.backward_between > 0 for c in grads)
    assert several.schedule.overlapped_backward_fraction > 0
    one = compile_step(torus_2x2, allreduce="ring", data_axes=("y", "x"), bucket_bytes=None)
    assert all(c.backward_between == 0 for c in one.schedule.collectives if c.role == "gradients")
    assert one.schedule.overlapped_backward_fraction == 0


class DeepMLP(nn.Module):
    """Sixteen layers of 256: a backward pass of many products for the buckets to pace over."""

    @nn.compact
    def __call__(self, x):
        for _ in range(16):
            x = nn.relu(nn.Dense(256)(x))
        return nn.Dense(10)(x)


@needs_libtpu
@pytest.mark.slow  # paced and unpaced TPU compiles: about 25 s
def test_wait_free_steps_run_beside_backward_and_hide_their_time(torus_2x2):
    """Left to the compiler, each bucket's ring runs as a chain after backward; paced, its
    steps bracket backward's matrix products and most of their time is hidden."""
    from jaxdist.aot.chips import CHIPS, network_for
    from jaxdist.aot.predict import predict_step

    model = DeepMLP()
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 256)))["params"])

    def deep_loss(params, model_state, batch, rng):
        logits = model.apply({"params": params}, batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, (model_state, {})

    chip = CHIPS["v5e"]
    measured = {}
    for wait_free in (False, True):
        step = TrainStep(
            deep_loss,
            optax.sgd(0.1, 0.9),
            torus_2x2,
            communication=Communication("ring", bucket_bytes=1 << 20, wait_free=wait_free),
            data_axes=("y", "x"),
        )
        report = aot_compile.compile_train_step(step, params, {}, batch_of(16384))
        grads = report.schedule.gradient_collectives
        assert len(grads) == 6 * len(step.buckets) and all(c.asynchronous for c in grads)
        time = predict_step(report, chip, efficiency=0.2, network=network_for(chip))
        assert time.total == pytest.approx(time.timeline.step_seconds)
        beside = sum(c.backward_between > 0 for c in grads) / len(grads)
        measured[wait_free] = (time.hidden_fraction, beside)
    (serial_hidden, serial_beside), (paced_hidden, paced_beside) = measured[False], measured[True]
    # Paced, far more steps have a product inside their window, and half the time is hidden.
    assert paced_beside > 2 * serial_beside, measured
    assert paced_hidden >= 0.5 and paced_hidden > serial_hidden + 0.1, measured


@needs_libtpu
def test_zero1_divides_optimizer_state_per_chip(torus_2x2):
    plain = compile_step(torus_2x2, data_axes=("y", "x"))
    sharded = compile_step(torus_2x2, data_axes=("y", "x"), sharding="zero1")
    assert sharded.memory.optimizer_state == pytest.approx(
        plain.memory.optimizer_state / 4, rel=0.01
    )
    # The compiler's own argument bytes drop by the same three quarters of the momentum.
    dropped = plain.memory.arguments - sharded.memory.arguments
    assert dropped == pytest.approx(0.75 * plain.memory.optimizer_state, rel=0.05)


@needs_libtpu
@pytest.mark.slow  # a batch search of TPU compiles: about 40 s
def test_hbm_grows_with_the_batch(torus_2x2):
    small, large = (compile_step(torus_2x2, batch=b, data_axes=("y", "x")) for b in (64, 65536))
    assert large.memory.temp > small.memory.temp
    assert large.memory.arguments > small.memory.arguments
    assert large.flops > 4 * small.flops


def gradients_in_loops(plan_json: dict) -> int:
    rows = plan_json["stages"][0]["collectives"]
    return sum(r["in_loop"] for r in rows if r["role"] == "gradients")


@needs_libtpu
def test_plan_command_prints_memory_overlap_time_to_train_and_the_links_given(capsys):
    from jaxdist.cli import main
    from jaxdist.run.config import base_config

    # ResNet-10 for the recipe's ResNet-18: the plan's figures, not the model, are checked here
    # (the 3-D torus test below plans the recipe's own model).
    code = main(
        [
            "plan",
            "mnist_small_batch",
            "--topology",
            "v5e:2x2",
            "--efficiency",
            "0.4",
            "--set",
            "num_epochs=2",
            "--set",
            "allreduce=ring",
            "--fast-link",
            "1ms:1GB/s",
            "--set",
            "model.name=resnet10",
            "--json",
        ]
    )
    assert code == 0
    plan = json.loads(capsys.readouterr().out)
    # The default unroll limit: a ring over 4 chips has 3 steps each way, all unrolled.
    assert base_config().unroll_limit == collectives.UNROLL_LIMIT
    assert gradients_in_loops(plan) == 0
    stage = plan["stages"][0]
    assert plan["chips"] == 4 and stage["fits"] is True
    assert stage["memory_bytes"]["total"] <= stage["memory_bytes"]["capacity"]
    assert stage["flops_per_chip"] > 0 and stage["step_seconds"]["total"] > 0
    seconds = stage["step_seconds"]
    # At 1 ms a message the permutes outlast the compute: most of their time is exposed.
    assert 0 <= seconds["hidden"] < 0.5 * seconds["communication"]
    assert stage["gradient_hidden_fraction"] == pytest.approx(
        seconds["hidden"] / seconds["communication"]
    )
    assert seconds["total"] >= seconds["compute"] + seconds["communication"] - seconds["hidden"]
    assert plan["time_to_train"][0]["steps"] == 2 * 4000 // 32 + (2 * 4000 % 32 > 0)
    links = plan["links"]
    assert (links["fast"]["latency_s"], links["fast"]["bytes_per_s"]) == pytest.approx((1e-3, 1e9))
    assert links["sources"]["fast"] == "given: 1ms:1GB/s"
    assert plan["mlperf_reference"] is None  # MLPerf's reference points are ResNet-50's


@needs_libtpu
def test_flops_count_every_micro_batch(torus_2x2):
    # A batch large enough that the update, counted once per micro-batch, is a small share.
    one = compile_step(torus_2x2, batch=4096, data_axes=("y", "x"))
    accumulated = compile_step(torus_2x2, batch=4096, data_axes=("y", "x"), accumulation_steps=4)
    assert accumulated.flops == pytest.approx(one.flops, rel=0.02)


@needs_libtpu
def test_accumulated_steps_overlap_the_last_micro_batch_backward(torus_2x2):
    report = compile_step(
        torus_2x2,
        allreduce="ring",
        data_axes=("y", "x"),
        bucket_bytes=1 << 19,
        accumulation_steps=2,
    )
    grads = report.schedule.gradient_collectives
    assert all(c.asynchronous and not c.in_loop for c in grads)
    assert report.schedule.overlapped_backward_fraction > 0


def test_plan_refuses_an_unknown_topology_and_a_mesh_of_another_size(capsys):
    from jaxdist.cli import main

    assert main(["plan", "mnist_small_batch", "--topology", "v9:2x2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "must be one of" in err
    code = main(
        [
            "plan",
            "mnist_small_batch",
            "--topology",
            "v5e:2x2",
            "--mesh",
            "torus-4x2",
            "--efficiency",
            "0.4",
        ]
    )
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "jaxdist plan: mesh 'torus-4x2' has 8 devices, topology v5e:2x2 has 4 chips: give a "
        "mesh of 4 devices, or no --mesh to lay the recipe's layout over the slice"
    )
    assert main(["plan", "mnist_pipeline", "--topology", "v5e:2x4", "--efficiency", "0.4"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "4-stage pipeline, which the plan's time model does not cover" in err


@needs_libtpu
def test_plan_refuses_bad_links_in_one_line(capsys):
    from jaxdist.cli import main

    base = ["plan", "mnist_small_batch", "--topology", "v5e:2x2", "--efficiency", "0.4"]
    for flag, value, says in [
        ("--fast-link", "fast", "--fast-link: a link is LATENCY:BANDWIDTH"),
        ("--host-link", "10us:1GB/s", "--host-link: v5e:2x2 has no host network"),
    ]:
        assert main([*base, flag, value]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if "compiling" not in line]
        assert len(err) == 1 and says in err[0], err


@needs_libtpu
def test_plan_of_a_recipe_the_compiler_cannot_fit_is_one_line(capsys):
    from jaxdist.cli import main

    code = main(
        [
            "plan",
            "mnist_small_batch",
            "--topology",
            "v5e:2x2",
            "--efficiency",
            "0.4",
            "--set",
            "batch_size=2097152",
            "--set",
            "max_per_device_batch=524288",
        ]
    )
    assert code == 2
    out, err = capsys.readouterr()
    assert out == ""
    progress, error = err.strip().split("\n")  # progress, then the error in one line
    assert progress.startswith("compiling stage 0")
    assert error.startswith(
        "jaxdist plan: stage 0 (global batch 2,097,152, 524288 per chip) does not fit on a "
        "TPU v5e: RESOURCE_EXHAUSTED: Ran out of memory"
    )
    assert error.endswith(FIT_HINT)


def test_a_compiled_plan_over_the_published_capacity_ends_with_one_line(capsys):
    from jaxdist.cli.plan import _fit_verdict

    def plan_with(total):
        memory = SimpleNamespace(total=total)
        stage = SimpleNamespace(index=1, compiled=SimpleNamespace(memory=memory))
        return SimpleNamespace(topology=parse_topology("v5e:2x2"), stages=[stage])

    assert _fit_verdict(plan_with(15.9 * 2**30)) == 0
    assert _fit_verdict(plan_with(17 * 2**30)) == 2
    err = capsys.readouterr().err
    assert err == (
        "jaxdist plan: stage 1 needs 17.00 GiB per chip, 1.00 GiB more than a TPU v5e's "
        f"16.00 GiB: {FIT_HINT}\n"
    )


@needs_libtpu
def test_plan_over_two_slices_runs_the_outer_axis_over_the_data_centre_network(capsys):
    from jaxdist.cli import main

    code = main(
        [
            "plan",
            OWN_TASK,
            "--topology",
            "v5e:2x2/2",
            "--efficiency",
            "0.4",
            "--set",
            "mesh=torus-2x2",
            "--json",
        ]
    )
    assert code == 0
    plan = json.loads(capsys.readouterr().out)
    # The recipe's torus of 4 laid over 8 chips: a slice along the inner axis.
    assert plan["mesh"] == {"y": 2, "x": 4}
    assert plan["links"]["fast"]["bytes_per_s"] == 50e9
    assert plan["links"]["host"]["bytes_per_s"] == 200e9 / 8 / 8  # 2 x 100 Gb/s per 8 chips
    assert plan["chips"] == 8 and plan["stages"][0]["fits"] is True


@needs_libtpu
def test_plan_takes_the_recipes_unroll_limit(capsys, monkeypatch):
    from jaxdist.aot import report
    from jaxdist.cli import main

    # A limit of 2 through the command line (the default unrolls every ring of this plan:
    # test_plan_command_prints_memory_overlap_time_to_train_and_the_links_given): the rings run
    # as loops, and the text says what that costs and how to unroll them (the plan it printed
    # is kept to count them).
    printed = []

    def keep_plan(plan, note, text=report.plan_text):
        printed.append(plan)
        return text(plan, note)

    monkeypatch.setattr(report, "plan_text", keep_plan)
    assert (
        main(
            [
                "plan",
                OWN_TASK,
                "--topology",
                "v5e:2x2",
                "--efficiency",
                "0.4",
                "--set",
                "allreduce=ring",
                "--set",
                "unroll_limit=2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    (plan,) = printed
    in_loops = gradients_in_loops(report.plan_json(plan, ""))
    assert in_loops > 0
    assert f"note: {in_loops:,} gradient collectives per step run inside loops" in out
    assert "--set unroll_limit=4 unrolls them" in out


@needs_libtpu
def test_a_sharded_plan_prints_xla_own_fsdp_of_the_step_beside_it(capsys):
    """An FSDP plan compiles XLA's own FSDP of the same step (a plain jit, the same placement)
    and prints its total beside ours; --no-xla-fsdp skips it."""
    from jaxdist.cli import main

    base = [
        "plan",
        OWN_TASK,
        "--topology",
        "v5e:2x2",
        "--efficiency",
        "0.4",
        "--set",
        "sharding=fsdp",
        "--set",
        "allreduce=ring",
    ]
    assert main([*base, "--json"]) == 0
    stage = json.loads(capsys.readouterr().out)["stages"][0]
    xla = stage["xla_fsdp"]
    ours = stage["memory_bytes"]
    # The same state, laid out alike: the arguments' parameters and optimizer state agree.
    assert xla["refusal"] == "" and xla["compile_seconds"] > 0
    for part in ("parameters", "optimizer_state", "model_state"):
        assert xla["memory_bytes"][part] == ours[part]
    assert xla["memory_bytes"]["total"] > ours["parameters"] + ours["optimizer_state"]
    assert main(base) == 0
    out = capsys.readouterr()
    ratio = ours["total"] / xla["memory_bytes"]["total"]
    assert "XLA's own FSDP of this step (a plain jax.jit, the same placement): total" in out.out
    assert f"ours {ratio:.2f}x it" in out.out
    assert "compiling XLA's own FSDP of stage 0 beside it" in out.err
    assert main([*base, "--no-xla-fsdp"]) == 0
    assert "XLA's own FSDP" not in capsys.readouterr().out


@needs_libtpu
@pytest.mark.slow  # two transformer plans: about a minute
def test_a_scanned_fsdp_plan_counts_every_layer_and_its_loop_as_compute(capsys, monkeypatch):
    """The transformer scanned over 3 blocks under FSDP: its FLOPs per chip are the unrolled
    model's (the compiler counts the scan's body once; the plan every turn), and its
    gradient reduce-scatters inside the scan are not told to unroll."""
    from jaxdist.aot import report
    from jaxdist.cli import main

    planned = []

    def keep_plan(plan, note, as_json=report.plan_json):
        planned.append(plan)
        return as_json(plan, note)

    monkeypatch.setattr(report, "plan_json", keep_plan)

    base = [
        "plan",
        "recipes/transformer_lm.py",
        "--topology",
        "v5e:2x2",
        "--efficiency",
        "0.4",
        "--no-xla-fsdp",
        "--set",
        "sharding=fsdp",
        "--set",
        "model.num_layers=3",
        "--set",
        "model.remat=none",
        "--set",
        "allreduce=native",
        "--set",
        "data.max_train_bytes=65536",
        "--set",
        "data.max_eval_bytes=8192",
    ]
    assert main([*base, "--set", "model.scan_layers=False", "--json"]) == 0
    unrolled = json.loads(capsys.readouterr().out)["stages"][0]
    assert main([*base, "--set", "model.scan_layers=True", "--json"]) == 0
    scanned = json.loads(capsys.readouterr().out)["stages"][0]
    assert scanned["flops_per_chip"] == pytest.approx(unrolled["flops_per_chip"], rel=0.05)
    assert sum(r["in_loop"] for r in scanned["collectives"] if r["role"] == "gradients") > 0
    assert "run inside loops" not in report.plan_text(planned[-1], "")


@needs_libtpu
@pytest.mark.parametrize("schedule", [pytest.param("gpipe", marks=pytest.mark.slow), "1f1b"])
def test_a_pipeline_step_compiles_for_a_tpu_slice(schedule):
    """The pipeline program (a switch per tick, permutes under a per-tick condition, in a
    loop) compiles for TPU chips; each chip's arguments are its stage's, and the stage
    gradients' allreduce over the data axis is found by its role."""
    from test_pipeline_step import Dense, cross_entropy

    from jaxdist.pipeline import stages as pipeline_stages
    from jaxdist.pipeline.step import PipelineStep

    devices = np.asarray(parse_topology("v5e:2x2").devices()).reshape(2, 2)
    mesh = Mesh(devices, ("data", "stage"))
    layers = [Dense(256), Dense(256), Dense(256), Dense(10, last=True)]  # stages of 2 layers
    modules = [pipeline_stages.Chain(g) for g in pipeline_stages.cut(layers, stages=2)]
    x = jax.ShapeDtypeStruct((2, 256), jnp.float32)
    params, states = jax.eval_shape(
        lambda x: pipeline_stages.init_flax_stages(modules, jax.random.key(0), x), x
    )
    step = PipelineStep(
        pipeline_stages.flax_stages(modules),
        cross_entropy,
        optax.adam(1e-3),
        mesh,
        microbatches=4,
        schedule=schedule,
        communication=Communication("ring"),
        inputs=lambda b: b["x"],
    )
    state = step.abstract_init(params, states)
    batch = aot_compile.abstract_batch(
        mesh, step.data_axes, {"x": ((16, 256), jnp.float32), "label": ((16,), jnp.int32)}
    )
    rng = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    compiled = step.lower(state, batch, rng).compile()
    report = read_schedule(compiled.as_text())
    assert any(c.role == "gradients" for c in report.collectives)
    sizes = [sum(leaf.size * 4 for leaf in jax.tree.leaves(p)) for p in params]
    arguments = compiled.memory_analysis().argument_size_in_bytes
    assert 3 * max(sizes) <= arguments < 3 * sum(sizes)  # a stage's params and Adam state


# ------------------------------------------------------------------ slices of 32 chips and more


class NormedMLP(nn.Module):
    """Dense layers each followed by a BatchNorm whose statistics are shared in groups."""

    widths: tuple = (512, 256, 512)
    group_size: int | None = 2

    @nn.compact
    def __call__(self, x, train=True):
        from jaxdist.training.batchnorm import CrossReplicaBatchNorm

        for w in self.widths:
            x = nn.Dense(w)(x)
            x = CrossReplicaBatchNorm(
                use_running_average=not train, axis_name="data", group_size=self.group_size
            )(x)
            x = nn.relu(x)
        return nn.Dense(10)(x)


def _normed_step(mesh, group_size):
    model = NormedMLP(group_size=group_size)
    variables = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((2, 256))))
    params, model_state = variables["params"], {"batch_stats": variables["batch_stats"]}

    def normed_loss(params, model_state, batch, rng):
        logits, updates = model.apply(
            {"params": params, **model_state}, batch["x"], mutable=["batch_stats"]
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, (updates, {})

    step = TrainStep(
        normed_loss,
        optax.sgd(0.1, 0.9),
        mesh,
        communication=Communication("ring", bucket_bytes=1 << 19, options={"unroll_limit": 32}),
    )
    return aot_compile.compile_train_step(step, params, model_state, batch_of(16 * mesh.size))


@needs_libtpu
@pytest.mark.slow  # two ResNet TPU compiles: about 20 s
def test_batchnorm_statistics_move_bytes_of_the_group_not_of_the_slice():
    """On 32 chips with groups of 2, every collective that is not the gradients' moves a
    small multiple of the statistics' bytes: an all-reduce of each norm's statistics over its
    group and its transpose, the running statistics' and the metrics' mean. An all-gather
    over the slice would move 32 times the statistics, twice. The gradients' permutes still
    run beside most of backward."""
    from jaxdist import meshes

    spec = meshes.MeshSpec("ring-32", "ring", (("data", 32),))
    report = _normed_step(meshes.build(spec, parse_topology("v5e:4x8").devices()), group_size=2)
    stats_bytes = sum(2 * w * 4 for w in NormedMLP.widths)  # mean and mean of squares, f32
    other = [c for c in report.schedule.collectives if c.role != "gradients"]
    other_bytes = sum(c.nbytes * c.turns for c in other)
    assert other_bytes <= 4 * stats_bytes, (other_bytes, stats_bytes)
    roles = {c.role for c in other}
    # The metrics' mean is combined with the running statistics' into one all-reduce.
    assert {"batchnorm", "bn running"} <= roles, roles
    assert report.schedule.unexplained_sources() == {}
    batchnorm = [c for c in other if c.role == "batchnorm"]
    assert batchnorm and all(c.kind == "all-reduce" and c.group_size == 2 for c in batchnorm)
    # The gradients' permutes run beside backward all the same.
    assert report.schedule.overlapped_backward_fraction > 0.5


@needs_libtpu
@pytest.mark.parametrize("shape", [(4, 8), pytest.param((32,), marks=pytest.mark.slow)])
def test_rings_on_a_slice_without_wraparound_overlap_backward(shape):
    """The mesh folds each axis over the slice's chips, so the compiler keeps the rings'
    permutes asynchronous beside backward (in physical order it made them synchronous)."""
    from jaxdist import meshes

    names = ("y", "x") if len(shape) == 2 else ("data",)
    spec = meshes.MeshSpec("t", "torus2d" if len(shape) == 2 else "ring", tuple(zip(names, shape)))
    mesh = meshes.build(spec, parse_topology("v5e:4x8").devices())
    algorithm = "torus2d" if len(shape) == 2 else "ring"
    report = compile_step(
        mesh,
        batch=16 * mesh.size,
        allreduce=algorithm,
        data_axes=names,
        bucket_bytes=1 << 19,
        allreduce_options={"unroll_limit": 32},
    )
    grads = report.schedule.gradient_collectives
    assert grads and all(c.asynchronous for c in grads)
    assert report.schedule.overlapped_backward_fraction > 0


@needs_libtpu
def test_an_executable_for_devices_not_here_stays_out_of_the_persistent_cache(torus_2x2):
    """Loading it back would need the TPU's client: every later plan would warn and compile
    again. Programs for this machine's own devices are still written."""
    name = "jax_persistent_cache_min_compile_time_secs"
    previous = getattr(jax.config, name)
    writes = []

    def listen(event, **kwargs):
        if event == "/jax/compilation_cache/cache_misses":  # recorded as an entry is written
            writes.append(event)

    jax.config.update(name, 0.0)  # every compile would be written
    jax.monitoring.register_event_listener(listen)
    try:
        compile_step(torus_2x2, allreduce="ring")
        assert writes == []
        assert getattr(jax.config, name) == 0.0  # the setting is given back
        jax.jit(lambda x: x * 3.217 - 1).lower(jnp.ones(7)).compile()  # on the CPU, here
        assert writes, "a CPU program was not written either: the listener sees nothing"
    finally:
        jax.monitoring.unregister_event_listener(listen)
        jax.config.update(name, previous)


@needs_libtpu
def test_native_buckets_stay_apart_and_some_run_beside_backward(torus_2x2):
    """With the compiler options for native steps the TPU compiler neither merges the
    buckets' all-reduces into one after backward nor keeps them all synchronous."""
    from jaxdist.comm.compiler_options import compiler_options_for

    report = compile_step(torus_2x2, allreduce="native", data_axes=("y", "x"), bucket_bytes=1 << 19)
    grads = report.schedule.gradient_collectives
    assert len(grads) > 2 and any(c.asynchronous for c in grads)
    assert report.schedule.overlapped_backward_fraction > 0
    assert compiler_options_for(torus_2x2.devices.flat, "ring") is None
    assert compiler_options_for(jax.devices("cpu"), "native") is None
    # A paced permute schedule gets the TPU scheduler's further features, on the TPU alone.
    paced = compiler_options_for(torus_2x2.devices.flat, "ring", wait_free=True)
    assert paced == {"xla_tpu_enable_all_experimental_scheduler_features": True}
    assert compiler_options_for(jax.devices("cpu"), "ring", wait_free=True) is None


@needs_libtpu
def test_native_all_reduces_run_on_the_sparsecores_of_a_v5p_slice():
    """On v5p the native step's all-reduces are handed to the SparseCores, asynchronous, and
    backward runs beside them."""
    mesh = Mesh(np.asarray(parse_topology("v5p:2x2x1").devices()), ("data",))
    report = compile_step(mesh, allreduce="native", bucket_bytes=1 << 19)
    grads = report.schedule.gradient_collectives
    assert len(grads) > 2 and sum(c.asynchronous for c in grads) >= len(grads) - 1
    assert 'async_execution_thread="sparsecore"' in report.compiled.as_text()
    assert report.schedule.overlapped_backward_fraction > 0


def _order(text: str) -> list[str]:
    """The entry computation's forward (f) and backward (b) products and FSDP's parameter
    gathers, in the compiled order: ``mm-f``, ``gather-b``, ..."""
    from jaxdist.aot.schedule import computations_of

    computations, entry = computations_of(text)
    order = []
    for inst in computations[entry]:
        name = inst.op_name or ""
        way = "b" if "transpose(" in name else "f"
        if inst.opcode.startswith("collective-permute") and "parameter_gather" in name:
            order.append(f"gather-{way}")
        elif inst.opcode == "fusion" and any(
            i.opcode in ("convolution", "dot") for c in inst.called for i in computations.get(c, [])
        ):
            order.append(f"mm-{way}")
    return order


@needs_libtpu
def test_fsdp_divides_the_state_per_chip_and_gathers_each_layer_beside_compute(torus_2x2):
    plain = compile_step(torus_2x2, data_axes=("y", "x"), allreduce="torus2d")
    sharded = compile_step(torus_2x2, data_axes=("y", "x"), allreduce="torus2d", sharding="fsdp")
    # Every kernel splits 4 ways; the biases (at most 512 values) stay whole.
    biases = sum(w for w in (512, 384, 512, 256, 10)) * 4
    assert sharded.memory.parameters == pytest.approx(
        (plain.memory.parameters - biases) / 4 + biases, rel=1e-3
    )
    assert sharded.memory.optimizer_state == pytest.approx(sharded.memory.parameters, rel=1e-3)
    order = _order(sharded.text)
    # Forward: the gathers are spread among the layers' products, not all before the first.
    first_product = order.index("mm-f")
    assert any(i > first_product for i, o in enumerate(order) if o == "gather-f"), order
    # Backward gathers again, beside backward's products.
    backward = [i for i, o in enumerate(order) if o == "mm-b"]
    regathers = [i for i, o in enumerate(order) if o == "gather-b"]
    assert regathers and any(backward[0] < i < backward[-1] for i in regathers), order


@needs_libtpu
def test_gradient_reduce_scatters_the_tpu_compiler_rewrites_keep_their_role(torus_2x2):
    """The TPU compiler compiles each of FSDP's native gradient reduce-scatters as an all-reduce
    and a slice, and the all-reduce keeps none of its metadata; read against the program as
    traced, each is still FSDP's gradient, in the schedule and in the walk."""
    from jaxdist.aot.chips import CHIPS, network_for
    from jaxdist.aot.predict import predict_step
    from jaxdist.aot.schedule import REWRITTEN_SCATTER

    sharded = compile_step(torus_2x2, data_axes=("y", "x"), allreduce="native", sharding="fsdp")
    assert " reduce-scatter(" not in sharded.text  # the rewrite read through
    collectives = sharded.schedule.collectives
    rewritten = [c for c in collectives if c.source == REWRITTEN_SCATTER]
    kernels = [leaf for leaf in jax.tree.leaves(PARAMS) if leaf.ndim == 2]
    assert len(rewritten) == len(kernels)  # one per split parameter
    assert all((c.role, c.kind) == ("gradients", "all-reduce") for c in rewritten)
    assert sum(c.nbytes for c in rewritten) == sum(k.size * 4 for k in kernels)  # whole grads
    assert not [c for c in collectives if c.role == "other"], sharded.schedule.unexplained_sources()
    time = predict_step(sharded, CHIPS["v5e"], efficiency=0.2, network=network_for(CHIPS["v5e"]))
    assert time.timeline.gradient_seconds > 0 and not time.timeline.other_seconds


def test_a_replicated_step_that_does_not_fit_is_told_what_fsdp_would_hold(torus_2x2):
    from jaxdist.aot.plan import sharding_hint

    def trainer_of(config=None, **options):
        step = TrainStep(
            loss_fn, optax.adam(1e-3), torus_2x2, data_axes=("y", "x"), **records(**options)
        )
        return SimpleNamespace(train_step_for=lambda stage: step, config=config)

    hint = sharding_hint(trainer_of(), 0, (PARAMS, {}))
    values = sum(np.prod(leaf.shape) for leaf in jax.tree.leaves(PARAMS))
    held = 3 * values * 4 / 2**30  # parameters and Adam's two moments, float32
    assert hint == (
        f"its parameters and optimizer state alone take {held:.2f} GiB per chip "
        f"replicated, {held / 4:.2f} GiB sharded over 4 chips (--set "
        f"sharding=fsdp); or "
    )
    assert sharding_hint(trainer_of(sharding="fsdp"), 0, (PARAMS, {})) == ""
    # A sharded step of bfloat16 layers whose gradients travel in float32 is told the setting.
    bf16 = SimpleNamespace(model=SimpleNamespace(dtype="bfloat16"))
    hint = sharding_hint(trainer_of(bf16, sharding="fsdp"), 0, (PARAMS, {}))
    assert "gradients travel in float32 (--set transfer_dtype=bfloat16 halves" in hint
    sent = trainer_of(bf16, sharding="fsdp", allreduce_options={"transfer_dtype": jnp.bfloat16})
    assert sharding_hint(sent, 0, (PARAMS, {})) == ""

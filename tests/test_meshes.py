"""Mesh specs, presets, builders and the `jaxdist mesh` command."""

import re

import jax
import numpy as np
import pytest

from jaxdist import meshes
from jaxdist.cli import main
from jaxdist.comm import cost_model

REQUIRED_PRESETS = ("ring-8", "torus-4x2", "torus-2x4", "hierarchical-2x4")
PLANNING_PRESETS = ("abci-torus-3456", "tpu-v3-pod-1024", "dgx-h100-32x8", "dgx-h100-448x8")


@pytest.mark.parametrize("name", REQUIRED_PRESETS + PLANNING_PRESETS)
def test_every_preset_loads_as_a_valid_spec(name):
    spec = meshes.load(name)
    assert spec.name == name
    assert spec.size == int(np.prod(spec.shape))


def test_pipeline_presets_show_their_stage_axis():
    spec = meshes.load("pipeline-2x2x2")
    assert spec.layout == "pipeline" and spec.axis_names[-1] == meshes.STAGE_AXIS
    text = meshes.describe(spec)
    assert "along inner axis 'stage'" in text and "y=1,x=1" in text


def test_presets_list_holds_the_required_ones():
    assert set(REQUIRED_PRESETS + PLANNING_PRESETS) <= set(meshes.presets())


def test_planning_presets_have_their_sizes():
    assert meshes.load("abci-torus-3456").size == 3456
    assert meshes.load("tpu-v3-pod-1024").size == 1024
    assert meshes.load("dgx-h100-448x8").size == 3584
    assert meshes.load("dgx-h100-448x8").devices_per_host == 8


@pytest.mark.parametrize(
    ("builder", "shape", "names"),
    [
        (lambda: meshes.ring(8), (8,), ("x",)),
        (lambda: meshes.ring(3), (3,), ("x",)),
        (lambda: meshes.torus2d(4, 2), (4, 2), ("y", "x")),
        (lambda: meshes.hierarchical(2, 4), (2, 4), ("host", "local")),
    ],
)
def test_builders(builder, shape, names):
    mesh = builder()
    assert mesh.devices.shape == shape
    assert tuple(mesh.axis_names) == names
    ids = [d.id for d in mesh.devices.reshape(-1)]
    assert ids == sorted(ids), "ring neighbours must be adjacent devices"


def test_build_from_preset_matches_builder():
    assert (meshes.build("torus-4x2").devices == meshes.torus2d(4, 2).devices).all()


def test_hierarchical_keeps_each_host_on_one_row():
    spec = meshes.load("hierarchical-2x4")
    grid = meshes.device_grid(spec)
    hosts = meshes.host_of(spec, grid)
    for row in hosts:
        assert len(set(row)) == 1
    assert sorted(hosts[:, 0]) == [0, 1]


def test_spec_that_does_not_fit_says_what_and_how():
    spec = meshes.load("tpu-v3-pod-1024")
    with pytest.raises(meshes.MeshDoesNotFitError) as err:
        meshes.build(spec)
    message = str(err.value)
    assert "1024 devices" in message and f"{jax.device_count()} device(s) present" in message
    assert "xla_force_host_platform_device_count" in message


def test_spec_validation_errors(tmp_path):
    with pytest.raises(meshes.MeshSpecError, match="layout 'torus2d' needs 2 axes, got 1"):
        meshes.MeshSpec("bad", "torus2d", (("x", 8),))
    with pytest.raises(meshes.MeshSpecError, match="layout 'pipeline' needs 2 or 3 axes"):
        meshes.MeshSpec("bad", "pipeline", (("stage", 8),))
    with pytest.raises(meshes.MeshSpecError, match="a pipeline mesh needs an axis named 'stage'"):
        meshes.MeshSpec("bad", "pipeline", (("data", 2), ("x", 4)))
    with pytest.raises(meshes.MeshSpecError, match="layout must be one of"):
        meshes.MeshSpec("bad", "star", (("x", 8),))
    with pytest.raises(meshes.MeshSpecError, match="axis names must be distinct"):
        meshes.MeshSpec("bad", "torus2d", (("x", 2), ("x", 4)))
    with pytest.raises(meshes.MeshSpecError, match="must have an integer size >= 1, got 0"):
        meshes.MeshSpec("bad", "ring", (("x", 0),))
    with pytest.raises(meshes.MeshSpecError, match="must equal devices_per_host"):
        meshes.MeshSpec("bad", "hierarchical", (("host", 2), ("local", 4)), devices_per_host=2)
    with pytest.raises(meshes.MeshSpecError, match=r"no mesh preset named 'nope'.*ring-8"):
        meshes.load("nope")
    bad = tmp_path / "bad.toml"
    bad.write_text('layout = "ring"\naxes = [{ name = "x", size = 2, extra = 1 }]\n')
    with pytest.raises(meshes.MeshSpecError, match="each axis must be a table"):
        meshes.load(bad)
    bad.write_text('layout = "ring"\nshape = [2]\n')
    with pytest.raises(meshes.MeshSpecError, match="unknown keys \\['shape'\\]"):
        meshes.load(bad)
    bad.write_text("layout = \n")
    with pytest.raises(meshes.MeshSpecError, match="is not valid TOML"):
        meshes.load(bad)


def test_load_by_path(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(
        'layout = "hierarchical"\ndevices_per_host = 2\n'
        'axes = [{ name = "host", size = 4 }, { name = "local", size = 2 }]\n'
    )
    spec = meshes.load(path)
    assert spec.name == "mine" and spec.shape == (4, 2) and spec.num_hosts == 4
    assert meshes.build(spec).devices.shape == (4, 2)


def test_mesh_show_prints_grid_and_hosts(capsys):
    assert main(["mesh", "show", "hierarchical-2x4"]) == 0
    out = capsys.readouterr().out
    assert "layout=hierarchical host=2 x local=4" in out
    assert "host=0     0[0]   1[0]   2[0]   3[0]" in out
    assert "host=1     4[1]   5[1]   6[1]   7[1]" in out


def test_mesh_show_fails_clearly_for_a_mesh_that_does_not_fit(capsys):
    assert main(["mesh", "show", "dgx-h100-32x8"]) == 1
    captured = capsys.readouterr()
    assert "256 devices" in captured.out
    assert "does not fit: 8 device(s) present" in captured.err
    assert main(["mesh", "show", "no-such-mesh"]) == 2


def test_mesh_cost_prices_a_planning_preset_without_its_devices(capsys):
    argv = ["mesh", "cost", "abci-torus-3456", "--bytes", "1M,100M", "--link", "5us:12.5GB/s"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "3456 devices" in out and "alpha 5 us, 12.5 GB/s, 1 port(s)" in out
    rows = {
        (size, name): (float(us), float(best))
        for size, name, us, _, _, best in re.findall(
            r"^\s+(\d+M) (\w+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M
        )
    }
    link = cost_model.parse_link("5us:12.5GB/s")
    for size, nbytes in (("1M", 2**20), ("100M", 100 * 2**20)):
        expected = cost_model.predict("torus2d", nbytes, (48, 72), link)
        assert rows[size, "torus2d"][0] == pytest.approx(expected * 1e6, abs=0.1)
        assert rows[size, "torus2d"][1] == 1.0  # the torus is the fastest here
        assert rows[size, "ring"][1] > 1.0
    assert "# skipped halving_doubling: needs a power-of-two device count, got 3456" in out


def test_mesh_cost_uses_the_inner_link_for_the_inner_axis_only(capsys):
    argv = [
        "mesh",
        "cost",
        "dgx-h100-32x8",
        "--bytes",
        "64M",
        "--algorithms",
        "ring,hierarchical",
        "--link",
        "5us:50GB/s",
        "--inner-link",
        "2us:450GB/s",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert (
        "inner axis local=8: alpha 2 us, 450 GB/s" in out
        and "outer axis host=32: alpha 5 us" in out
    )
    net = cost_model.Network(
        intra=cost_model.parse_link("2us:450GB/s"), inter=cost_model.parse_link("5us:50GB/s")
    )
    for name in ("ring", "hierarchical"):
        expected = cost_model.predict(name, 64 * 2**20, (32, 8), net) * 1e6
        (line,) = [line for line in out.splitlines() if f" {name} " in line]
        assert float(line.split()[2]) == pytest.approx(expected, abs=0.1)


def test_mesh_cost_prices_one_axis_schedules_on_the_axis_they_cross(tmp_path, capsys):
    def cost(axes, *extra):
        path = tmp_path / "m.toml"
        path.write_text(
            'name = "m"\nlayout = "hierarchical"\naxes = ['
            + ", ".join(f'{{ name = "{n}", size = {k} }}' for n, k in axes)
            + "]\n"
        )
        argv = [
            "mesh",
            "cost",
            str(path),
            "--bytes",
            "1M",
            "--algorithms",
            "ring",
            "--link",
            "100us:1gbit",
            "--inner-link",
            "1us:100GB/s",
            *extra,
        ]
        code = main(argv)
        return code, capsys.readouterr()

    slow, fast = cost_model.parse_link("100us:1gbit"), cost_model.parse_link("1us:100GB/s")
    for axes, link, pace in ((((4, 1)), slow, "outer"), (((1, 8)), fast, "inner")):
        code, out = cost((("host", axes[0]), ("local", axes[1])))
        assert code == 0, out.err
        assert f"one-axis schedules run on every device, at the {pace} axis's pace" in out.out
        p = axes[0] * axes[1]
        expected = (2 * (p - 1) * link.alpha + 2 * (p - 1) / p * 2**20 * link.beta) * 1e6
        (line,) = [line for line in out.out.splitlines() if " ring " in line]
        assert float(line.split()[2]) == pytest.approx(expected, abs=0.1)
    code, out = cost((("host", 1), ("local", 1)))
    assert code == 2 and "m has one device: there is nothing to allreduce" in out.err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--link", "fast"], "a link is LATENCY:BANDWIDTH"),
        (
            ["--link", "5us:1GB/s", "--inner-link", "1us:9GB/s"],
            "only a two-axis mesh takes --inner-link; ring-8 has one axis (x=8)",
        ),
        (
            ["--link", "5us:1GB/s", "--inner-ports", "2", "--inter-algorithm", "ring"],
            "only a two-axis mesh takes --inner-ports, --inter-algorithm; ring-8 has one axis",
        ),
        (["--link", "5us:1GB/s", "--bytes", "0"], "--bytes must be at least 1 byte per device"),
        (["--link", "5us:1GB/s", "--algorithms", "rign"], "unknown algorithm(s) ['rign']"),
        (["--link", "5us:1GB/s", "--ports", "0"], "a link needs ports >= 1"),
        (["--link", "5us:1GB/s", "--bytes", "4Q"], "bad size '4Q'"),
    ],
)
def test_mesh_cost_rejects_bad_input(argv, message, capsys):
    assert main(["mesh", "cost", "ring-8", *argv]) == 2
    assert message in capsys.readouterr().err


def test_mesh_cost_rejects_an_outer_schedule_that_is_not_one(capsys):
    argv = ["mesh", "cost", "hierarchical-2x4", "--link", "5us:1GB/s", "--inter-algorithm", "foo"]
    assert main(argv) == 2
    assert "--inter-algorithm must be one of ('native', 'ring'" in capsys.readouterr().err


def test_host_mismatch_compares_the_spec_with_the_real_processes():
    from types import SimpleNamespace

    def grid(*processes):
        return np.array([SimpleNamespace(process_index=p) for p in processes], dtype=object)

    spec = meshes.load("hierarchical-2x4")  # 4 devices per host
    two_of_two = grid(0, 0, 1, 1).reshape(1, 4)
    message = meshes.host_mismatch(spec, two_of_two)
    assert message.startswith(
        "mesh 'hierarchical-2x4' expects 4 devices per host, but its devices come from "
        "2 processes with 2 each"
    ), message
    assert message.endswith("(in code: jaxdist.meshes.hierarchical(2, 2))"), message
    assert meshes.host_mismatch(spec, grid(0, 0, 0, 0, 1, 1, 1, 1)) is None  # real hosts of 4
    assert meshes.host_mismatch(spec, grid(*[0] * 8)) is None  # one process: hosts emulated
    uneven = meshes.host_mismatch(spec, grid(0, 0, 0, 1, 1, 1, 1, 1))
    assert "with 3/5 each" in uneven and "in code" not in uneven
    assert meshes.host_mismatch(meshes.load("ring-8"), two_of_two) is None  # no hosts declared
    # Real hosts larger than the spec's: rows are parts of hosts, not spread over several.
    larger = meshes.host_mismatch(meshes.load("hierarchical-4x2"), grid(*[0] * 4, *[1] * 4))
    assert larger.startswith(
        "mesh 'hierarchical-4x2' expects 2 devices per host, but its devices come from "
        "2 processes with 4 each: each process holds several of its rows, so steps along "
        "'host' meant to cross hosts partly stay inside one"
    ), larger


def test_tpu_processes_must_hold_whole_rows(monkeypatch):
    from types import SimpleNamespace

    fakes = [SimpleNamespace(platform="tpu", process_index=i // 3, id=i) for i in range(8)]
    monkeypatch.setattr(jax, "process_count", lambda: 3)
    with pytest.raises(
        meshes.MeshDoesNotFitError,
        match=r"on TPU each process must hold whole rows, so the outer axis 'host' \(2\) must "
        r"be a multiple of the process count \(3\)",
    ):
        meshes.device_grid(meshes.load("hierarchical-2x4"), fakes)


# ------------------------------------------------------------ ring orders on TPU slices


def test_folded_line_and_hamiltonian_cycle_take_short_hops():
    from jaxdist import ring_order

    for n in range(1, 12):
        order = ring_order.fold(n)
        assert sorted(order) == list(range(n))
        hops = [abs(order[i] - order[(i + 1) % n]) for i in range(n)]
        assert max(hops) <= 2, (n, order)
    for rows, cols in [(2, 2), (4, 8), (16, 16), (2, 3)]:
        cycle = ring_order._hamiltonian_cycle(rows, cols)
        assert sorted(cycle) == [(r, c) for r in range(rows) for c in range(cols)]
        for (r, c), (r2, c2) in zip(cycle, cycle[1:] + cycle[:1]):
            assert abs(r - r2) + abs(c - c2) == 1


@pytest.mark.skipif(
    not __import__("jaxdist.aot.topology", fromlist=["x"]).libtpu_available(),
    reason="the TPU compiler is not installed",
)
@pytest.mark.parametrize(
    "topology, shape, longest",
    [
        ("v5e:4x8", (4, 8), 2),
        ("v5e:4x8", (32,), 1),
        ("v5e:8x8", (8, 8), 2),
        ("v5p:2x2x4", (4, 4), None),
    ],
)
def test_tpu_meshes_fold_rings_on_slices_without_wraparound(topology, shape, longest):
    """On v5e every axis's ring takes hops of at most two chips; v5p keeps its order."""
    from jax.experimental import mesh_utils

    from jaxdist import ring_order
    from jaxdist.aot.topology import parse_topology

    devices = parse_topology(topology).devices()
    names = tuple(f"a{i}" for i in range(len(shape)))
    spec = meshes.MeshSpec("t", "torus2d" if len(shape) == 2 else "ring", tuple(zip(names, shape)))
    grid = meshes.device_grid(spec, devices)
    if longest is None:
        plain = mesh_utils.create_device_mesh(shape, devices=devices)
        assert [d.id for d in grid.reshape(-1)] == [d.id for d in plain.reshape(-1)]
    else:
        for axis in range(len(shape)):
            assert ring_order.longest_hop(grid, axis) <= longest


def test_the_pipeline_builder_lays_devices_as_its_preset():
    built = meshes.pipeline(2, 4)
    assert dict(built.shape) == {"data": 2, meshes.STAGE_AXIS: 4}
    assert built.devices.tolist() == meshes.build("pipeline-2x4").devices.tolist()


def test_a_runs_mesh_is_every_device_as_data_or_data_by_stage_or_the_named_spec():
    n = jax.device_count()
    assert dict(meshes.for_run("").shape) == {"data": n}
    assert dict(meshes.for_run("", stages=2).shape) == {"data": n // 2, "stage": 2}
    assert dict(meshes.for_run("data=2,fsdp=4").shape) == {"data": 2, "fsdp": 4}
    with pytest.raises(ValueError, match=rf"^pipeline.stages=3 does not divide the {n} devices"):
        meshes.for_run("", stages=3)
    with pytest.raises(meshes.MeshSpecError, match=r"^mesh axis 'expert' has the role expert"):
        meshes.for_run("data=1,expert=2")

"""The allreduce benchmark (jaxdist.bench.allreduce) and the `jaxdist bench allreduce` command."""

import json
import math

import jax
import pytest

from jaxdist import meshes
from jaxdist.bench import allreduce as bench
from jaxdist.bench.sizes import parse_size, parse_sizes
from jaxdist.cli import main
from jaxdist.comm import cost_model


@pytest.mark.parametrize(
    ("text", "sizes"),
    [
        ("4K:64K", [4096, 16384, 65536]),
        ("1M", [2**20]),
        ("100,4K,2G", [100, 4096, 2 * 2**30]),
    ],
)
def test_parse_sizes(text, sizes):
    assert parse_sizes(text) == sizes


def test_parse_size_rejects_garbage():
    with pytest.raises(ValueError, match="bad size '4Q'"):
        parse_size("4Q")


def test_bench_cli_checks_every_algorithm_against_psum(tmp_path, capsys):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = [
        "bench",
        "allreduce",
        "--mesh",
        "torus-4x2",
        "--sizes",
        "4K,64K",
        "--warmup",
        "1",
        "--iters",
        "2",
        "--json",
        str(out_json),
        "--plot",
        str(out_png),
        "--quiet",
    ]
    assert main(argv) == 0
    table = capsys.readouterr().out
    result = json.loads(out_json.read_text())
    on_two_axes = set(bench.collectives.ALGORITHMS) - set(bench.collectives.THREE_LEVEL)
    assert {r["algorithm"] for r in result["rows"]} == on_two_axes
    assert len(result["rows"]) == 2 * len(on_two_axes)
    for row in result["rows"]:
        assert row["max_error"] < 1e-4, row
        assert row["seconds"] > 0 and row["predicted_seconds"] > 0
        p = result["devices"]
        assert row["busbw"] == pytest.approx(row["nbytes"] / row["seconds"] * 2 * (p - 1) / p)
        if row["algorithm"] == "native":
            assert row["vs_psum"] == 1.0
    assert result["link"]["alpha_s"] >= 0 and result["link"]["beta_s_per_byte"] >= 0
    assert result["link"]["ports"] == 1  # forced CPU devices share one memory bus
    # The two-level schedules are priced on links fitted along each axis, the rest on the
    # shift round all devices.
    flat = cost_model.Link(*(result["link"][k] for k in ("alpha_s", "beta_s_per_byte", "ports")))
    axes = cost_model.Network(
        intra=cost_model.Link(
            result["intra_link"]["alpha_s"], result["intra_link"]["beta_s_per_byte"]
        ),
        inter=cost_model.Link(
            result["inter_link"]["alpha_s"], result["inter_link"]["beta_s_per_byte"]
        ),
    )
    for row in result["rows"]:
        two_level = row["algorithm"] in ("torus2d", "hierarchical")
        expected = cost_model.predict(
            row["algorithm"], row["nbytes"], (4, 2), axes if two_level else flat
        )
        assert row["predicted_seconds"] == pytest.approx(expected), row
    assert "two-level schedules priced on the links along each axis: inner alpha" in table
    assert "busbw(GB/s)" in table and "torus2d" in table
    assert out_png.stat().st_size > 1000


def test_bench_skips_what_cannot_run_and_rejects_bad_names(capsys):
    assert main(["bench", "allreduce", "--mesh", "ring-8", "--algorithms", "rign"]) == 2
    assert "unknown algorithm(s) ['rign']" in capsys.readouterr().err
    argv = [
        "bench",
        "allreduce",
        "--mesh",
        "ring-8",
        "--sizes",
        "1K",
        "--iters",
        "1",
        "--quiet",
        "--algorithms",
        "ring,torus2d",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "# skipped torus2d: needs a 2-axis mesh" in out
    assert math.isfinite(float(out.split("\n")[3].split()[2]))
    argv = [
        "bench",
        "allreduce",
        "--mesh",
        "hierarchical-2x4",
        "--sizes",
        "1K",
        "--iters",
        "1",
        "--quiet",
        "--algorithms",
        "torus2d,hierarchical",
        "--crossed-exchange",
        "off",
    ]
    assert main(argv) == 0
    assert "hierarchical" in capsys.readouterr().out


def test_bench_in_place_donates_and_stays_correct(tmp_path):
    out_json = tmp_path / "in_place.json"
    argv = [
        "bench",
        "allreduce",
        "--mesh",
        "ring-8",
        "--sizes",
        "64K",
        "--iters",
        "2",
        "--algorithms",
        "native,ring,halving_doubling",
        "--in-place",
        "--quiet",
        "--json",
        str(out_json),
    ]
    assert main(argv) == 0
    result = json.loads(out_json.read_text())
    assert result["in_place"] is True
    assert all(row["max_error"] < 1e-4 for row in result["rows"])


def test_bench_prices_the_bidirectional_ring_with_the_ports_asked_for(tmp_path, capsys):
    assert bench.default_ports("tpu") == 2
    assert bench.default_ports("cpu") == bench.default_ports("gpu") == 1
    predicted = {}
    for ports in (1, 2):
        out_json = tmp_path / f"ports{ports}.json"
        argv = [
            "bench",
            "allreduce",
            "--mesh",
            "ring-8",
            "--sizes",
            "1M",
            "--iters",
            "1",
            "--algorithms",
            "ring,bidirectional_ring",
            "--link-ports",
            str(ports),
            "--quiet",
            "--json",
            str(out_json),
        ]
        assert main(argv) == 0
        assert f"{ports} port(s) per device" in capsys.readouterr().out
        result = json.loads(out_json.read_text())
        assert result["link"]["ports"] == ports
        assert "inter_link" not in result  # one axis: one link
        link = cost_model.Link(result["link"]["alpha_s"], result["link"]["beta_s_per_byte"], ports)
        for row in result["rows"]:
            expected = cost_model.predict(row["algorithm"], row["nbytes"], (8,), link)
            assert row["predicted_seconds"] == pytest.approx(expected)
            predicted[ports, row["algorithm"]] = row["predicted_seconds"]
    # One port: the bidirectional ring is priced above the ring (more messages, same bytes).
    assert predicted[1, "bidirectional_ring"] > predicted[1, "ring"]
    # Links along each axis are fitted only for the two-level schedules.
    out_json = tmp_path / "ring_on_torus.json"
    argv = [
        "bench",
        "allreduce",
        "--mesh",
        "torus-4x2",
        "--sizes",
        "1K",
        "--iters",
        "1",
        "--algorithms",
        "ring",
        "--quiet",
        "--json",
        str(out_json),
    ]
    assert main(argv) == 0
    assert "inter_link" not in json.loads(out_json.read_text())
    capsys.readouterr()
    argv = ["bench", "allreduce", "--mesh", "ring-8", "--link-ports", "0"]
    assert main(argv) == 2
    assert "--link-ports must be at least 1, got 0" in capsys.readouterr().err
    argv = ["bench", "allreduce", "--mesh", "torus-4x2", "--inter-algorithm", "torus2d"]
    assert main(argv) == 2
    assert "--inter-algorithm must be one of ('native', 'ring'" in capsys.readouterr().err


def test_bench_reports_busbw_as_a_share_of_the_link_rate(tmp_path, capsys, monkeypatch):
    def run(*extra):
        out_json = tmp_path / "rate.json"
        argv = [
            "bench",
            "allreduce",
            "--mesh",
            "ring-8",
            "--sizes",
            "64K",
            "--iters",
            "1",
            "--algorithms",
            "ring",
            "--quiet",
            "--json",
            str(out_json),
            *extra,
        ]
        code = main(argv)
        return code, capsys.readouterr(), json.loads(out_json.read_text()) if code == 0 else None

    code, out, result = run()
    assert code == 0 and result["link_rate"] is None and "link%" not in out.out
    assert all(row["link_share"] is None for row in result["rows"])
    # Given on the command line (8 Gbit/s = 1 GB/s) ...
    code, out, result = run("--link-rate", "8Gbit")
    assert code == 0 and result["link_rate"] == 1e9
    assert "# link rate 1000 MB/s per direction" in out.out and "link%" in out.out
    for row in result["rows"]:
        assert row["link_share"] == pytest.approx(row["busbw"] / 1e9)
        assert f"{row['link_share'] * 100:5.1f}%" in out.out
    # ... or set by `jaxdist cluster` for the processes it starts, where each host's link is
    # its one device's ...
    monkeypatch.setenv("JAXDIST_LINK_BITS_PER_S", "1000000000")
    with monkeypatch.context() as one_device_per_host:
        one_device_per_host.setattr(jax, "local_device_count", lambda: 1)
        code, out, result = run()
    assert code == 0 and result["link_rate"] == 125e6
    # ... but not where the host's devices (here 8) share its link.
    code, out, result = run()
    assert code == 0 and result["link_rate"] is None
    assert "# link% left out: the 8 devices of each emulated host share its link" in out.err
    monkeypatch.setenv("JAXDIST_LINK_BITS_PER_S", "1gbit")
    code, out, _ = run()
    assert code == 2
    assert "JAXDIST_LINK_BITS_PER_S must be a positive whole number" in out.err
    code, out, _ = run("--link-rate", "fast")
    assert code == 2 and "a rate is a number and a unit" in out.err


def test_bench_skips_hierarchical_when_its_outer_schedule_cannot_run(capsys):
    argv = [
        "bench",
        "allreduce",
        "--mesh",
        "torus-2x4",
        "--sizes",
        "1K",
        "--iters",
        "1",
        "--quiet",
        "--algorithms",
        "ring,hierarchical",
        "--inter-algorithm",
        "halving_doubling",
    ]
    assert main(argv) == 0  # an outer axis of 2 is a power of two: it runs
    assert "skipped" not in capsys.readouterr().out
    mesh = meshes.build(
        meshes.from_dict(
            {
                "name": "t",
                "layout": "hierarchical",
                "axes": [{"name": "host", "size": 3}, {"name": "local", "size": 2}],
            }
        )
    )
    reason = bench.skip_reason("hierarchical", mesh, "halving_doubling")
    assert reason == "halving_doubling across the outer axis needs a power of two, got 3"


def test_bench_times_the_mean_against_pmean(tmp_path, capsys):
    out_json = tmp_path / "mean.json"
    argv = [
        "bench",
        "allreduce",
        "--mesh",
        "torus-4x2",
        "--sizes",
        "64K",
        "--iters",
        "2",
        "--algorithms",
        "ring,bidirectional_ring,torus2d",
        "--in-place",
        "--op",
        "mean",
        "--quiet",
        "--json",
        str(out_json),
    ]
    assert main(argv) == 0
    assert "# allreduce (mean) on mesh torus-4x2" in capsys.readouterr().out
    result = json.loads(out_json.read_text())
    assert result["op"] == "mean" and result["in_place"] is True
    # Against psum the mean would be off by 7/8 of the sum, several units on normal inputs.
    assert all(row["max_error"] < 1e-5 for row in result["rows"]), result["rows"]
    with pytest.raises(ValueError, match=r"op must be 'sum' or 'mean', got 'max'"):
        bench.run(meshes.ring(2), [1024], ["ring"], op="max")

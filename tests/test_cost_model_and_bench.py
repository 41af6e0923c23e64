"""The alpha-beta cost model, its fit, and the `jaxdist bench allreduce` command."""

import json
import math

import jax
import numpy as np
import pytest

from jaxdist import meshes
from jaxdist.bench import allreduce as bench
from jaxdist.cli import main
from jaxdist.comm import cost_model

LINK = cost_model.Link(alpha=10e-6, beta=1 / 10e9)
S = 64 * 2**20


@pytest.mark.parametrize(
    ("algorithm", "sizes", "steps", "volume"),
    [
        ("ring", (8,), 14, 2 * 7 / 8),
        ("native", (8,), 14, 2 * 7 / 8),
        ("halving_doubling", (8,), 6, 2 * 7 / 8),
        ("parameter_server", (8,), 14, 14),
        # 2-D torus: 2(X+Y-2) steps and 2(XY-1)/(XY) volume (REFERENCE §5)
        ("torus2d", (2, 4), 2 * (2 + 4 - 2), 2 * 7 / 8),
        ("torus2d", (48, 72), 2 * (72 + 48 - 2), 2 * (3456 - 1) / 3456),
        ("hierarchical", (2, 4), 2 * (4 + 2 - 2), 2 * 7 / 8),
        # An inner pair exchanges once per block of the outer ring's all-gather: 3Y - 1 steps.
        ("torus2d", (4, 2), 3 * 4 - 1, 2 * 7 / 8),
        ("hierarchical", (4, 2), 3 * 4 - 1, 2 * 7 / 8),
    ],
)
def test_terms_match_the_reference_formulas(algorithm, sizes, steps, volume):
    terms = cost_model.terms(algorithm, sizes)
    assert sum(t.steps for t in terms) == pytest.approx(steps)
    assert sum(t.volume for t in terms) == pytest.approx(volume)
    expected = steps * LINK.alpha + volume * S * LINK.beta
    assert cost_model.predict(algorithm, S, sizes, LINK) == pytest.approx(expected)


def test_bidirectional_ring_gains_only_where_a_device_has_two_ports():
    (term,) = cost_model.terms("bidirectional_ring", (8,))
    assert (term.steps, term.volume, term.lanes) == (14, 2 * 7 / 8, 2)
    ring = cost_model.predict("ring", S, (8,), LINK)
    # One port (one NIC, one memory bus): the two rings take turns, so the ring's bytes and
    # twice its messages.
    one_port = cost_model.predict("bidirectional_ring", S, (8,), LINK)
    assert one_port == pytest.approx(28 * LINK.alpha + 2 * 7 / 8 * S * LINK.beta)
    assert one_port == pytest.approx(ring + 14 * LINK.alpha)
    # A link to each neighbour: both directions at full rate, half the bandwidth term.
    two_ports = cost_model.Link(LINK.alpha, LINK.beta, ports=2)
    both = cost_model.predict("bidirectional_ring", S, (8,), two_ports)
    assert both == pytest.approx(14 * LINK.alpha + 7 / 8 * S * LINK.beta)
    assert cost_model.predict("ring", S, (8,), two_ports) == pytest.approx(ring)  # one lane
    # On two devices both directions lead to the same neighbour: the schedule is a ring.
    for link in (LINK, two_ports):
        assert cost_model.predict("bidirectional_ring", S, (2,), link) == pytest.approx(
            cost_model.predict("ring", S, (2,), link)
        )
    # Between hosts, as hierarchical's outer schedule, on 1/inner of the data.
    net = cost_model.Network(intra=LINK, inter=two_ports)
    outer = cost_model.predict(
        "hierarchical", S, (4, 2), net, inter_algorithm="bidirectional_ring"
    ) - cost_model.predict("ring", S, (2,), LINK)
    assert outer == pytest.approx(6 * LINK.alpha + 3 / 4 * (S / 2) * LINK.beta)


def test_link_ports_must_be_a_positive_integer():
    assert cost_model.Link(1e-6, 1e-9, ports=np.int64(2)).ports == 2
    assert type(cost_model.Link(1e-6, 1e-9, ports=np.int64(2)).ports) is int
    for ports in (0, -1, 1.5, 2.0, True, "2"):
        with pytest.raises(ValueError, match=r"a link needs ports >= 1 \(an integer\)"):
            cost_model.Link(1e-6, 1e-9, ports=ports)
    with pytest.raises(ValueError, match="ports >= 1"):
        cost_model.fit("p2p", (), [1, 2], [1.0, 2.0], ports=0)


def test_parameter_server_grows_linearly_and_ring_stays_flat():
    ps = [cost_model.predict("parameter_server", S, (p,), LINK) for p in (2, 4, 8, 16)]
    ring = [cost_model.predict("ring", S, (p,), LINK) for p in (2, 4, 8, 16)]
    assert ps[3] / ps[0] == pytest.approx(15, rel=0.01)
    assert ring[3] / ring[0] < 2.0


def test_hierarchical_prices_each_phase_on_its_own_link():
    fast, slow = cost_model.Link(1e-6, 1 / 100e9), cost_model.Link(20e-6, 1 / 1e9)
    net = cost_model.Network(intra=fast, inter=slow)
    hosts, local = 2, 4
    expected = (
        2 * (local - 1) * fast.alpha
        + 2 * (local - 1) / local * S * fast.beta
        + 2 * (hosts - 1) * slow.alpha
        + 2 * (hosts - 1) / hosts * (S / local) * slow.beta
    )
    swap = cost_model.predict("hierarchical", S, (hosts, local), net, crossed_exchange=False)
    assert swap == pytest.approx(expected)
    # A flat ring across both hosts runs every step at the slow link's pace.
    assert cost_model.predict("ring", S, (hosts, local), net) > 3 * expected
    # The crossed exchange: one step between hosts with the same bytes, plus one in-host hop.
    # Both two-level schedules run it only when asked.
    crossed = expected - slow.alpha + fast.alpha + S / local * fast.beta
    for algorithm in ("hierarchical", "torus2d"):
        assert cost_model.predict(algorithm, S, (hosts, local), net) == pytest.approx(expected)
        asked = cost_model.predict(algorithm, S, (hosts, local), net, crossed_exchange=True)
        assert asked == pytest.approx(crossed)


def test_fit_recovers_alpha_and_beta():
    sizes = [2**k for k in range(10, 27, 2)]
    times = [cost_model.predict("ring", s, (8,), LINK) for s in sizes]
    fitted = cost_model.fit("ring", (8,), sizes, times)
    assert fitted.alpha == pytest.approx(LINK.alpha, rel=1e-6)
    assert fitted.beta == pytest.approx(LINK.beta, rel=1e-6)
    p2p = cost_model.fit("p2p", (), sizes, [LINK.alpha + s * LINK.beta for s in sizes])
    assert p2p.bandwidth == pytest.approx(10e9, rel=1e-6)
    # The bidirectional ring's times are read with the link's port count.
    for ports in (1, 2):
        link = cost_model.Link(LINK.alpha, LINK.beta, ports=ports)
        times = [cost_model.predict("bidirectional_ring", s, (8,), link) for s in sizes]
        fitted = cost_model.fit("bidirectional_ring", (8,), sizes, times, ports=ports)
        assert fitted == cost_model.Link(
            pytest.approx(LINK.alpha, rel=1e-6), pytest.approx(LINK.beta, rel=1e-6), ports
        )


def test_fit_and_terms_errors():
    with pytest.raises(ValueError, match="at least two"):
        cost_model.fit("ring", (8,), [1], [1.0])
    with pytest.raises(ValueError, match="power-of-two"):
        cost_model.terms("halving_doubling", (6,))
    with pytest.raises(ValueError, match="needs two axes"):
        cost_model.terms("torus2d", (8,))
    with pytest.raises(ValueError, match="unknown allreduce algorithm"):
        cost_model.terms("tree", (8,))


@pytest.mark.parametrize(
    ("text", "alpha", "bytes_per_second"),
    [
        ("5us:12.5GB/s", 5e-6, 12.5e9),
        ("100us:1gbit", 100e-6, 125e6),
        ("0.5 ms : 400 Mbit/s", 0.5e-3, 50e6),
        ("2e-6s:3.2e11B/s", 2e-6, 3.2e11),
        ("10ns:1TB/s", 10e-9, 1e12),
        # B is bytes and b bits, whatever the prefix's case; bit is bits in any case.
        ("5us:1Gb/s", 5e-6, 125e6),
        ("5US:1gB/S", 5e-6, 1e9),
        ("5us:8BIT", 5e-6, 1),
        ("1.5\u03bcs:1MB/s", 1.5e-6, 1e6),  # Greek mu
        ("1.5\u00b5s:1MB/s", 1.5e-6, 1e6),  # micro sign
    ],
)
def test_parse_link_reads_latency_and_bandwidth(text, alpha, bytes_per_second):
    link = cost_model.parse_link(text, ports=2)
    assert link.alpha == pytest.approx(alpha)
    assert link.bandwidth == pytest.approx(bytes_per_second)
    assert link.ports == 2


@pytest.mark.parametrize(
    "text",
    ["5us", "5:12.5GB/s", "5us:12.5", "5us:12.5GiB/s", "5us:1Gbps", "fast:slow", "-5us:1GB/s"],
)
def test_parse_link_rejects_what_it_cannot_read(text):
    with pytest.raises(ValueError, match=rf"a link is LATENCY:BANDWIDTH.*got '{text}'"):
        cost_model.parse_link(text)


def test_parse_rate():
    assert cost_model.parse_rate("1gbit") == 125e6
    assert cost_model.parse_rate("12.5 GB/s") == 12.5e9
    with pytest.raises(ValueError, match=r"a rate is a number and a unit, e\.g\. 1gbit"):
        cost_model.parse_rate("1 GiB/s")
    with pytest.raises(ValueError, match="a rate must be finite and positive, got '0gbit'"):
        cost_model.parse_rate("0gbit")


@pytest.mark.parametrize("text", ["5us:0GB/s", "1e400us:1GB/s", "1us:1e400GB/s"])
def test_parse_link_needs_finite_latency_and_positive_bandwidth(text):
    with pytest.raises(ValueError, match="a link needs a finite latency and a finite, positive"):
        cost_model.parse_link(text)


def test_predict_all_prices_what_runs_and_says_why_the_rest_cannot():
    link = cost_model.Link(5e-6, 1 / 12.5e9)
    flat = cost_model.predict_all(S, (6,), link)
    assert flat["ring"] == pytest.approx(cost_model.predict("ring", S, (6,), link))
    assert flat["halving_doubling"] == "needs a power-of-two device count, got 6"
    assert flat["torus2d"] == flat["hierarchical"] == "needs a 2-axis mesh, got axis sizes (6,)"
    # Mikami et al.'s scale: 3456 devices as 48 x 72. The torus needs 2(X + Y - 2) = 236
    # messages where a flat ring needs 2(p - 1) = 6910, for the same bytes.
    torus = cost_model.predict_all(S, (48, 72), link, ("ring", "torus2d"))
    assert torus["ring"] - torus["torus2d"] == pytest.approx((6910 - 236) * link.alpha)
    assert cost_model.unsupported("tree", (8,)).startswith("unknown allreduce algorithm 'tree'")
    # hierarchical's schedule across the outer axis has its own needs.
    across = cost_model.predict_all(S, (3, 4), link, inter_algorithm="halving_doubling")
    assert across["hierarchical"] == (
        "halving_doubling across the outer axis needs a power of two, got 3"
    )
    assert isinstance(across["torus2d"], float)  # torus2d always rings the outer axis
    assert cost_model.unsupported("hierarchical", (2, 4), inter_algorithm="torus2d").startswith(
        "inter_algorithm must be one of ('native', 'ring'"
    )


def test_one_axis_schedules_cross_the_outer_links_unless_that_axis_is_one_device():
    fast, slow = cost_model.Link(1e-6, 1 / 100e9), cost_model.Link(20e-6, 1 / 1e9)
    net = cost_model.Network(intra=fast, inter=slow)
    for sizes, link in (((4, 1), slow), ((4, 2), slow), ((1, 8), fast), ((8,), fast)):
        p = math.prod(sizes)
        expected = 2 * (p - 1) * link.alpha + 2 * (p - 1) / p * S * link.beta
        assert cost_model.predict("ring", S, sizes, net) == pytest.approx(expected), sizes


def test_bus_bandwidth_follows_nccl_tests():
    algbw, busbw = cost_model.bus_bandwidth(8e6, 1e-3, 8)
    assert algbw == pytest.approx(8e9)
    assert busbw == pytest.approx(8e9 * 2 * 7 / 8)


@pytest.mark.parametrize(
    ("text", "sizes"),
    [
        ("4K:64K", [4096, 16384, 65536]),
        ("1M", [2**20]),
        ("100,4K,2G", [100, 4096, 2 * 2**30]),
    ],
)
def test_parse_sizes(text, sizes):
    assert bench.parse_sizes(text) == sizes


def test_parse_size_rejects_garbage():
    with pytest.raises(ValueError, match="bad size '4Q'"):
        bench.parse_size("4Q")


def test_bench_cli_checks_every_algorithm_against_psum(tmp_path, capsys):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = [
        "bench", "allreduce", "--mesh", "torus-4x2", "--sizes", "4K,64K",
        "--warmup", "1", "--iters", "2", "--json", str(out_json), "--plot", str(out_png), "--quiet",
    ]  # fmt: skip
    assert main(argv) == 0
    table = capsys.readouterr().out
    result = json.loads(out_json.read_text())
    assert {r["algorithm"] for r in result["rows"]} == set(bench.collectives.ALGORITHMS)
    assert len(result["rows"]) == 2 * len(bench.collectives.ALGORITHMS)
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
        intra=cost_model.Link(result["intra_link"]["alpha_s"], result["intra_link"]["beta_s_per_byte"]),
        inter=cost_model.Link(result["inter_link"]["alpha_s"], result["inter_link"]["beta_s_per_byte"]),
    )  # fmt: skip
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
    argv = ["bench", "allreduce", "--mesh", "ring-8", "--sizes", "1K", "--iters", "1", "--quiet",
            "--algorithms", "ring,torus2d"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "# skipped torus2d: needs a 2-axis mesh" in out
    assert math.isfinite(float(out.split("\n")[3].split()[2]))
    argv = ["bench", "allreduce", "--mesh", "hierarchical-2x4", "--sizes", "1K", "--iters", "1",
            "--quiet", "--algorithms", "torus2d,hierarchical", "--crossed-exchange", "off"]  # fmt: skip
    assert main(argv) == 0
    assert "hierarchical" in capsys.readouterr().out


def test_bench_in_place_donates_and_stays_correct(tmp_path):
    out_json = tmp_path / "in_place.json"
    argv = ["bench", "allreduce", "--mesh", "ring-8", "--sizes", "64K", "--iters", "2",
            "--algorithms", "native,ring,halving_doubling", "--in-place", "--quiet",
            "--json", str(out_json)]  # fmt: skip
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
        argv = ["bench", "allreduce", "--mesh", "ring-8", "--sizes", "1M", "--iters", "1",
                "--algorithms", "ring,bidirectional_ring", "--link-ports", str(ports), "--quiet",
                "--json", str(out_json)]  # fmt: skip
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
    argv = ["bench", "allreduce", "--mesh", "torus-4x2", "--sizes", "1K", "--iters", "1",
            "--algorithms", "ring", "--quiet", "--json", str(out_json)]  # fmt: skip
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
        argv = ["bench", "allreduce", "--mesh", "ring-8", "--sizes", "64K", "--iters", "1",
                "--algorithms", "ring", "--quiet", "--json", str(out_json), *extra]  # fmt: skip
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
    argv = ["bench", "allreduce", "--mesh", "torus-2x4", "--sizes", "1K", "--iters", "1",
            "--quiet", "--algorithms", "ring,hierarchical", "--inter-algorithm",
            "halving_doubling"]  # fmt: skip
    assert main(argv) == 0  # an outer axis of 2 is a power of two: it runs
    assert "skipped" not in capsys.readouterr().out
    mesh = meshes.build(meshes.from_dict({"name": "t", "layout": "hierarchical",
        "axes": [{"name": "host", "size": 3}, {"name": "local", "size": 2}]}))  # fmt: skip
    reason = bench.skip_reason("hierarchical", mesh, "halving_doubling")
    assert reason == "halving_doubling across the outer axis needs a power of two, got 3"


def test_bench_times_the_mean_against_pmean(tmp_path, capsys):
    out_json = tmp_path / "mean.json"
    argv = ["bench", "allreduce", "--mesh", "torus-4x2", "--sizes", "64K", "--iters", "2",
            "--algorithms", "ring,bidirectional_ring,torus2d", "--in-place", "--op", "mean",
            "--quiet", "--json", str(out_json)]  # fmt: skip
    assert main(argv) == 0
    assert "# allreduce (mean) on mesh torus-4x2" in capsys.readouterr().out
    result = json.loads(out_json.read_text())
    assert result["op"] == "mean" and result["in_place"] is True
    # Against psum the mean would be off by 7/8 of the sum, several units on normal inputs.
    assert all(row["max_error"] < 1e-5 for row in result["rows"]), result["rows"]
    with pytest.raises(ValueError, match=r"op must be 'sum' or 'mean', got 'max'"):
        bench.run(meshes.ring(2), [1024], ["ring"], op="max")


def test_interleaved_rounds_alternate_the_order():
    from jaxdist.bench import timing

    calls = []
    runners = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    seconds = timing.interleaved_rounds(runners, steps=2, rounds=3)
    rounds = [calls[i : i + 6] for i in range(0, 18, 6)]
    assert rounds[0] == ["a", "a", "b", "b", "c", "c"]
    assert rounds[1] == ["c", "c", "b", "b", "a", "a"]  # reversed: nobody always runs first
    assert rounds[2] == rounds[0]
    assert {name: len(times) for name, times in seconds.items()} == {"a": 3, "b": 3, "c": 3}
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        timing.interleaved_rounds(runners, steps=1, rounds=0)


def test_train_step_bench_runs_end_to_end(tmp_path, capsys):
    out_json = tmp_path / "train_step.json"
    argv = ["bench", "train-step", "--mesh", "torus-4x2", "--algorithms", "native",
            "--per-device-batch", "2", "--image-size", "8", "--width", "4", "--steps", "1",
            "--rounds", "2", "--json", str(out_json)]  # fmt: skip
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "baseline" in table and "jaxdist native" in table
    rows = json.loads(out_json.read_text())
    assert [r["variant"] for r in rows] == ["baseline", "jaxdist native"], rows
    assert rows[0]["vs_baseline"] == 1.0
    for row in rows:
        assert row["step_seconds"] > 0 and row["images_per_second"] > 0, row
        assert row["communication_seconds"] == pytest.approx(
            row["step_seconds"] - row["compute_seconds"]
        )


def test_warm_up_runs_each_runner_once_plus_warmup():
    from jaxdist.bench import timing

    calls, compiled = [], []
    runners = {name: (lambda name=name: calls.append(name)) for name in ("a", "b")}
    seconds = timing.warm_up(runners, warmup=2, on_compiled=lambda n, s: compiled.append(n))
    assert calls == ["a", "a", "a", "b", "b", "b"]
    assert compiled == ["a", "b"] and set(seconds) == {"a", "b"}
    assert all(s >= 0 for s in seconds.values())


@pytest.mark.slow  # three ResNet-50 compiles: about a minute on 2 cores
def test_resnet_bench_runs_end_to_end(tmp_path, capsys):
    """``bench resnet`` times jaxdist's step, the same step with 1x1 convolutions as nn.Conv,
    and the flax example's step, and rates the input pipeline."""
    from jaxdist.bench import resnet as resnet_bench

    out_json = tmp_path / "resnet.json"
    argv = ["bench", "resnet", "--batch", "8", "--image-size", "16", "--width", "2",
            "--steps", "1", "--rounds", "1", "--warmup", "0", "--json", str(out_json)]  # fmt: skip
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert f"{resnet_bench.JAXDIST} / flax example:" in table, table
    assert f"{resnet_bench.JAXDIST_CONV_1X1} / flax example:" in table, table
    result = json.loads(out_json.read_text())
    names = [step["name"] for step in result["steps"]]
    assert names == [resnet_bench.JAXDIST, resnet_bench.JAXDIST_CONV_1X1, resnet_bench.FLAX_EXAMPLE]
    for step in result["steps"]:
        assert step["images_per_s"] > 0 and step["compile_s"] > 0, step
    assert result["pipeline_images_per_s"] > 0 and result["devices"] == 8

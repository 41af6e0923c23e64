"""The alpha-beta cost model (jaxdist.comm.cost_model): its terms, predictions and fit."""

import math

import numpy as np
import pytest

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
        # 2-D torus: 2(X+Y-2) steps and 2(XY-1)/(XY) volume (Mikami et al. 2018)
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

"""The walk of a compiled program (jaxdist.aot.timeline) on hand-written programs: communication
counts as hidden only for the time compute runs beside it."""

import pytest

from jaxdist.aot.schedule import Collective
from jaxdist.aot.timeline import matrix_flops, walk

PEAK, HBM = 1e12, 1e18  # matrix products bound by FLOPs, nothing by bytes
DOT_FLOPS = 2 * 64 * 64 * 64  # one 64x64 by 64x64 product
TRANSFER = 1e-6  # every collective's time in these programs


def _program(body: list[str]) -> str:
    lines = "\n".join(f"  {line}" for line in body)
    return (
        "HloModule step\n\n"
        "ENTRY %main (p0: f32[64,64]) -> f32[64,64] {\n"
        "  %p0 = f32[64,64]{1,0} parameter(0)\n"
        "  %g = f32[1024]{0} parameter(1)\n"
        f"{lines}\n"
        "}\n"
    )


def _dot(name: str) -> str:
    return (
        f"%{name} = f32[64,64]{{1,0}} dot(%p0, %p0), lhs_contracting_dims={{1}}, "
        f'rhs_contracting_dims={{0}}, metadata={{op_name="jit(step)/transpose(jvp(f))/dot_general"}}'
    )


def _start(k: int, operand: str) -> str:
    return (
        f"%cp-start.{k} = (f32[1024]{{0}}, f32[1024]{{0}}, u32[], u32[]) "
        f"collective-permute-start(%{operand}), source_target_pairs={{{{0,1}},{{1,0}}}}, "
        f'metadata={{op_name="jit(step)/gradient_sync/ppermute"}}'
    )


def _done(k: int) -> str:
    return f"%cp-done.{k} = f32[1024]{{0}} collective-permute-done(%cp-start.{k})"


def _walk(body: list[str], compute: float):
    def price(collective: Collective, _inst) -> float:
        assert collective.kind == "collective-permute" and collective.role == "gradients"
        assert collective.nbytes == 4096  # the result's bytes, not the start's tuple
        return TRANSFER

    return walk(_program(body), compute, price, peak_flops=PEAK, hbm_bandwidth=HBM)


def test_a_chain_after_the_compute_is_exposed_whatever_its_windows():
    # Four dependent steps, all after backward: the first one's window holds nothing.
    body = [_dot("d0"), _dot("d1"), _dot("d2"), _start(0, "g"), _done(0)]
    body += [line for k in range(1, 4) for line in (_start(k, f"cp-done.{k - 1}"), _done(k))]
    timeline = _walk(body, compute=3e-6)
    assert timeline.gradient_seconds == pytest.approx(4 * TRANSFER)
    assert timeline.gradient_hidden_seconds == 0
    assert timeline.step_seconds == pytest.approx(3e-6 + 4 * TRANSFER)


def test_one_long_window_of_a_chain_hides_only_its_own_step():
    # The count of products inside windows says 3 of 3; the time hidden is one step of four.
    body = [_start(0, "g"), _dot("d0"), _dot("d1"), _dot("d2")]
    body += [_start(1, "g"), _done(1), _start(2, "cp-done.1"), _done(2)]
    body += [_start(3, "cp-done.2"), _done(3), _done(0)]
    timeline = _walk(body, compute=3e-6)
    assert timeline.gradient_seconds == pytest.approx(4 * TRANSFER)
    assert timeline.gradient_hidden_fraction == pytest.approx(0.25)


def test_a_collective_around_compute_is_hidden():
    body = [_dot("d0"), _start(0, "g"), _dot("d1"), _dot("d2"), _done(0)]
    timeline = _walk(body, compute=3e-6)
    assert timeline.gradient_hidden_fraction == pytest.approx(1.0)
    assert timeline.step_seconds == pytest.approx(3e-6)


def test_interleaved_steps_are_hidden_one_product_each():
    # The wait-free order: each step's start before a product, its done after it.
    body = [_dot("d0")]
    previous = "g"
    for k in range(3):
        body += [_start(k, previous), _dot(f"e{k}"), _done(k)]
        previous = f"cp-done.{k}"
    timeline = _walk(body, compute=4e-6)
    assert timeline.gradient_hidden_fraction == pytest.approx(1.0)
    assert timeline.step_seconds == pytest.approx(4e-6)


def test_a_transfer_longer_than_its_compute_is_partly_hidden():
    body = [_start(0, "g"), _dot("d0"), _done(0)]
    timeline = _walk(body, compute=0.25e-6)
    assert timeline.gradient_hidden_seconds == pytest.approx(0.25e-6)
    assert timeline.step_seconds == pytest.approx(TRANSFER)


def test_compute_is_spread_by_the_roofline():
    # A product and a copy of the same operand: the copy is bound by bytes, the product by
    # FLOPs; the step's compute is split in that ratio.
    body = [_dot("d0"), "%c = f32[64,64]{1,0} copy(%p0)"]
    flops_time = DOT_FLOPS / PEAK
    bytes_time = 2 * 64 * 64 * 4 / 1e9
    timeline = walk(_program(body), 1.0, lambda c, i: 0.0, peak_flops=PEAK, hbm_bandwidth=1e9)
    assert timeline.compute_seconds == pytest.approx(1.0)
    assert flops_time / (flops_time + bytes_time) < 1  # both weigh


def test_library_calls_count_as_the_products_they_run():
    # The three cuDNN passes of one 3x3 convolution x[8,32,32,64] * w[128,3,3,64] ->
    # y[8,32,32,128] (each keeps the forward pass's dim_labels), a cuBLAS product, a loop
    # whose body holds one product (counted once, as compilers count it), a strided
    # convolution's input gradient.
    y_w = "window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_o01i->b01f"
    conv_flops = 2 * (8 * 32 * 32 * 128) * (3 * 3 * 64)
    text = (
        "HloModule step\n\n"
        "%body (b: f32[64,64]) -> f32[64,64] {\n"
        "  %b = f32[64,64]{1,0} parameter(0)\n"
        f"  ROOT {_dot('inner').replace('%p0', '%b')}\n"
        "}\n\n"
        "ENTRY %main (x: bf16[8,32,32,64]) -> bf16[8,32,32,64] {\n"
        "  %x = bf16[8,32,32,64]{3,2,1,0} parameter(0)\n"
        "  %w = bf16[128,3,3,64]{3,2,1,0} parameter(1)\n"
        "  %p0 = f32[64,64]{1,0} parameter(2)\n"
        f"  %fwd = (bf16[8,32,32,128]{{3,2,1,0}}, u8[0]{{0}}) custom-call(%x, %w), {y_w}, "
        'custom_call_target="__cudnn$convBiasActivationForward"\n'
        "  %y = bf16[8,32,32,128]{3,2,1,0} get-tuple-element(%fwd), index=0\n"
        f"  %dx = (bf16[8,32,32,64]{{3,2,1,0}}, u8[0]{{0}}) custom-call(%y, %w), {y_w}, "
        'custom_call_target="__cudnn$convBackwardInput"\n'
        f"  %dw = (bf16[128,3,3,64]{{3,2,1,0}}, u8[0]{{0}}) custom-call(%x, %y), {y_w}, "
        'custom_call_target="__cudnn$convBackwardFilter"\n'
        "  %mm = (f32[64,32]{1,0}, s8[0]{0}) custom-call(%p0, %p0), "
        'custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":'
        '{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],'
        '"rhs_contracting_dimensions":["0"]}}}\n'
        "  %loop = f32[64,64]{1,0} while(%p0), condition=%cond, body=%body\n"
        # The input gradient of a stride-2 convolution as the TPU compiler writes it: over
        # the output gradient dilated by the stride, a quarter of its taps on real values.
        "  %dy = bf16[8,16,16,128]{3,2,1,0} parameter(3)\n"
        "  %strided_dx = bf16[8,32,32,64]{3,2,1,0} convolution(%dy, %w), "
        "window={size=3x3 pad=1_2x1_2 lhs_dilate=2x2 rhs_reversal=1x1}, dim_labels=b01f_i01o->b01f\n"
        "  ROOT %out = bf16[8,32,32,64]{3,2,1,0} get-tuple-element(%dx), index=0\n"
        "}\n"
    )
    strided_flops = 2 * (8 * 32 * 32 * 64) * (3 * 3 * 128) / 4
    assert matrix_flops(text) == 3 * conv_flops + 2 * 64 * 32 * 64 + DOT_FLOPS + strided_flops


class _Analysed:
    """A compiled or lowered program that reports ``flops`` in its cost analysis."""

    def __init__(self, flops):
        self.flops = flops

    def cost_analysis(self):
        return None if self.flops is None else {"flops": self.flops}


def test_a_gpu_step_is_counted_by_its_matrix_products_like_one_planned_without_a_gpu():
    """The GPU compiler's own count leaves out what its library calls run: on a GPU the
    optimized program's matrix products are counted, as for a GPU plan made without one
    (whose compiled program has no analysis); elsewhere the compiler's own count."""
    from jaxdist.aot.compile import _cost_analysis

    text = (
        "ENTRY %main (a: f32[8,16], b: f32[16,4]) -> f32[8,4] {\n"
        "  %a = f32[8,16]{1,0} parameter(0)\n"
        "  %b = f32[16,4]{1,0} parameter(1)\n"
        "  ROOT %d = f32[8,4]{1,0} dot(f32[8,16]{1,0} %a, f32[16,4]{1,0} %b), "
        "lhs_contracting_dims={1}, rhs_contracting_dims={0}\n"
        "}\n"
    )
    compiled, lowered = _Analysed(7.0), _Analysed(24.0)
    assert _cost_analysis(compiled, lowered, text, platform="gpu")["flops"] == 2 * 8 * 4 * 16
    assert (
        _cost_analysis(_Analysed(None), lowered, text, platform="cuda")["flops"] == 2 * 8 * 4 * 16
    )
    assert _cost_analysis(compiled, lowered, text, platform="tpu")["flops"] == 7.0
    assert _cost_analysis(_Analysed(None), lowered, text, platform="cpu")["flops"] == 24.0


def test_a_loops_products_count_once_per_turn_for_the_steps_flops():
    """A scan over five stacked layers: the compilers' count (and ``matrix_flops``) takes the
    body once; the step's FLOPs take it once per layer, as the device runs it."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from jaxdist.aot.compile import _step_flops

    def layers(x, kernels):
        return lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, kernels)[0]

    text = jax.jit(layers).lower(jnp.ones((8, 16)), jnp.ones((5, 16, 16))).compile().as_text()
    once = 2 * 8 * 16 * 16
    assert matrix_flops(text) == once
    assert matrix_flops(text, every_turn=True) == 5 * once
    assert _step_flops(3.0 * once, text) == 15.0 * once


def test_permutes_to_other_neighbours_travel_together_on_a_chip_with_two_ports():
    """Two permutes started together: one after the other on one port (a GPU behind its
    switch) or when both go to the same neighbour; side by side on a chip that drives a link
    to each neighbour (a TPU), when one goes each way round."""
    left = _start(1, "g").replace("{{0,1},{1,0}}", "{{0,1},{1,2},{2,0}}")
    right = _start(1, "g").replace("{{0,1},{1,0}}", "{{1,0},{2,1},{0,2}}")
    same = _start(1, "g").replace("{{0,1},{1,0}}", "{{0,1},{1,2},{2,0}}").replace(".1", ".2")

    def seconds(first: str, second: str, ports: int) -> float:
        second = second.replace("cp-start.1", "cp-start.2")
        body = [first, second, _done(1), _done(2)]
        price = lambda collective, inst: TRANSFER  # noqa: E731
        timeline = walk(_program(body), 0.0, price, peak_flops=PEAK, hbm_bandwidth=HBM, ports=ports)
        return timeline.step_seconds

    assert seconds(left, right, ports=1) == pytest.approx(2 * TRANSFER)
    assert seconds(left, right, ports=2) == pytest.approx(TRANSFER)
    assert seconds(left, same, ports=2) == pytest.approx(2 * TRANSFER)

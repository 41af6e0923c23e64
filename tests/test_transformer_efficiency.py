"""The transformer efficiency fit: every published run on MaxText's count of model FLOPs,
the fit by generation with v5e held out, and a plan of a transformer priced with it."""

import json

import pytest

from jaxdist.aot import transformer_efficiency as te
from jaxdist.aot.topology import libtpu_available
from jaxdist.models.transformer_flops import TransformerShape


def test_model_flops_count_matrix_products_and_the_causal_half_of_attention():
    # Llama 3 8B's shape at 8,192 tokens: 6 N + 6 L h hd T per token.
    shape = TransformerShape(32, 4096, 32, 8, 128, 14336, 3, 128256, 8192)
    per_layer = 4096 * 128 * (2 * 32 + 2 * 8) + 3 * 4096 * 14336
    assert shape.matmul_parameters == 32 * per_layer + 4096 * 128256  # about 7.5e9
    assert (
        shape.training_flops_per_token() == 6 * shape.matmul_parameters + 6 * 32 * 32 * 128 * 8192
    )


def test_each_runs_utilization_recomputed_on_one_count_agrees_with_what_it_published():
    """A run published under MaxText's 2023 count without attention (v4) or with the causal
    half (v5p) comes out within a few per cent of its own figure: the same throughput, the
    attention added or not."""
    runs = te.runs()
    v5p = [r for r in runs if r["generation"] == "v5p" and "2023c" in r["flops_convention"]]
    assert v5p and all(te.utilization(r) == pytest.approx(r["measured_mfu"], rel=0.01) for r in v5p)
    v4 = [r for r in runs if r["generation"] == "v4"]
    assert all(r["measured_mfu"] <= te.utilization(r) <= 1.03 * r["measured_mfu"] for r in v4)


def test_the_fit_keeps_v5e_out_and_pools_what_a_generation_lacks():
    runs = te.runs()
    v5e = te.fitted_efficiency("v5e", runs)
    assert v5e.pooled == "TPU" and "none of v5e" in v5e.describe()
    tpu = [
        te.utilization(r)
        for r in runs
        if r["generation"] in ("v4", "v5p", "v6e") and r["dtype"] == "bfloat16"
    ]
    assert v5e.runs == len(tpu)
    v4 = te.fitted_efficiency("v4", runs)
    assert v4.pooled == "" and v4.runs == 6 and 0.5 < v4.value < 0.6
    # A run left out is not in the median it is scored against.
    only = [r for r in runs if r["generation"] == "h200" and r["dtype"] == "bfloat16"]
    assert te.fitted_efficiency("h200", runs, leave_out=only[0]).pooled == "GPU"


def test_the_fit_takes_the_runs_of_the_plans_software_stack_first():
    """On H100, MaxText's XLA runs and torchtitan's PyTorch runs sit far apart; a plan (an XLA
    program) rests on the XLA runs, a torchtitan run is scored against torchtitan's, and a
    stack a generation has no run of falls back to the generation's other runs."""
    runs = [r for r in te.runs() if r["dtype"] == "bfloat16"]
    h100 = {
        stack: sorted(
            te.utilization(r) for r in runs if r["generation"] == "h100" and te.software(r) == stack
        )
        for stack in ("XLA", "PyTorch")
    }
    assert h100["XLA"] and h100["PyTorch"] and max(h100["PyTorch"]) < min(h100["XLA"])
    plan = te.fitted_efficiency("h100", runs)
    assert plan.stack == "XLA" and plan.sources == ("MaxText",) and plan.runs == len(h100["XLA"])
    assert plan.value == pytest.approx(h100["XLA"][len(h100["XLA"]) // 2])
    torch = te.fitted_efficiency("h100", runs, stack="PyTorch")
    assert torch.sources == ("torchtitan",) and torch.value < plan.value
    v5p = te.fitted_efficiency("v5p", runs, stack="PyTorch")  # no PyTorch run of v5p
    assert v5p.stack == "XLA" and v5p.value == te.fitted_efficiency("v5p", runs).value
    assert "on XLA (MaxText)" in plan.describe()


@pytest.mark.skipif(not libtpu_available(), reason="the TPU compiler is not installed")
def test_a_transformer_plan_prices_compute_at_the_fitted_utilization(capsys):
    from jaxdist.cli import main

    overrides = ["allreduce=native", "data.max_train_bytes=65536", "data.max_eval_bytes=8192"]
    args = ["plan", "recipes/transformer_lm.py", "--topology", "v5e:2x2", "--json"]
    assert main([*args, *(f for o in overrides for f in ("--set", o))]) == 0
    plan = json.loads(capsys.readouterr().out)
    fit = te.fitted_efficiency("v5e")
    assert plan["efficiency"] == fit.describe()
    stage = plan["stages"][0]
    compute = stage["step_seconds"]["compute"]
    per_chip = stage["model_flops_utilization"] * stage["step_seconds"]["total"]
    # Compute alone would run the model's FLOPs at the fitted utilization.
    assert per_chip / compute == pytest.approx(fit.value, rel=1e-6)

"""Names of the scopes (``jax.named_scope``) the train steps put around their communication.

They reach the compiled program's metadata, so a reader of the scheduled program
(:mod:`jaxdist.aot.schedule`) can tell gradient traffic from parameter traffic, tensor-parallel sums, BatchNorm
statistics, metrics and the loss scale's check, and price each.
"""

__all__ = [
    "GRADIENT_SCOPE",
    "ROLES",
    "SPLIT_SCOPE",
]

GRADIENT_SCOPE = "gradient_sync"  # the gradient allreduce, or a sharded step's reduce-scatter
PARAMETER_SCOPE = "parameter_gather"  # ZeRO-1's all-gather of the update, FSDP's before use
TENSOR_SCOPE = "tensor_sum"  # a tensor-parallel product's partial products summed
BATCHNORM_SCOPE = "batchnorm_statistics"  # a BatchNorm's mean and mean of squares, per step
MODEL_STATE_SCOPE = "model_state_mean"  # running statistics averaged once per step
METRICS_SCOPE = "metrics_mean"  # loss and metrics averaged for the log
# Not a collective's role: the products that sum a split parameter over its axis run inside
# it, and the check of a split step's loss (jaxdist.training.split_products) leaves them be.
SPLIT_SCOPE = "split_product"
LOSS_SCALE_SCOPE = (
    "loss_scale_check"  # whether every device's gradients are finite (loss scale, skipped steps)
)

# The role a collective inside each scope plays, as a plan names it.
ROLES = {
    GRADIENT_SCOPE: "gradients",
    PARAMETER_SCOPE: "parameters",
    TENSOR_SCOPE: "tensor",
    BATCHNORM_SCOPE: "batchnorm",
    MODEL_STATE_SCOPE: "bn running",
    METRICS_SCOPE: "metrics",
    LOSS_SCALE_SCOPE: "loss scale",
}

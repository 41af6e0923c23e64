"""Names of the scopes (``jax.named_scope``) the train steps put around their communication.

They reach the compiled program's metadata, so a reader of the scheduled program
(:mod:`jaxdist.aot.schedule`) can tell gradient traffic from parameter traffic and the rest.
"""

__all__ = ["GRADIENT_SCOPE", "PARAMETER_SCOPE"]

GRADIENT_SCOPE = "gradient_sync"  # the gradient allreduce, or ZeRO-1's reduce-scatter
PARAMETER_SCOPE = "parameter_gather"  # ZeRO-1's all-gather of the updated parameters

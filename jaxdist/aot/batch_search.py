"""The largest per-chip batch whose step fits a chip's memory, found by compiling: doubling
from the recipe's batch, then bisection (``jaxdist plan --max-batch``)."""

from __future__ import annotations

from collections.abc import Callable

from jaxdist.aot.compile import DoesNotFitError
from jaxdist.aot.plan import Plan, compile_at
from jaxdist.training.batch_schedule import DevicePlan

__all__ = ["largest_fitting_batch", "largest_fitting_batch_of"]


def largest_fitting_batch_of(
    plan: Plan, on_try: Callable[[int, DevicePlan], None] | None = None
) -> tuple[int, dict[int, int | None]]:
    """:func:`largest_fitting_batch` for the first stage of a plan: per-chip batches compiled
    with the stage's accumulation, against the chip's HBM."""
    first = plan.stages[0].device_plan

    def memory_at(per_chip: int) -> int:
        global_batch = per_chip * first.num_devices * first.accumulation_steps
        if on_try is not None:
            on_try(
                0, DevicePlan(global_batch, first.num_devices, per_chip, first.accumulation_steps)
            )
        try:
            return compile_at(plan.parts, 0, global_batch, plan.variable_shapes).memory.total
        except DoesNotFitError:
            return None

    return largest_fitting_batch(
        memory_at, int(plan.topology.chip.hbm_bytes), first.per_device_batch
    )


def largest_fitting_batch(
    memory_at: Callable[[int], int | None], capacity: int, start: int, limit: int = 1 << 16
) -> tuple[int, dict[int, int | None]]:
    """The largest per-chip batch whose step fits ``capacity`` bytes, by doubling from
    ``start`` and then bisection; ``memory_at(b)`` compiles at per-chip batch ``b`` and
    returns its bytes, or None where the compiler refused it. Returns the batch (0 if even 1
    does not fit) and every size tried."""
    tried: dict[int, int | None] = {}

    def fits(b: int) -> bool:
        if b not in tried:
            tried[b] = memory_at(b)
        return tried[b] is not None and tried[b] <= capacity

    low, high = 0, max(1, start)
    while fits(high):
        low, high = high, high * 2
        if high > limit:
            return low, tried
    if low == 0:
        low_try = 1
        if not fits(low_try):
            return 0, tried
        low = low_try
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low, tried

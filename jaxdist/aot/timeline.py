"""A compiled step walked as the device runs it: how much of the gradient communication's
*time* the compute hides.

Counting backward matrix products inside a collective's start...done window says little:
one long window of a dependent chain holds them all while its message is long gone. This
module prices every op of the compiled program's entry computation and walks the order the
compiler chose, as the chip runs it:

* one compute stream: each compute op takes its share of the step's compute time, in
  proportion to its roofline time (``max(FLOPs / peak, bytes / HBM bandwidth)``, FLOPs of its
  matrix products and convolutions, bytes of its operands and result);
* one network beside it: an asynchronous collective's transfer starts at its ``start`` and
  takes the cost model's time for its kind, bytes and group; gradient and parameter
  transfers go one at a time (a transfer issued while another is under way starts when it
  ends), the small,
  latency-bound rest (BatchNorm statistics, metrics) as issued; a ``done`` waits for its
  transfer, and a synchronous collective stops the compute stream until its own ends;
* a loop runs its body's walk once per turn, nothing beside it.

The walk gives the step's time and, per gradient transfer, the part of it that ran while the
compute stream was busy: the hidden time. Buckets whose chains run after backward read as
exposed, whatever windows they open. A sharded step's parameter all-gathers (FSDP's before
each unit is used, ZeRO-1's after the update) are bandwidth-bound like gradients: they queue
on the same network and their hidden time is counted apart.
"""

from __future__ import annotations

import bisect
import itertools
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from jaxdist.aot.schedule import (
    ASYNC_FUSION,
    COLLECTIVES,
    OPERAND,
    Collective,
    Instruction,
    collective_role,
    computations_of,
    fused_scatter,
    group_size_of,
    is_scatter_fusion,
    loop_of,
    nbytes_of,
    role_of,
    source_target_pairs,
)

__all__ = ["Timeline", "matrix_flops", "walk"]

# Ops that move no data or only rename it: no time on the compute stream.
_FREE = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "after-all",
    "opt-barrier",
    "partition-id",
    "replica-id",
    "copy-start",
    "copy-done",
    "iota",
    "add-dependency",
    "domain",
    "slice-start",
    "slice-done",
}
_DIMS = re.compile(r"\[([\d,]*)\]")


@dataclass
class Timeline:
    """The walk of one step: its time, and its gradient communication hidden or not."""

    step_seconds: float = 0.0
    compute_seconds: float = 0.0
    gradient_seconds: float = 0.0  # every gradient transfer's own time, added
    gradient_hidden_seconds: float = 0.0  # the part of it the compute stream ran beside
    parameter_seconds: float = 0.0  # a sharded step's parameter gathers, likewise
    parameter_hidden_seconds: float = 0.0
    other_seconds: dict[str, float] = field(default_factory=dict)  # by role, transfers' time
    other_hidden_seconds: dict[str, float] = field(default_factory=dict)  # by role, beside compute
    # The walk itself, for pictures: compute intervals, and (role, begin, end) of transfers.
    busy: list[tuple[float, float]] = field(default_factory=list, repr=False)
    transfers: list[tuple[str, float, float]] = field(default_factory=list, repr=False)

    @property
    def gradient_hidden_fraction(self) -> float:
        """Share of the gradient communication's time that compute hides."""
        return (
            self.gradient_hidden_seconds / self.gradient_seconds if self.gradient_seconds else 0.0
        )

    @property
    def exposed_seconds(self) -> float:
        """Time the compute stream waits: the step less its compute."""
        return max(0.0, self.step_seconds - self.compute_seconds)


def walk(
    text: str,
    compute_seconds: float,
    transfer_seconds: Callable[[Collective, Instruction], float],
    *,
    peak_flops: float,
    hbm_bandwidth: float,
    num_devices: int = 1,
    scatter_roles: Mapping[int, str] | None = None,
    ports: int = 1,
) -> Timeline:
    """Walk a compiled program's text (``compiled.as_text()``).

    ``compute_seconds`` is the step's compute time, spread over its compute ops in proportion
    to their roofline time on a chip of ``peak_flops`` and ``hbm_bandwidth``;
    ``transfer_seconds(collective, instruction)`` prices one run of a collective;
    ``scatter_roles`` gives back the roles of reduce-scatters the compiler rewrote
    (:func:`jaxdist.aot.schedule.rewritten_scatter_roles`). A chip with ``ports`` > 1 drives
    a link to each neighbour at once (a TPU's ICI): permutes to other neighbours (a
    bidirectional schedule's two directions, two mesh axes) travel together, each link one
    message at a time; with one port (a GPU behind its switch) and for every collective of
    another kind, transfers queue one after the other."""
    computations, entry = computations_of(text)
    weights = _Weights(computations, peak_flops, hbm_bandwidth)
    total_weight = weights.of_computation(entry)
    scale = compute_seconds / total_weight if total_weight else 0.0
    state = _Walk(computations, weights, scale, transfer_seconds, num_devices, scatter_roles, ports)
    state.run(entry)
    return state.timeline()


class _Weights:
    """Roofline seconds of each op (matrix products' FLOPs at peak, bytes at HBM bandwidth)."""

    def __init__(self, computations: dict[str, list[Instruction]], peak: float, hbm: float):
        self.computations = computations
        self.peak, self.hbm = peak, hbm
        self._types = {
            name: {i.name: i.type_text for i in insts} for name, insts in computations.items()
        }
        self._flops: dict[tuple[str, bool], float] = {}
        self._totals: dict[str, float] = {}

    def of(self, inst: Instruction, computation: str) -> float:
        """Roofline seconds of one op of ``computation`` (a loop: all its turns)."""
        if inst.opcode in _FREE or inst.opcode.removesuffix("-start") in COLLECTIVES:
            return 0.0
        if is_scatter_fusion(inst):  # a collective, priced as one
            return 0.0
        if inst.opcode.endswith("-done") or inst.opcode in ("call-start", "call-done"):
            return 0.0
        if inst.opcode == "while":
            body, trips = loop_of(inst, self.computations)
            return trips * self.of_computation(body) if body else 0.0
        if inst.opcode in ("call", "conditional"):
            return max((self.of_computation(c) for c in inst.called), default=0.0)
        flops = self._op_flops(inst, computation)
        return max(flops / self.peak, self._bytes(inst, computation) / self.hbm)

    def _bytes(self, inst: Instruction, computation: str) -> float:
        """Bytes an op reads and writes. A fusion reads of an operand only what it slices out
        of it, and writes of an in-place update (a dynamic-update-slice into an operand) only
        the update: a schedule's step touches one window of its bucket, not the bucket."""
        types = self._types[computation]
        operands = _operands(inst)
        if inst.opcode == "dynamic-update-slice" and len(operands) > 1:
            return 2 * nbytes_of(
                types.get(operands[1], "")
            )  # in place: the update, read and written
        if inst.opcode in ("slice", "dynamic-slice"):
            return 2 * nbytes_of(inst.type_text)
        if inst.opcode != "fusion" or not inst.called:
            return nbytes_of(inst.type_text) + sum(nbytes_of(types.get(n, "")) for n in operands)
        body = self.computations.get(inst.called[0], [])
        by_name = {i.name: i for i in body}
        users: dict[str, list[Instruction]] = {}
        for i in body:
            for n in _operands(i):
                users.setdefault(n, []).append(i)
        read = 0
        for param in (i for i in body if i.opcode == "parameter"):
            uses = users.get(param.name, [])
            if uses and all(u.opcode in ("slice", "dynamic-slice") for u in uses):
                read += sum(nbytes_of(u.type_text) for u in uses)
            elif uses and all(
                u.opcode == "dynamic-update-slice" and _operands(u)[0] == param.name for u in uses
            ):
                continue  # updated in place: the update is read as an operand of its own
            else:
                read += nbytes_of(param.type_text)
        root = body[-1] if body else inst
        outputs = (
            [by_name.get(n, root) for n in _operands(root)] if root.opcode == "tuple" else [root]
        )
        written = sum(
            nbytes_of(by_name[_operands(o)[1]].type_text)
            if o.opcode == "dynamic-update-slice" and _operands(o)[1] in by_name
            else nbytes_of(o.type_text)
            for o in outputs
        )
        return read + written

    def of_computation(self, name: str) -> float:
        if name not in self._totals:
            self._totals[name] = 0.0
            self._totals[name] = sum(self.of(i, name) for i in self.computations.get(name, []))
        return self._totals[name]

    def _op_flops(self, inst: Instruction, computation: str, every_turn: bool = False) -> float:
        """FLOPs of the matrix products and convolutions an op runs (a fusion's included; a
        loop's body once, or once per turn with ``every_turn``)."""
        if inst.opcode in ("dot", "convolution"):
            return _matmul_flops(inst, self._types[computation])
        if inst.opcode == "custom-call":
            return _library_flops(inst, self._types[computation])
        if every_turn and inst.opcode == "while":
            body, trips = loop_of(inst, self.computations)
            return trips * self.computation_flops(body, every_turn) if body else 0.0
        return sum(self.computation_flops(c, every_turn) for c in inst.called)

    def computation_flops(self, name: str, every_turn: bool = False) -> float:
        """FLOPs of a computation's matrix products, a loop's body counted once, or once per
        turn with ``every_turn``."""
        key = (name, every_turn)
        if key not in self._flops:
            self._flops[key] = 0.0
            self._flops[key] = sum(
                self._op_flops(i, name, every_turn) for i in self.computations.get(name, [])
            )
        return self._flops[key]


def _operands(inst: Instruction) -> list[str]:
    """Names of an instruction's operands (a traced program's text writes them without %)."""
    head = inst.rest.split(")")[0]
    return OPERAND.findall(head) or re.findall(r"[\w.\-]+", head)


def _shape(type_text: str) -> list[int]:
    match = _DIMS.search(type_text)
    return [int(d) for d in match.group(1).split(",") if d] if match else []


def _matmul_flops(inst: Instruction, types: dict[str, str]) -> float:
    """2 x output elements x the products each sums: a dot's contracted size, a convolution's
    kernel window times its input features (the kernel's elements over its output features)."""
    out = math.prod(_shape(inst.type_text))
    operands = _operands(inst)
    if len(operands) < 2:
        return 0.0
    lhs, rhs = (_shape(types.get(n, "")) for n in operands[:2])
    if inst.opcode == "dot":
        dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", inst.rest)
        contracted = [lhs[int(d)] for d in dims.group(1).split(",") if d] if dims and lhs else []
        return 2.0 * out * math.prod(contracted)
    labels = re.search(r"dim_labels=\w+_(\w+)->", inst.rest)
    if not labels or not rhs or "o" not in labels.group(1):
        return 0.0
    # An input gradient of a strided convolution runs over its output gradient dilated by
    # the stride: the taps that land on the holes multiply zeros, and no device runs them.
    holes = re.search(r"lhs_dilate=([\dx]+)", inst.rest)
    dilation = math.prod(int(d) for d in holes.group(1).split("x")) if holes else 1
    return 2.0 * out * math.prod(rhs) / rhs[labels.group(1).index("o")] / dilation


# A library call's operands and result, named by the convolution they compute, y = x * w:
# (where y is, where w is) for each cuDNN call. Every call keeps the forward convolution's
# dim_labels, whichever of x, w and y it computes.
_CUDNN_CONVOLUTIONS = {
    "Forward": ("result", 1),
    "BiasActivationForward": ("result", 1),
    "BackwardInput": (0, 1),
    "BackwardFilter": (1, "result"),
}
_LIBRARY_TARGET = re.compile(r'custom_call_target="([^"]*)"')


def _library_flops(inst: Instruction, types: dict[str, str]) -> float:
    """FLOPs of a matrix product or convolution the GPU compiler hands to a library: a cuDNN
    convolution, ``2 |y| |w| / (w's output features)`` whichever of its three passes it runs;
    a cuBLAS product, as a dot with the contracting dimensions of its backend config."""
    target = _LIBRARY_TARGET.search(inst.rest)
    if not target:
        return 0.0
    name = target.group(1)
    if "gemm" in name or "matmul" in name:
        dims = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', inst.rest)
        lhs = _shape(types.get(next(iter(_operands(inst)), ""), ""))
        if not dims or not lhs:
            return 0.0
        contracted = [lhs[int(d.strip('" '))] for d in dims.group(1).split(",") if d.strip()]
        return 2.0 * math.prod(_shape(inst.type_text)) * math.prod(contracted)
    conv = _CUDNN_CONVOLUTIONS.get(name.removeprefix("__cudnn$conv"))
    labels = re.search(r"dim_labels=\w+_(\w+)->", inst.rest)
    if conv is None or not labels or "o" not in labels.group(1):
        return 0.0
    operands = _operands(inst)

    def shape_at(where):
        if where == "result":
            return _shape(inst.type_text)
        return _shape(types.get(operands[where], "")) if where < len(operands) else []

    y, w = (shape_at(where) for where in conv)
    if not y or not w:
        return 0.0
    return 2.0 * math.prod(y) * math.prod(w) / w[labels.group(1).index("o")]


def matrix_flops(text: str, *, every_turn: bool = False) -> float:
    """FLOPs of a compiled program's matrix products and convolutions (library calls
    included), each loop's body counted once, as compilers' own cost analyses count it (the
    count where the compiler offers none: the GPU compiler without a GPU), or with
    ``every_turn`` once per turn, as the device runs it."""
    computations, entry = computations_of(text)
    return _Weights(computations, 1.0, 1.0).computation_flops(entry, every_turn)


# Roles whose transfers are bandwidth-bound and queue on the network one at a time.
_QUEUED = ("gradients", "parameters", "tensor")


@dataclass
class _Transfer:
    role: str
    begin: float
    end: float


class _Walk:
    """The two streams' clocks while the program is walked."""

    def __init__(
        self,
        computations,
        weights: _Weights,
        scale: float,
        price,
        num_devices: int,
        scatter_roles: Mapping[int, str] | None = None,
        ports: int = 1,
    ):
        self.computations, self.weights, self.scale = computations, weights, scale
        self.price, self.num_devices, self.scatter_roles = price, num_devices, scatter_roles
        self.now = 0.0  # the compute stream's clock
        self.ports = ports
        # When each link's queue is free, by the pairs its permutes send between.
        self.link_free: dict[tuple[tuple[int, int], ...], float] = {}
        self.network_free = 0.0  # when every link is free
        self.busy: list[tuple[float, float]] = []  # compute intervals, in time order
        self.transfers: list[_Transfer] = []
        self.in_flight: dict[str, _Transfer] = {}

    def run(self, name: str) -> None:
        for inst in self.computations.get(name, []):
            self.step(inst, name)

    def step(self, inst: Instruction, computation: str) -> None:
        if inst.opcode.endswith("-done"):
            transfer = self.in_flight.pop(inst.first_operand or "", None)
            if ASYNC_FUSION.match(inst.name):
                transfer = self.in_flight.pop(_fusion_key(inst.name), transfer)
            if transfer is not None:
                self.now = max(self.now, transfer.end)
            return
        if ASYNC_FUSION.match(inst.name) and inst.opcode == "fusion":
            self._start_inner(inst, _fusion_key(inst.name))
            return
        if inst.opcode == "call-start":
            self._start_inner(inst, inst.name)
            return
        if is_scatter_fusion(inst):  # the TPU's reduce-scatter on one host: synchronous
            collective, inner = fused_scatter(
                inst, self.computations, self.num_devices, self.scatter_roles or {}
            )
            self.now = max(self.now, self._queued(collective, inner).end)
            return
        if inst.opcode == "while":
            body, trips = loop_of(inst, self.computations)
            for _ in range(trips if body else 0):
                self.run(body)
            return
        kind = inst.opcode.removesuffix("-start")
        if kind in COLLECTIVES:
            transfer = self._transfer(inst, kind)
            if inst.opcode.endswith("-start"):
                self.in_flight[inst.name] = transfer
            else:
                self.now = max(self.now, transfer.end)
            return
        self.compute(self.weights.of(inst, computation) * self.scale)

    def compute(self, seconds: float) -> None:
        if seconds > 0:
            self.busy.append((self.now, self.now + seconds))
            self.now += seconds

    def _start_inner(self, inst: Instruction, key: str) -> None:
        """An asynchronous collective made of a called computation (a TPU async collective
        fusion, a SparseCore call): the collective inside it is in flight until ``key``'s done."""
        inner = next(
            (
                i
                for name in inst.called
                for i in self.computations.get(name, [])
                if i.opcode.removesuffix("-start") in COLLECTIVES
            ),
            None,
        )
        if inner is not None:
            self.in_flight[key] = self._transfer(inner, inner.opcode.removesuffix("-start"))

    def _transfer(self, inst: Instruction, kind: str) -> _Transfer:
        nbytes = _result_bytes(inst)
        role = collective_role(kind, nbytes, role_of(inst.op_name), self.scatter_roles)
        collective = Collective(kind, nbytes, True, role, group_size_of(inst, self.num_devices))
        return self._queued(collective, inst)

    def _queued(self, collective: Collective, inst: Instruction) -> _Transfer:
        """``collective`` (of instruction ``inst``) started now, or once the links it shares
        with the transfers before it are free."""
        seconds = self.price(collective, inst)
        if collective.role not in _QUEUED:  # small, latency-bound: not queued behind them
            transfer = _Transfer(collective.role, self.now, self.now + seconds)
            self.transfers.append(transfer)
            return transfer
        if collective.kind == "collective-permute" and self.ports > 1:  # on its own links
            link = source_target_pairs(inst)
            begin = max(self.now, self.network_free, self.link_free.get(link, 0.0))
            self.link_free[link] = begin + seconds
        else:
            begin = max(self.now, self.network_free, *self.link_free.values())
            self.network_free = begin + seconds
        transfer = _Transfer(collective.role, begin, begin + seconds)
        self.transfers.append(transfer)
        return transfer

    def timeline(self) -> Timeline:
        end = max([self.now, *(t.end for t in self.transfers)])
        starts = [a for a, _ in self.busy]
        done_before = list(itertools.accumulate((b - a for a, b in self.busy), initial=0.0))
        result = Timeline(
            step_seconds=end,
            compute_seconds=done_before[-1],
            busy=self.busy,
            transfers=[(t.role, t.begin, t.end) for t in self.transfers],
        )

        def busy_until(moment: float) -> float:
            """Compute seconds finished by ``moment``."""
            k = bisect.bisect_right(starts, moment)
            if k == 0:
                return 0.0
            a, b = self.busy[k - 1]
            return done_before[k - 1] + min(moment, b) - a

        for t in self.transfers:
            seconds = t.end - t.begin
            hidden = max(0.0, busy_until(t.end) - busy_until(t.begin))  # no rounding below 0
            if t.role == "gradients":
                result.gradient_seconds += seconds
                result.gradient_hidden_seconds += hidden
            elif t.role == "parameters":
                result.parameter_seconds += seconds
                result.parameter_hidden_seconds += hidden
            else:
                result.other_seconds[t.role] = result.other_seconds.get(t.role, 0.0) + seconds
                hidden_before = result.other_hidden_seconds.get(t.role, 0.0)
                result.other_hidden_seconds[t.role] = hidden_before + hidden
        return result


def _result_bytes(inst: Instruction) -> int:
    """Bytes of a collective's result on one device: an asynchronous start's type is a tuple
    whose first part is its operand and second its result."""
    if inst.opcode.endswith("-start") and inst.type_text.startswith("("):
        arrays = re.findall(r"[a-z]+\d*(?:e\d+m\d+(?:fn)?)?\[[\d,]*\]", inst.type_text)
        if len(arrays) >= 2:
            return nbytes_of(arrays[1])
    return nbytes_of(inst.type_text)


def _fusion_key(name: str) -> str:
    return f"async-collective{ASYNC_FUSION.match(name).group(2)}"

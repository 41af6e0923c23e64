"""What the compiler scheduled: the collectives of a compiled step and the compute around them.

A compiled program's text (``compiled.as_text()``) lists its entry computation in the order
the device runs it. An asynchronous collective is a ``*-start`` and a ``*-done`` (one handed to
the TPU's SparseCores: a ``call-start`` and a ``call-done``); whatever the scheduler placed
between the two runs while the data moves. This module reads that order:

* every collective: its kind, bytes, the size of the device group it joins, whether it is
  asynchronous, and its role, from the named scope the step gives it
  (:data:`jaxdist.comm.scopes.ROLES`: gradients, parameters, BatchNorm statistics, running
  statistics, metrics, the loss scale's check); a collective outside them is ``"other"`` and
  keeps its source op's name, so a plan can say where it comes from;
* the compute: matrix products and convolutions (a GPU program's cuBLAS and cuDNN calls
  included), counted inside fusions and loops, and whether each belongs to the backward
  pass (the metadata of a transposed op says so).

The backward compute between a gradient collective's start and its done says where the
compiler put its window. Counts are of matrix products and convolutions, not FLOPs: they say
where the work is, not how long anything waited. One long window of a chain of dependent
steps can hold most of backward while the rest of the chain runs after it; how much of the
communication's time the compute hides is the walk of :mod:`jaxdist.aot.timeline`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from jaxdist.comm.scopes import ROLES

__all__ = [
    "Collective",
    "Schedule",
    "read_schedule",
]


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_MATMULS = ("convolution", "dot")
_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "bf16": 2,
    "f16": 2,
    "s16": 2,
    "u16": 2,
    "f32": 4,
    "s32": 4,
    "u32": 4,
    "f64": 8,
    "s64": 8,
    "u64": 8,
}
# A compiled program names its instructions "%name", the program as traced "name".
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (.+?) ([a-z][a-z0-9\-]*)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+(?:fn)?)?)\[([\d,]*)\]")
_CALLS = re.compile(r"(?:calls|body|condition|to_apply|branch_computations)=\{?%?([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
# An operand as a compiled program writes it: "%name".
OPERAND = re.compile(r"%([\w.\-]+)")
# Matrix products and convolutions that a GPU program hands to a library (cuBLAS, cuDNN).
_LIBRARY_MATMUL = re.compile(r'custom_call_target="[^"]*(?:conv|gemm|matmul)', re.IGNORECASE)


@dataclass
class Collective:
    """One collective of the scheduled program."""

    kind: str  # "all-reduce", "collective-permute", ...
    nbytes: int  # bytes of its result on one device
    asynchronous: bool
    role: str  # a value of jaxdist.comm.scopes.ROLES, or "other"
    group_size: int = 2  # devices in its group (a permute: the two ends of one message)
    source: str = ""  # the op it was traced from (jax's op_name), for the unexplained ones
    turns: int = 1  # how many times it runs per step (inside a loop: the loop's turns)
    in_loop: bool = False  # inside a loop's body: nothing outside the loop overlaps it
    loop_computes: bool = False  # that loop's body runs matrix products (scanned layers)
    backward_between: int = 0  # backward matrix products between start and done
    compute_between: int = 0  # all matrix products between start and done


@dataclass
class Schedule:
    """The collectives and compute of a compiled program's entry computation, in order."""

    collectives: list[Collective] = field(default_factory=list)
    matmuls: int = 0  # matrix products and convolutions in the whole step
    backward_matmuls: int = 0
    # Backward matrix products that run while a gradient collective is in flight.
    backward_during_gradients: int = 0

    def by_kind(self) -> list[dict]:
        """One row per (role, kind): count and bytes per step, how many are asynchronous,
        inside a loop, with backward compute inside, and the most backward compute inside one."""
        rows: dict[tuple[str, str], dict] = {}
        for c in self.collectives:
            row = rows.setdefault(
                (c.role, c.kind),
                {
                    "role": c.role,
                    "kind": c.kind,
                    "count": 0,
                    "bytes": 0,
                    "async": 0,
                    "in_loop": 0,
                    "with_backward_inside": 0,
                    "most_backward_inside": 0,
                },
            )
            row["count"] += c.turns
            row["bytes"] += c.nbytes * c.turns
            row["async"] += c.asynchronous * c.turns
            row["in_loop"] += c.in_loop * c.turns
            row["with_backward_inside"] += (c.backward_between > 0) * c.turns
            row["most_backward_inside"] = max(row["most_backward_inside"], c.backward_between)
        order = {role: i for i, role in enumerate([*ROLES.values(), "other"])}
        return sorted(rows.values(), key=lambda r: (order[r["role"]], -r["bytes"]))

    def unexplained_sources(self) -> dict[str, int]:
        """Per step, how many collectives of role ``"other"`` each source op runs."""
        counts: dict[str, int] = {}
        for c in self.collectives:
            if c.role == "other":
                source = c.source or "(no metadata, nor any user with some)"
                counts[source] = counts.get(source, 0) + c.turns
        return counts

    @property
    def gradient_collectives(self) -> list[Collective]:
        return [c for c in self.collectives if c.role == "gradients"]

    @property
    def overlapped_backward_fraction(self) -> float:
        """Share of the backward matrix products inside a gradient collective's start..done
        window: where the windows are, not the time they hide (see the module docstring)."""
        if not self.backward_matmuls:
            return 0.0
        return self.backward_during_gradients / self.backward_matmuls


@dataclass
class Instruction:
    name: str
    type_text: str
    opcode: str
    rest: str

    @property
    def op_name(self) -> str:
        match = _OP_NAME.search(self.rest)
        return match.group(1) if match else ""

    @property
    def called(self) -> list[str]:
        return _CALLS.findall(self.rest)

    @property
    def first_operand(self) -> str | None:
        match = re.match(r"\s*%([\w.\-]+)", self.rest)
        return match.group(1) if match else None


def computations_of(text: str) -> tuple[dict[str, list[Instruction]], str]:
    """Every computation's instructions by name, and the entry computation's name."""
    computations: dict[str, list[Instruction]] = {}
    current, entry = None, ""
    for line in text.splitlines():
        if line.endswith("{") and not line.startswith((" ", "HloModule")):
            head = line.removesuffix("{").split("(")[0].split()
            current = head[-1].lstrip("%")
            if head[0] == "ENTRY":
                entry = current
            computations[current] = []
        elif line.startswith("}"):
            current = None
        elif current is not None:
            match = _INSTRUCTION.match(line)
            if match:
                computations[current].append(Instruction(*match.groups()))
    if not entry:
        raise ValueError("no ENTRY computation in the compiled program's text")
    return computations, entry


def nbytes_of(type_text: str) -> int:
    """Bytes of every array in an HLO type (a tuple's parts added)."""
    total = 0
    for dtype, dims in _ARRAY.findall(type_text):
        size = 1
        for d in filter(None, dims.split(",")):
            size *= int(d)
        total += size * _BYTES.get(dtype, 4)
    return total


def role_of(op_name: str) -> str:
    """The role of a collective from its op name: the scope it was traced in, also where a
    transformation wraps it (``jvp(parameter_gather)``, as FSDP's forward gathers read)."""
    for scope, role in ROLES.items():
        if re.search(rf"[/(]{scope}[)/]", op_name):
            return role
    return "other"


_GROUPS = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]")


def source_target_pairs(inst: Instruction) -> tuple[tuple[int, int], ...]:
    """A permute's ``(source, target)`` device pairs, as its ``source_target_pairs`` lists
    them."""
    listed = inst.rest.split("source_target_pairs=")[-1].split("}}")[0]
    return tuple((int(a), int(b)) for a, b in re.findall(r"(\d+),(\d+)", listed))


def group_size_of(inst: Instruction, num_devices: int) -> int:
    """Devices in the collective's group: from its replica groups (listed, or in the iota
    form ``[groups,size]<=[...]``); a permute's message joins two; no groups means all."""
    if inst.opcode.startswith("collective-permute"):
        return 2
    listed = _GROUPS.search(inst.rest)
    if listed:
        return len([d for d in listed.group(1).split(",") if d])
    iota = _IOTA_GROUPS.search(inst.rest)
    if iota:
        return int(iota.group(2))
    return num_devices


def read_schedule(
    text: str, num_devices: int = 1, scatter_roles: Mapping[int, str] | None = None
) -> Schedule:
    """The :class:`Schedule` of a compiled program from its text (``compiled.as_text()``);
    ``num_devices`` is the group of a collective that lists no groups (all of them).
    ``scatter_roles`` (:func:`rewritten_scatter_roles`) gives back the roles of the
    reduce-scatters the compiler rewrote."""
    computations, entry = computations_of(text)
    inner_matmuls: dict[str, tuple[int, int]] = {}

    def matmuls_in(name: str) -> tuple[int, int]:
        """(all, backward) matrix products inside a called computation."""
        if name not in inner_matmuls:
            inner_matmuls[name] = (0, 0)  # a guard against cycles while it is counted
            found = [_matmuls_of(inst, matmuls_in) for inst in computations.get(name, [])]
            inner_matmuls[name] = (sum(f[0] for f in found), sum(f[1] for f in found))
        return inner_matmuls[name]

    schedule = Schedule()
    _walk(
        computations,
        entry,
        schedule,
        matmuls_in,
        turns=1,
        in_loop=False,
        top=True,
        num_devices=num_devices,
        scatter_roles=scatter_roles or {},
    )
    return schedule


# What a reduce-scatter the compiler rewrote is called in a plan's list of sources.
REWRITTEN_SCATTER = "a reduce-scatter the compiler made an all-reduce and a slice"


def rewritten_scatter_roles(traced_text: str, num_devices: int) -> dict[int, str]:
    """The role of each reduce-scatter of the program as traced
    (``lowered.as_text(dialect="hlo", debug_info=True)``), by the bytes of its whole input.

    The TPU compiler compiles a reduce-scatter as an all-reduce of its whole input followed
    by a slice, and the all-reduce keeps none of the reduce-scatter's metadata: an FSDP
    step's gradients would read as collectives of no role. :func:`collective_role` gives an
    all-reduce of no role whose bytes are such an input that reduce-scatter's role."""
    roles: dict[int, str] = {}
    for line in traced_text.splitlines():
        match = _INSTRUCTION.match(line)
        if not match or match.group(3) != "reduce-scatter":
            continue
        inst = Instruction(*match.groups())
        # role_of looks for a scope after a "/" or "(", and a traced name may start with one.
        role = role_of(f"/{inst.op_name}")
        if role != "other":
            roles[nbytes_of(inst.type_text) * group_size_of(inst, num_devices)] = role
    return roles


def collective_role(
    kind: str, nbytes: int, role: str, scatter_roles: Mapping[int, str] | None
) -> str:
    """``role``, or for an all-reduce of no role that is a rewritten reduce-scatter (see
    :func:`rewritten_scatter_roles`), that reduce-scatter's."""
    if kind == "all-reduce" and role == "other" and scatter_roles:
        return scatter_roles.get(nbytes, role)
    return role


def _walk(
    computations, name, schedule, matmuls_in, *, turns, in_loop, top, num_devices, scatter_roles
) -> None:
    """Read one computation in order: its collectives (those inside a loop's body counted
    once per turn) and the matrix products between each start and done."""
    open_starts: dict[str, Collective] = {}
    instructions = computations.get(name, [])
    used_as = _names_by_use(instructions)
    for inst in instructions:
        total, backward = _matmuls_of(inst, matmuls_in)
        if top:
            schedule.matmuls += total
            schedule.backward_matmuls += backward
            if any(c.role == "gradients" for c in open_starts.values()):
                schedule.backward_during_gradients += backward
        for pending in open_starts.values():
            pending.compute_between += total
            pending.backward_between += backward
        if inst.opcode == "while":
            body, trips = loop_of(inst, computations)
            if body:
                first = len(schedule.collectives)
                _walk(
                    computations,
                    body,
                    schedule,
                    matmuls_in,
                    turns=turns * trips,
                    in_loop=True,
                    top=False,
                    num_devices=num_devices,
                    scatter_roles=scatter_roles,
                )
                for collective in schedule.collectives[first:]:
                    collective.loop_computes = collective.loop_computes or total > 0
            continue
        if inst.opcode in ("conditional", "call"):
            for called in inst.called:
                _walk(
                    computations,
                    called,
                    schedule,
                    matmuls_in,
                    turns=turns,
                    in_loop=in_loop,
                    top=False,
                    num_devices=num_devices,
                    scatter_roles=scatter_roles,
                )
            continue
        if is_scatter_fusion(inst):
            collective, _ = fused_scatter(
                inst,
                computations,
                num_devices,
                scatter_roles,
                used_as.get(inst.name, ""),
                turns=turns,
                in_loop=in_loop,
            )
            schedule.collectives.append(collective)
            continue
        if ASYNC_FUSION.match(inst.name) and inst.opcode == "fusion":
            _read_async_fusion(
                inst,
                computations,
                open_starts,
                schedule,
                turns=turns,
                in_loop=in_loop,
                num_devices=num_devices,
                scatter_roles=scatter_roles,
            )
            continue
        if inst.opcode == "call-start":
            # A collective handed to another engine: the TPU's SparseCore runs an offloaded
            # all-reduce while the TensorCore computes (async_execution_thread="sparsecore").
            _open_inner_collective(
                inst,
                inst.name,
                computations,
                open_starts,
                schedule,
                turns=turns,
                in_loop=in_loop,
                num_devices=num_devices,
                scatter_roles=scatter_roles,
            )
            continue
        if inst.opcode.endswith("-done"):  # a collective's or a call's; other dones close none
            _close(open_starts, inst.first_operand or "", inst)
            continue
        kind = inst.opcode.removesuffix("-start")
        if kind not in COLLECTIVES:
            continue
        op_name = inst.op_name or used_as.get(inst.name, "")
        collective = _collective(
            inst,
            op_name,
            inst.opcode.endswith("-start"),
            num_devices,
            scatter_roles,
            turns=turns,
            in_loop=in_loop,
        )
        schedule.collectives.append(collective)
        if collective.asynchronous:
            open_starts[inst.name] = collective


# The TPU compiler's asynchronous collectives made by its "async collective fusion": a start
# and a done fusion named alike, with the collective inside the start's computation, and the
# compute between them fused with the collective's progress.
ASYNC_FUSION = re.compile(r"^async-collective-(start|done)(.*)$")


# The TPU compiler's reduce-scatter on a slice of one host: a fusion calling a computation of
# this name, an all-reduce of the whole buffer and a slice of it, run as a reduce-scatter
# whose result is the fusion's (one device's part).
FUSED_SCATTER = "a reduce-scatter the compiler fused (all-reduce-scatter)"
SCATTER_FUSION = re.compile(r"^all-reduce-scatter(\.[\w.\-]*)?$")


def is_scatter_fusion(inst: Instruction) -> bool:
    """Whether ``inst`` is the TPU compiler's reduce-scatter fusion (:data:`SCATTER_FUSION`)."""
    return inst.opcode == "fusion" and any(SCATTER_FUSION.match(c) for c in inst.called)


def fused_scatter(
    inst: Instruction,
    computations: Mapping[str, list[Instruction]],
    num_devices: int,
    scatter_roles: Mapping[int, str],
    users_name: str = "",
    *,
    turns: int = 1,
    in_loop: bool = False,
) -> tuple[Collective, Instruction]:
    """The reduce-scatter an ``all-reduce-scatter`` fusion runs, and the all-reduce inside it:
    its group that all-reduce's, its bytes the fusion's result (one device's part), its role
    from the fused all-reduce's op name (else the fusion's, else ``users_name``, that of the
    nearest users that have one)."""
    inner = next(
        i
        for name in inst.called
        for i in computations.get(name, [])
        if i.opcode.removesuffix("-start") == "all-reduce"
    )
    collective = _collective(
        inner,
        inner.op_name or inst.op_name or users_name,
        False,
        num_devices,
        scatter_roles,
        turns=turns,
        in_loop=in_loop,
    )
    collective.kind, collective.nbytes = "reduce-scatter", nbytes_of(inst.type_text)
    # The fusion keeps no metadata and the compiler pads its rows, so its bytes need not be a
    # traced reduce-scatter's: where every traced reduce-scatter has one role, it is that.
    roles = set(scatter_roles.values())
    if collective.role == "other" and len(roles) == 1:
        collective.role, collective.source = roles.pop(), FUSED_SCATTER
    return collective, inner


def _collective(inst, op_name, asynchronous, num_devices, scatter_roles, *, turns, in_loop):
    """The :class:`Collective` of one instruction, its role read from ``op_name`` (or, for a
    rewritten reduce-scatter, from ``scatter_roles``)."""
    kind, nbytes = inst.opcode.removesuffix("-start"), nbytes_of(inst.type_text)
    named = role_of(op_name)
    role = collective_role(kind, nbytes, named, scatter_roles)
    source = REWRITTEN_SCATTER if role != named else _source(op_name)
    return Collective(
        kind,
        nbytes,
        asynchronous,
        role,
        group_size_of(inst, num_devices),
        source,
        turns=turns,
        in_loop=in_loop,
    )


def _read_async_fusion(
    inst, computations, open_starts, schedule, *, turns, in_loop, num_devices, scatter_roles
):
    """Open (a start) or close (a done) the asynchronous collective of a TPU async
    collective fusion."""
    phase, suffix = ASYNC_FUSION.match(inst.name).groups()
    key = f"async-collective{suffix}"
    if phase == "done":
        _close(open_starts, key, inst)
        return
    _open_inner_collective(
        inst,
        key,
        computations,
        open_starts,
        schedule,
        turns=turns,
        in_loop=in_loop,
        num_devices=num_devices,
        scatter_roles=scatter_roles,
    )


def _close(open_starts: dict[str, Collective], key: str, done: Instruction) -> None:
    """End the collective in flight under ``key``, if any: its bytes are the done's result."""
    started = open_starts.pop(key, None)
    if started is not None:
        started.nbytes = nbytes_of(done.type_text)


def _open_inner_collective(
    inst, key, computations, open_starts, schedule, *, turns, in_loop, num_devices, scatter_roles
):
    """Record the collective inside the computations ``inst`` calls as asynchronous and in
    flight until the done that closes ``key``; an instruction calling none is not one."""
    inner = next(
        (
            i
            for name in inst.called
            for i in computations.get(name, [])
            if i.opcode.removesuffix("-start") in COLLECTIVES
        ),
        None,
    )
    if inner is None:
        return
    collective = _collective(
        inner, inner.op_name, True, num_devices, scatter_roles, turns=turns, in_loop=in_loop
    )
    schedule.collectives.append(collective)
    open_starts[key] = collective


def _source(op_name: str) -> str:
    """An op name without its ``jit(...)/`` prefix: the path of scopes to the source op."""
    return op_name.split("/", 1)[-1] if op_name else ""


def _names_by_use(instructions: list[Instruction]) -> dict[str, str]:
    """The op name standing for each collective whose own metadata is gone (a collective XLA
    made by combining several keeps none): that of the nearest instructions using its
    result (an async one's: its done's) that have one, looking through users without
    metadata (tuple elements, bitcasts) breadth first; a gradient user's if any."""
    done_of = {i.first_operand: i.name for i in instructions if i.opcode.endswith("-done")}
    by_name = {i.name: i for i in instructions}
    users: dict[str, list[str]] = {}
    for inst in instructions:
        for used in dict.fromkeys(OPERAND.findall(inst.rest)):
            users.setdefault(used, []).append(inst.name)

    def first_named_user(start: str) -> str:
        # A combined collective may carry several roles; the gradients' wins, as pricing it
        # with the step's gradients is closer than pricing gradient bytes as metrics.
        frontier, seen, named = [start], {start}, []
        while frontier and not named:
            following = []
            for name in frontier:
                for user in users.get(name, []):
                    if by_name[user].op_name:
                        named.append(by_name[user].op_name)
                    elif user not in seen:
                        seen.add(user)
                        following.append(user)
            frontier = following
        gradient = [n for n in named if role_of(n) == "gradients"]
        return (gradient or named or [""])[0]

    return {
        inst.name: first_named_user(done_of.get(inst.name, inst.name))
        for inst in instructions
        if not inst.op_name
        and (inst.opcode.removesuffix("-start") in COLLECTIVES or is_scatter_fusion(inst))
    }


def loop_of(
    inst: Instruction, computations: dict[str, list[Instruction]]
) -> tuple[str | None, int]:
    """A ``while`` instruction's body computation (None if it names none) and its turns."""
    body = re.search(r"body=%([\w.\-]+)", inst.rest)
    # The compiler's own count where it gives one (the GPU compiler's condition compares
    # with a loop-carried bound, not a constant).
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', inst.rest)
    condition = re.search(r"condition=%([\w.\-]+)", inst.rest)
    if known:
        trips = int(known.group(1))
    else:
        trips = trip_count(computations.get(condition.group(1), [])) if condition else 1
    return (body.group(1) if body else None), trips


def trip_count(condition: list[Instruction]) -> int:
    """Turns of a counted loop (``fori_loop``): the bound its condition compares with."""
    bounds = [
        int(m)
        for inst in condition
        if inst.opcode == "constant"
        for m in re.findall(r"^\s*(-?\d+)\)", inst.rest)
    ]
    return max([b for b in bounds if b > 0], default=1)


def _matmuls_of(inst: Instruction, matmuls_in) -> tuple[int, int]:
    """(all, backward) matrix products an instruction runs, its called computations included
    (a fusion's body, a loop's body). A product inside a fusion counts as backward when the
    fusion's own metadata says so, as the fused ops' metadata may be dropped."""
    is_backward = "transpose(" in inst.op_name
    if inst.opcode in _MATMULS or (
        inst.opcode == "custom-call" and _LIBRARY_MATMUL.search(inst.rest)
    ):
        return 1, int(is_backward)
    total = backward = 0
    for name in inst.called:
        inner_total, inner_backward = matmuls_in(name)
        total += inner_total
        backward += inner_total if is_backward else inner_backward
    return total, backward

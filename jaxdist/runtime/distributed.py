"""Joining a multi-process run: one call, :func:`initialize`, before JAX starts its backend.

Where the process group comes from, first match wins:

1. explicit arguments to :func:`initialize`;
2. jaxdist's own variables ``JAXDIST_COORDINATOR`` (``host:port`` of process 0),
   ``JAXDIST_NUM_PROCESSES``, ``JAXDIST_PROCESS_ID`` and optionally ``JAXDIST_LOCAL_DEVICES``
   (forced CPU devices per process) and ``JAXDIST_TIMEOUT`` (seconds) -- set by
   ``jaxdist launch`` and ``jaxdist cluster``, or by hand;
3. a cluster JAX recognises itself: SLURM (``srun``), Open MPI
   (``mpirun``), a Cloud TPU VM / pod slice, a Kubernetes indexed Job. jaxdist only checks
   their environment variables here (no network queries) and leaves the details -- the
   coordinator host, the ranks -- to ``jax.distributed.initialize``.

When none of these applies, or the run has a single process, :func:`initialize` does nothing
and JAX runs as one process. On CPU, cross-process collectives use gloo; JAX's distributed
runtime carries the rendezvous, heartbeats and the key-value store gloo bootstraps from --
jaxdist adds no transport of its own.

A process that cannot reach its peers raises :class:`DistributedInitError` naming the process,
the coordinator address and the timeout that ran out, instead of waiting forever.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DistributedInitError",
    "PeerLostError",
    "ProcessGroup",
    "describe",
    "detect",
    "initialize",
    "peer_lost",
    "shutdown",
]

ENV_COORDINATOR = "JAXDIST_COORDINATOR"
ENV_NUM_PROCESSES = "JAXDIST_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXDIST_PROCESS_ID"
ENV_LOCAL_DEVICES = "JAXDIST_LOCAL_DEVICES"
ENV_TIMEOUT = "JAXDIST_TIMEOUT"
# Who set the variables above: ``jaxdist launch`` or ``jaxdist cluster`` (unset: by hand).
ENV_LAUNCHER = "JAXDIST_LAUNCHER"
JAXDIST_ENV = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
# The same three as arguments of initialize() (on the command line: --coordinator,
# --num-processes, --process-id).
_ARGUMENT_NAMES = ("coordinator_address", "num_processes", "process_id")

DEFAULT_TIMEOUT_S = 300
# A peer that stops sending heartbeats for this long is declared dead and the survivors fail,
# rather than blocking forever inside a collective.
DEFAULT_HEARTBEAT_TIMEOUT_S = 60


BACKEND_STARTED = (
    "jaxdist.runtime.distributed.initialize() must run before JAX starts a backend, but one is already "
    "running (something called jax.devices() or ran a computation first)"
)


class DistributedInitError(RuntimeError):
    """This process could not join the process group (bad configuration or a timeout)."""

    exit_code = 1


class PeerLostError(RuntimeError):
    """A collective across processes failed because another process of the run is gone (it
    was killed, or its host failed): one line, exit 1."""

    exit_code = 1


# What the runtime's error says when a collective lost its peer: the CPU collectives' transport
# (gloo, MPI) or the coordination service.
_PEER_FAILURE = re.compile(
    r"gloo|mpi|connection (reset|refused|closed)|socket|peer|heartbeat|coordination",
    re.IGNORECASE,
)


def peer_lost(err: BaseException, process_count: int) -> PeerLostError | None:
    """The one-line error for ``err`` (a runtime error of a collective) when it says that a
    peer of this ``process_count``-process run is gone; None for any other error."""
    message = str(err).strip().splitlines()[0] if str(err).strip() else ""
    if process_count < 2 or not _PEER_FAILURE.search(message):
        return None
    return PeerLostError(
        f"another process of the run is gone ({message}): every process stops; rerun the "
        "same command to resume from the newest complete checkpoint"
    )


@dataclass(frozen=True)
class ProcessGroup:
    """Where this process sits in a multi-process run, and who told us.

    Attributes:
      source: ``"arguments"``, ``"jaxdist-env"``, or the name of a cluster JAX detects
        (``"slurm"``, ``"ompi"``, ``"tpu"`` (GKE), ``"tpu-vm"`` (a Cloud TPU VM, found by its
        chips), ``"kubernetes"``); ``"none"`` for a single process.
      coordinator_address: ``host:port`` of process 0; ``None`` lets JAX find it (clusters)
        until the group is joined (:func:`initialize` returns what JAX found).
      num_processes / process_id: ``None`` lets JAX find them (clusters), as above.
      local_device_count: forced CPU devices in this process; ``None`` leaves the platform's.
      launcher: what set the ``JAXDIST_*`` variables (``"jaxdist launch"``,
        ``"jaxdist cluster"``), from ``JAXDIST_LAUNCHER``; ``None`` when set by hand.
    """

    source: str
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_count: int | None = None
    launcher: str | None = None

    @property
    def is_multiprocess(self) -> bool:
        return self.source != "none" and self.num_processes != 1


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise DistributedInitError(f"{name} must be an integer, got {raw!r}") from None


# TPU chips on the PCI bus: Google's vendor id and the device id of each TPU generation
# (v3, v4, v5p, v5e, v6e, TPU7x and one without a public name), as PCI lists them.
GOOGLE_PCI_VENDOR = "0x1ae0"
TPU_PCI_DEVICES = ("0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076")


def _cloud_tpu_chips(pci_devices: str = "/sys/bus/pci/devices") -> int:
    """TPU chips attached to this machine, counted on the PCI bus in sysfs without starting a
    backend; 0 where sysfs cannot be read."""
    chips = 0
    try:
        for device in Path(pci_devices).iterdir():
            vendor, model = device / "vendor", device / "device"
            if vendor.is_file() and vendor.read_text().strip() == GOOGLE_PCI_VENDOR:
                chips += model.is_file() and model.read_text().strip() in TPU_PCI_DEVICES
    except OSError:
        return 0
    return chips


def _tpu_platform_allowed() -> bool:
    """Whether JAX may use TPUs here: not when ``JAX_PLATFORMS`` names others only (as
    ``--cpu-devices`` does: a dry run on CPU must not join the TPU workers)."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    return not platforms or "tpu" in platforms.lower().split(",")


def _detect_cluster() -> tuple[str, int | None] | None:
    """(name, process count if known) of a cluster that ``jax.distributed`` detects itself.

    Mirrors the cheap, local part of the cluster checks ``jax.distributed`` runs:
    environment variables, and for a Cloud TPU VM the TPU chips in sysfs. The rest of those
    checks would contact a metadata server or the Kubernetes API, which a single-process run
    on an ordinary machine must never wait on.
    """
    env = os.environ
    if "OMPI_MCA_orte_hnp_uri" in env:  # mpirun (Open MPI <= 4)
        return "ompi", _env_int("OMPI_COMM_WORLD_SIZE")
    slurm = (
        "SLURM_JOB_ID",
        "SLURM_STEP_NODELIST",
        "SLURM_NTASKS",
        "SLURM_PROCID",
        "SLURM_LOCALID",
        "SLURM_STEP_NUM_NODES",
    )
    if all(v in env for v in slurm):  # inside srun
        return "slurm", _env_int("SLURM_NTASKS")
    if "TPU_WORKER_HOSTNAMES" in env or "TPU_PROCESS_ADDRESSES" in env:  # TPU VM / GKE TPU
        hosts = (env.get("TPU_PROCESS_ADDRESSES") or env["TPU_WORKER_HOSTNAMES"]).split(",")
        return "tpu", len(hosts)
    # A Cloud TPU VM (one host or a pod slice): JAX asks the VM's metadata server for the
    # workers. That query is only made where TPU chips sit on the PCI bus, and not where
    # TPU_SKIP_MDS_QUERY says there is no metadata server, as JAX itself decides.
    if "TPU_SKIP_MDS_QUERY" not in env and _tpu_platform_allowed() and _cloud_tpu_chips() > 0:
        return "tpu-vm", None
    if "KUBERNETES_SERVICE_HOST" in env and "JOB_COMPLETION_INDEX" in env:  # indexed Job
        return "kubernetes", None
    return None


def detect(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_count: int | None = None,
) -> ProcessGroup:
    """Work out the process group from arguments, ``JAXDIST_*`` variables or the cluster.

    Starts no JAX backend (it may read JAX's TPU chip check); :func:`initialize` acts on the
    result.
    """
    if local_device_count is None:
        local_device_count = _env_int(ENV_LOCAL_DEVICES)
    if local_device_count is not None and local_device_count < 1:
        raise DistributedInitError(f"local device count must be >= 1, got {local_device_count}")

    explicit = (coordinator_address, num_processes, process_id)
    if any(v is not None for v in explicit):
        source = "arguments"
    elif any(os.environ.get(name) for name in JAXDIST_ENV):
        source = "jaxdist-env"
        coordinator_address = os.environ.get(ENV_COORDINATOR) or None
        num_processes = _env_int(ENV_NUM_PROCESSES)
        process_id = _env_int(ENV_PROCESS_ID)
    else:
        cluster = _detect_cluster()
        if cluster is not None and cluster[0] == "tpu-vm" and local_device_count is not None:
            cluster = None  # forced CPU devices: a dry run, not one of the TPU workers
        if cluster is None:
            return ProcessGroup("none", local_device_count=local_device_count)
        name, count = cluster
        return ProcessGroup(name, num_processes=count, local_device_count=local_device_count)

    names = JAXDIST_ENV if source == "jaxdist-env" else _ARGUMENT_NAMES
    missing = [
        n
        for n, v in zip(names, (coordinator_address, num_processes, process_id), strict=True)
        if v is None
    ]
    if missing:
        raise DistributedInitError(
            f"incomplete process group from {source}: coordinator_address={coordinator_address!r}, "
            f"num_processes={num_processes!r}, process_id={process_id!r}; all three are needed "
            f"(missing: {', '.join(missing)})"
        )
    assert num_processes is not None and process_id is not None and coordinator_address
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise DistributedInitError(
            f"process_id must be in [0, num_processes): got process_id={process_id}, "
            f"num_processes={num_processes}"
        )
    if ":" not in coordinator_address:
        raise DistributedInitError(
            f"coordinator address must be host:port, got {coordinator_address!r}"
        )
    launcher = (os.environ.get(ENV_LAUNCHER) or None) if source == "jaxdist-env" else None
    return ProcessGroup(
        source, coordinator_address, num_processes, process_id, local_device_count, launcher
    )


# How :func:`describe` names each source.
SOURCE_NAMES = {
    "arguments": "--coordinator/--num-processes/--process-id",
    "jaxdist-env": "JAXDIST_* variables",
    "slurm": "SLURM",
    "ompi": "Open MPI",
    "tpu": "Cloud TPU (GKE)",
    "tpu-vm": "Cloud TPU VM",
    "kubernetes": "Kubernetes",
}


def describe(group: ProcessGroup) -> str:
    """How this process found its peers, in one line: ``SLURM: 4 processes, coordinator
    node1:63201``, ``jaxdist launch: 2 processes, coordinator 127.0.0.1:41234``, ``single
    process``."""
    if not group.is_multiprocess:
        return "single process"
    name = group.launcher or SOURCE_NAMES.get(group.source, group.source)
    count = "?" if group.num_processes is None else str(group.num_processes)
    return f"{name}: {count} processes, coordinator {group.coordinator_address or '(auto)'}"


def _set_cpu_device_count(count: int) -> None:
    """Force ``count`` CPU devices; JAX reads this once, when the CPU backend starts."""
    import jax

    try:  # JAX refuses a new count once a backend runs
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError as err:
        raise DistributedInitError(BACKEND_STARTED) from err
    # ``jax_num_cpu_devices`` wins over XLA_FLAGS' host-device count; keep both in step so a
    # later reader of XLA_FLAGS (or a child process) sees the same number.
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={count}"])
    jax.config.update("jax_platforms", "cpu")


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_count: int | None = None,
    timeout_s: int | None = None,
    heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S,
    cpu_collectives: str = "gloo",
) -> ProcessGroup:
    """Join the multi-process run this process belongs to; a no-op for a single process.

    Must run before anything starts a JAX backend (``jax.devices()``, a computation, ...).

    Args:
      coordinator_address: ``host:port`` of process 0 (it binds the port on all interfaces).
      num_processes: processes in the run.
      process_id: this process, in ``[0, num_processes)``.
      local_device_count: force this many CPU devices in this process (and the CPU platform);
        default ``$JAXDIST_LOCAL_DEVICES``, else the platform's own devices.
      timeout_s: how long to wait for all processes to join, and for the CPU backend's
        topology exchange; default ``$JAXDIST_TIMEOUT`` or 300.
      heartbeat_timeout_s: a peer silent this long counts as dead, failing the survivors.
      cpu_collectives: cross-process collectives on CPU (``"gloo"`` or ``"mpi"``).

    Returns:
      The :class:`ProcessGroup` joined (``source == "none"`` when single-process), with the
      coordinator, process count and rank that JAX found itself on a cluster.

    Raises:
      DistributedInitError: incomplete configuration, a backend already started, or peers
        that did not show up within the timeout.
    """
    import jax

    group = detect(coordinator_address, num_processes, process_id, local_device_count)
    if timeout_s is None:
        timeout_s = _env_int(ENV_TIMEOUT) or DEFAULT_TIMEOUT_S
    if jax.distributed.is_initialized():
        return group
    if not group.is_multiprocess and group.local_device_count is None:
        return group  # single process, nothing to configure: fine even after JAX started
    if group.local_device_count is not None:
        _set_cpu_device_count(group.local_device_count)
    if not group.is_multiprocess:
        return group

    _configure_cpu_collectives(cpu_collectives, timeout_s)
    return _join(group, timeout_s, heartbeat_timeout_s)


def _join(group: ProcessGroup, timeout_s: int, heartbeat_timeout_s: int) -> ProcessGroup:
    """``jax.distributed.initialize`` for ``group``, watched: a join that stalls is reported
    while it waits, one that fails is one :class:`DistributedInitError`."""
    import jax

    who = (
        f"process {group.process_id if group.process_id is not None else '?'} of "
        f"{group.num_processes if group.num_processes is not None else '?'} "
        f"(from {group.source})"
    )
    watchdog = _join_watchdog(who, group, timeout_s)
    try:
        jax.distributed.initialize(
            coordinator_address=group.coordinator_address,
            num_processes=group.num_processes,
            process_id=group.process_id,
            initialization_timeout=int(timeout_s),
            heartbeat_timeout_seconds=int(heartbeat_timeout_s),
            shutdown_timeout_seconds=int(timeout_s),
        )
    except Exception as err:  # XlaRuntimeError, ValueError, ... all mean "could not join"
        if "must be called before" in str(err):  # JAX refuses to join once a backend runs
            raise DistributedInitError(BACKEND_STARTED) from err
        if group.source == "tpu-vm" and "coordinator_address" in str(err):
            # TPU chips, but JAX found no pod slice around them (no metadata server answered):
            # run as one process, as JAX itself would without initialize().
            print(
                f"jaxdist: TPU chips found but no TPU pod slice ({str(err).strip()}); running "
                f"as one process",
                file=sys.stderr,
            )
            return ProcessGroup("none", local_device_count=group.local_device_count)
        raise _join_error(who, group, timeout_s, err) from err
    finally:
        watchdog.cancel()
    return _as_joined(group)


def _as_joined(group: ProcessGroup) -> ProcessGroup:
    """``group`` with what JAX found itself on a cluster (the coordinator, the process count
    and rank), read from JAX's distributed state: asking ``jax.process_index()`` would start
    the backend, which the caller may still configure. ``group`` unchanged where that state
    is not there (another JAX version)."""
    from jax._src import distributed as jax_distributed  # no public view of this state

    try:
        state = jax_distributed.global_state
        return dataclasses.replace(
            group,
            coordinator_address=state.coordinator_address,
            num_processes=state.num_processes,
            process_id=state.process_id,
        )
    except AttributeError:
        return group


def _configure_cpu_collectives(implementation: str, timeout_s: int) -> None:
    """Cross-process collectives on CPU, and the CPU client's topology exchange through the
    coordinator bounded by the join timeout (by default it waits minutes for a missing peer)."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", implementation)
    minutes = max(1, math.ceil(timeout_s / 60))
    jax.config.update("jax_cpu_get_local_topology_timeout_minutes", minutes)
    jax.config.update("jax_cpu_get_global_topology_timeout_minutes", minutes)


def _join_watchdog(who: str, group: ProcessGroup, timeout_s: int) -> threading.Timer:
    """A started timer that, just before the join times out, says who waited on what and ends
    the process with exit status 1: when peers never show up, JAX's runtime would abort the
    process from C++ (a fatal DEADLINE_EXCEEDED with a native stack) rather than raise."""

    def give_up() -> None:
        print(
            f"jaxdist: {who} has waited {timeout_s} s for all processes to join at coordinator "
            f"{group.coordinator_address or '(auto)'} and gives up. Check that every process "
            f"started, got the same coordinator address and process count, and can reach the "
            f"port.",
            file=sys.stderr,
            flush=True,
        )
        os._exit(DistributedInitError.exit_code)

    watchdog = threading.Timer(max(timeout_s - 1.0, 0.9 * timeout_s), give_up)
    watchdog.daemon = True
    watchdog.start()
    return watchdog


def _join_error(
    who: str, group: ProcessGroup, timeout_s: int, err: Exception
) -> DistributedInitError:
    """One sentence for a failed join: who, what happened, where, and what to check."""
    text = str(err)
    timed_out = "DEADLINE_EXCEEDED" in text or "timed out" in text.lower()
    what = (
        f"timed out after {timeout_s} s waiting for all processes to join"
        if timed_out
        else "failed to join"
    )
    return DistributedInitError(
        f"{who} {what} at coordinator {group.coordinator_address or '(auto)'}: "
        f"{text.strip().splitlines()[0].rstrip('.') if text.strip() else type(err).__name__}. "
        f"Check that process 0 is running, that every process got the same coordinator "
        f"address and process count, and that the port is reachable."
    )


def shutdown() -> None:
    """Leave the process group (no-op when single-process); waits for the peers to leave."""
    import jax

    if jax.distributed.is_initialized():
        jax.distributed.shutdown()

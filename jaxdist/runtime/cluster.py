"""An emulated cluster on one Linux machine: hosts as network namespaces, links capped by tc.

Layout of ``EmulatedCluster(hosts=H, ...)`` (every name starts with :data:`PREFIX` and a
per-run id, so leftovers of a crashed run can be found and removed by :func:`cleanup`)::

    namespace <run>-br:  bridge br0 ── v0 ── v1 ── ... ── v{H-1}
                                       │     │
    namespace <run>-h0:  eth0 10.213.0.1/24  │       (hostname <run>-h0)
    namespace <run>-h1:        eth0 10.213.0.2/24    (hostname <run>-h1)

* The bridge lives in a namespace of its own, so the machine's own network is never touched:
  no link, address or route is added outside the namespaces made here, and the hosts have no
  route anywhere but to each other.
* Each host link is capped in both directions with ``tbf`` at ``bandwidth`` (host ``eth0``
  egress = upload, bridge-side ``v<i>`` egress = download); ``latency`` adds a ``netem`` delay
  on the host's egress, i.e. once per host-to-host message.
* Gloo advertises the address its hostname resolves to, so each host gets its own hostname
  (``unshare -u``) and ``/etc/netns/<name>/hosts`` (``ip netns exec`` mounts it over
  ``/etc/hosts``) listing every host's bridge address.
* Processes run as ``ip netns exec NAME unshare -u sh -c 'hostname NAME; exec CMD'`` under
  :func:`jaxdist.runtime.launch.supervise` -- the same supervision as ``jaxdist launch``.

Teardown runs on normal exit, on exceptions, on Ctrl-C, SIGTERM and SIGHUP; after a SIGKILL of
the supervisor itself, ``jaxdist cluster --cleanup`` removes what is left.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from jaxdist.comm.emulated_link import LATENCY_VARIABLE, RATE_VARIABLE, parse_latency, rate_bits
from jaxdist.runtime import distributed, launch

__all__ = [
    "ClusterError",
    "EmulatedCluster",
    "PrivilegeError",
    "cleanup",
    "run_cluster",
]

PREFIX = "jdxc"
SUBNET = "10.213.0"  # a /24 that exists only on the bridge inside the namespaces made here
COORDINATOR_PORT = 8476  # free by construction: each host namespace starts empty
NETNS_ETC = Path("/etc/netns")
MAX_HOSTS = 250


class ClusterError(RuntimeError):
    """The emulated cluster could not be built or torn down."""


class PrivilegeError(ClusterError):
    """Not allowed to create network namespaces here."""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise ClusterError(
            f"`{' '.join(argv)}` failed (exit {proc.returncode}): {proc.stderr.strip()}"
        )
    return proc


def check_tools() -> None:
    """Raise :class:`PrivilegeError` / :class:`ClusterError` if this machine cannot do it."""
    if sys.platform != "linux":
        raise ClusterError(
            f"jaxdist cluster needs Linux network namespaces; this is {sys.platform}"
        )
    if os.geteuid() != 0:
        raise PrivilegeError(
            f"jaxdist cluster needs root (it creates network namespaces, veth links and tc "
            f"qdiscs); running as uid {os.geteuid()}. Run it with sudo, or use `jaxdist launch` "
            f"for an unprivileged multi-process run without link emulation."
        )
    missing = [tool for tool in ("ip", "tc", "unshare", "sh") if shutil.which(tool) is None]
    if missing:
        raise ClusterError(
            f"jaxdist cluster needs {', '.join(missing)} on PATH "
            f"(Debian/Ubuntu: apt-get install iproute2 util-linux)"
        )


class EmulatedCluster:
    """``hosts`` network namespaces on a bridge, links capped; a context manager.

    ``with EmulatedCluster(4, bandwidth="1gbit") as c: launch.supervise(c.workers(cmd))``.
    """

    def __init__(
        self,
        hosts: int,
        *,
        devices_per_host: int | None = None,
        bandwidth: str | None = "1gbit",
        latency: str = "0",
        run_id: str | None = None,
    ):
        if not 1 <= hosts <= MAX_HOSTS:
            raise ValueError(f"--hosts must be in [1, {MAX_HOSTS}], got {hosts}")
        if devices_per_host is not None and devices_per_host < 1:
            raise ValueError(f"--devices-per-host must be >= 1, got {devices_per_host}")
        self.hosts = hosts
        self.devices_per_host = devices_per_host
        self.bandwidth = bandwidth
        self.rate_bits = rate_bits(bandwidth) if bandwidth else None
        self.latency = latency
        self.latency_s = parse_latency(latency)
        self.run_id = run_id or secrets.token_hex(2)
        self.bridge_ns = f"{PREFIX}{self.run_id}-br"
        self.host_names = [f"{PREFIX}{self.run_id}-h{i}" for i in range(hosts)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(hosts)]
        self._made_namespaces: list[str] = []
        self._made_files: list[Path] = []

    # ----------------------------------------------------------------- building

    def _add_namespace(self, name: str) -> None:
        proc = _run("ip", "netns", "add", name, check=False)
        if proc.returncode != 0:
            raise PrivilegeError(
                f"`ip netns add {name}` was refused (exit {proc.returncode}): "
                f"{proc.stderr.strip()}. Creating network namespaces needs CAP_SYS_ADMIN and "
                f"CAP_NET_ADMIN (in a container: --privileged or --cap-add SYS_ADMIN,NET_ADMIN)."
            )
        self._made_namespaces.append(name)

    def _cap_link(self, namespace: str, device: str, with_delay: bool) -> None:
        """tbf at the link rate on ``device``'s egress, with a netem delay under it."""
        tc = ("tc", "-n", namespace, "qdisc", "add", "dev", device)
        parent = ("root",)
        if self.rate_bits is not None:
            # A burst of ~2 ms of traffic (>= 16 KiB) lets tbf reach its rate at 1 Gbit/s.
            burst = max(self.rate_bits // 8 // 500, 16384)
            _run(
                *tc,
                "root",
                "handle",
                "1:",
                "tbf",
                "rate",
                str(self.rate_bits),
                "burst",
                str(burst),
                "latency",
                "50ms",
            )
            parent = ("parent", "1:1")
        if with_delay and self.latency_s > 0:
            proc = _run(
                *tc,
                *parent,
                "handle",
                "10:",
                "netem",
                "delay",
                f"{self.latency_s * 1e6:.0f}us",
                check=False,
            )
            if proc.returncode != 0:
                raise ClusterError(
                    f"cannot add a {self.latency} delay: tc netem failed ({proc.stderr.strip()}); "
                    f"this kernel probably lacks the sch_netem module. Pass --latency 0 to "
                    f"emulate bandwidth only."
                )

    def _hosts_file(self) -> str:
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost"]
        lines += [
            f"{addr} {name}" for addr, name in zip(self.addresses, self.host_names, strict=True)
        ]
        return "\n".join(lines) + "\n"

    def create(self) -> None:
        """Build the namespaces, bridge, links, caps and hosts files."""
        check_tools()
        self._add_namespace(self.bridge_ns)
        ipb = ("ip", "-n", self.bridge_ns)
        _run(*ipb, "link", "add", "br0", "type", "bridge")
        _run(*ipb, "link", "set", "br0", "up")
        hosts_text = self._hosts_file()
        if not NETNS_ETC.exists():
            NETNS_ETC.mkdir(parents=True)
            self._made_files.append(NETNS_ETC)  # removed last, and only if empty by then
        for i, (name, addr) in enumerate(zip(self.host_names, self.addresses, strict=True)):
            self._add_namespace(name)
            # The veth pair is born in the bridge namespace and its peer moved straight into
            # the host namespace: it never exists in the machine's own namespace.
            _run(
                *ipb, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", name
            )
            _run(*ipb, "link", "set", f"v{i}", "master", "br0")
            _run(*ipb, "link", "set", f"v{i}", "up")
            iph = ("ip", "-n", name)
            _run(*iph, "link", "set", "lo", "up")
            _run(*iph, "addr", "add", f"{addr}/24", "dev", "eth0")
            _run(*iph, "link", "set", "eth0", "up")
            self._cap_link(name, "eth0", with_delay=True)
            self._cap_link(self.bridge_ns, f"v{i}", with_delay=False)
            folder = NETNS_ETC / name
            folder.mkdir(parents=True, exist_ok=True)
            self._made_files.append(folder)
            (folder / "hosts").write_text(hosts_text)

    def destroy(self) -> list[str]:
        """Remove everything :meth:`create` made; returns the problems met (empty: clean)."""
        # A second Ctrl-C / SIGTERM must not cut the teardown short; it is delivered after.
        masked = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, masked)
        try:
            return self._destroy()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)

    def _destroy(self) -> list[str]:
        problems = []
        for name in reversed(self._made_namespaces):
            _kill_namespace_processes(name)
            proc = _run("ip", "netns", "del", name, check=False)
            if proc.returncode != 0:
                problems.append(f"ip netns del {name}: {proc.stderr.strip()}")
        self._made_namespaces.clear()
        for folder in reversed(self._made_files):
            if folder == NETNS_ETC:  # another tool may have put files there meanwhile
                with contextlib.suppress(OSError):
                    folder.rmdir()
                continue
            shutil.rmtree(folder, ignore_errors=True)
            if folder.exists():
                problems.append(f"could not remove {folder}")
        self._made_files.clear()
        return problems

    def __enter__(self) -> EmulatedCluster:
        try:
            self.create()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc) -> None:
        problems = self.destroy()
        if problems:
            print("jaxdist cluster: teardown problems: " + "; ".join(problems), file=sys.stderr)

    # ----------------------------------------------------------------- running

    def workers(self, command: Sequence[str]) -> list[launch.Worker]:
        """One worker per host running ``command``, host 0 coordinating."""
        coordinator = f"{self.addresses[0]}:{COORDINATOR_PORT}"
        # Proxy settings would only send traffic out of the emulated network: drop them.
        base = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        workers = []
        for i, name in enumerate(self.host_names):
            extra = {
                distributed.ENV_LAUNCHER: "jaxdist cluster",
                "JAXDIST_HOST": name,
                "JAXDIST_LINK_BANDWIDTH": self.bandwidth or "",
                RATE_VARIABLE: str(self.rate_bits or ""),
                LATENCY_VARIABLE: self.latency,
            }
            env = launch.worker_env(coordinator, self.hosts, i, self.devices_per_host, base, extra)
            argv = [
                "ip",
                "netns",
                "exec",
                name,
                "unshare",
                "-u",
                "sh",
                "-c",
                'hostname "$0" && exec "$@"',
                name,
                *command,
            ]
            workers.append(launch.Worker(argv, env))
        return workers


def _kill_namespace_processes(name: str) -> None:
    """SIGKILL whatever still runs inside namespace ``name`` (ours: started in it by a run)."""
    proc = _run("ip", "netns", "pids", name, check=False)
    for pid in proc.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def leftovers(prefix: str = PREFIX) -> tuple[list[str], list[Path]]:
    """Namespaces and /etc/netns folders whose names start with ``prefix``."""
    proc = _run("ip", "netns", "list", check=False) if shutil.which("ip") else None
    names = [line.split()[0] for line in (proc.stdout.splitlines() if proc else []) if line.strip()]
    folders = sorted(NETNS_ETC.glob(f"{prefix}*")) if NETNS_ETC.is_dir() else []
    return [n for n in names if n.startswith(prefix)], folders


def cleanup(prefix: str = PREFIX) -> list[str]:
    """Remove every namespace and /etc/netns folder left by earlier runs; returns what went."""
    if not prefix:
        raise ValueError("cleanup needs a non-empty name prefix")
    names, folders = leftovers(prefix)
    removed = []
    for name in names:
        _kill_namespace_processes(name)
        if _run("ip", "netns", "del", name, check=False).returncode == 0:
            removed.append(f"netns {name}")
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(str(folder))
    return removed


def run_cluster(
    command: Sequence[str],
    hosts: int,
    *,
    devices_per_host: int | None = None,
    bandwidth: str | None = "1gbit",
    latency: str = "0",
    timeout_s: float | None = None,
    grace_s: float = launch.DEFAULT_GRACE_S,
) -> int:
    """Build the cluster, run ``command`` on every host, tear it all down; the exit code."""
    if not command:
        raise ValueError("no command given to run on the cluster")
    cluster = EmulatedCluster(
        hosts, devices_per_host=devices_per_host, bandwidth=bandwidth, latency=latency
    )

    # While building (and between build and run) SIGTERM/SIGHUP must unwind through the
    # teardown like Ctrl-C does; supervise() installs its own handlers while it runs.
    try:
        with launch.signals_raise_stop((signal.SIGTERM, signal.SIGHUP)), cluster:
            print(
                f"jaxdist cluster: {hosts} hosts {', '.join(cluster.host_names)} on "
                f"{SUBNET}.0/24, links {bandwidth or 'uncapped'}, +{latency} delay",
                file=sys.stderr,
                flush=True,
            )
            return launch.supervise(cluster.workers(command), timeout_s=timeout_s, grace_s=grace_s)
    except launch.Stop as stop:
        return 128 + stop.signum
    except KeyboardInterrupt:
        return 128 + signal.SIGINT

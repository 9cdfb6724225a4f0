"""Several hosts on one Linux machine: network namespaces joined by veth pairs.

``LocalCluster(n)`` makes n data hosts and one trainer host. Data host i gets
its own namespace and a veth link to the trainer side, with a /30 subnet of
10.213.0.0/16 (trainer side .1, data host .2); each link can be shaped with
``tc qdisc tbf`` (e.g. ``rate="1gbit"``). With ``trainer_namespace=False`` the
trainer side is this process's own namespace, so a test can connect directly.
Needs root and iproute2. Everything is torn down by ``close()`` (or leaving the
``with`` block), also after a failure: processes in the namespaces are killed,
then the namespaces (and with them the veth links) are deleted.
Addresses used are only those inside namespaces this class creates.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Optional, Sequence

SUBNET = ipaddress.ip_network("10.213.0.0/16")


class ClusterError(RuntimeError):
    """The harness cannot be built here (not root, no iproute2, address range in use)."""


@dataclass(frozen=True)
class Host:
    """One simulated host: its namespace (None: this namespace), its address, its link's interface names."""

    name: str
    namespace: Optional[str]
    address: str
    link_local: str  # interface on the trainer side of this host's link
    link_remote: str  # interface inside the data host

    def command(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *argv] if self.namespace else list(argv)


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise ClusterError(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")


def check_available() -> None:
    """Raise ClusterError saying what is missing for the harness."""
    if os.geteuid() != 0:
        raise ClusterError("the local cluster needs root (network namespaces and veth links)")
    if shutil.which("ip") is None or shutil.which("tc") is None:
        raise ClusterError("the local cluster needs iproute2 (`ip`, `tc`): apt-get install iproute2")
    routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True, timeout=30).stdout
    for line in routes.splitlines():
        prefix = line.split()[0]
        if prefix != "default" and ipaddress.ip_network(prefix, strict=False).overlaps(SUBNET):
            raise ClusterError(f"{SUBNET} is already routed here ({line.strip()}); the harness will not touch it")


class LocalCluster:
    """``producers`` data hosts and a trainer host; see the module docstring."""

    def __init__(self, producers: int, rate: Optional[str] = None, trainer_namespace: bool = True) -> None:
        if not 1 <= producers <= 64:
            raise ValueError("producers must be between 1 and 64")
        check_available()
        self.tag = secrets.token_hex(2)
        self.namespaces: list[str] = []
        self.trainer = Host("trainer", f"stk{self.tag}-t" if trainer_namespace else None, "", "", "")
        self.hosts: list[Host] = []
        try:
            if self.trainer.namespace:
                self._add_namespace(self.trainer.namespace)
            for i in range(producers):
                self.hosts.append(self._add_host(i, rate))
        except BaseException:
            self.close()
            raise

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self.namespaces.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _add_host(self, i: int, rate: Optional[str]) -> Host:
        net = list(SUBNET.subnets(new_prefix=30))[i]
        local_addr, remote_addr = net[1], net[2]
        ns = f"stk{self.tag}-d{i}"
        local_if, remote_if = f"stk{self.tag}t{i}", f"stk{self.tag}d{i}"
        self._add_namespace(ns)
        _ip("link", "add", local_if, "type", "veth", "peer", "name", remote_if)
        _ip("link", "set", remote_if, "netns", ns)
        local = ["-n", self.trainer.namespace] if self.trainer.namespace else []
        if self.trainer.namespace:
            _ip("link", "set", local_if, "netns", self.trainer.namespace)
        _ip(*local, "addr", "add", f"{local_addr}/30", "dev", local_if)
        _ip(*local, "link", "set", local_if, "up")
        _ip("-n", ns, "addr", "add", f"{remote_addr}/30", "dev", remote_if)
        _ip("-n", ns, "link", "set", remote_if, "up")
        if rate:
            for where, iface in ((local, local_if), (["-n", ns], remote_if)):
                cmd = ["tc", *where, "qdisc", "add", "dev", iface, "root", "tbf", "rate", rate, "burst", "1mb",
                       "latency", "50ms"]
                result = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
                if result.returncode != 0:
                    raise ClusterError(f"`{' '.join(cmd)}` failed: {result.stderr.strip()}")
        return Host(f"data{i}", ns, str(remote_addr), local_if, remote_if)

    def set_link(self, i: int, up: bool) -> None:
        """Cut (``up=False``) or restore data host i's link, on the trainer side."""
        local = ["-n", self.trainer.namespace] if self.trainer.namespace else []
        _ip(*local, "link", "set", self.hosts[i].link_local, "up" if up else "down")

    def close(self) -> None:
        """Kill every process left in our namespaces, then delete them. Idempotent, never raises."""
        for ns in self.namespaces:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30).stdout
            for pid in (int(p) for p in pids.split()):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        time.sleep(0.1)
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        if not self.trainer.namespace:
            for host in self.hosts:  # deleting the namespace removed the pair; this is belt and braces
                subprocess.run(["ip", "link", "del", host.link_local], capture_output=True, timeout=30)
        self.namespaces = []

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""Several hosts on one Linux machine: network namespaces joined by a switch.

``LocalCluster(n, trainers=m)`` makes n data hosts and m trainer hosts, each a
network namespace with its own address on 10.213.0.0/24 (trainers .1, .2, ...;
data hosts .101, .102, ...), joined by veth links to a Linux bridge in a
namespace of its own, the switch: every host reaches every other. A data host's
link can be shaped with ``tc qdisc tbf`` (e.g. ``rate="1gbit"``, both directions)
and cut (``set_link``). With ``trainer_namespace=False`` the (single) trainer host
is this process's own namespace, so a test can connect directly. Needs root and
iproute2. Everything is torn down by ``close()`` (or leaving the ``with`` block),
also after a failure: processes in the namespaces are killed, then the
namespaces (and with them the veth links) are deleted. Addresses used are only
those inside namespaces this class creates.
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

SUBNET = ipaddress.ip_network("10.213.0.0/24")
TRAINER_BASE, DATA_BASE, OPERATOR = 1, 101, 254


class ClusterError(RuntimeError):
    """The harness cannot be built here (not root, no iproute2, address range in use)."""


@dataclass(frozen=True)
class Host:
    """One simulated host: its namespace (None: this namespace), its address, its link's interface names."""

    name: str
    namespace: Optional[str]
    address: str
    link_local: str  # interface on the switch side of this host's link
    link_remote: str  # interface inside the host

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
    """``producers`` data hosts and ``trainers`` trainer hosts on one switch; see the module docstring."""

    def __init__(self, producers: int, rate: Optional[str] = None, trainer_namespace: bool = True,
                 trainers: int = 1, operator: bool = False) -> None:
        if not 1 <= producers <= 64 or not 1 <= trainers <= 16:
            raise ValueError("producers must be between 1 and 64, trainers between 1 and 16")
        if trainers > 1 and not trainer_namespace:
            raise ValueError("several trainer hosts each need a namespace of their own")
        if operator and not trainer_namespace:
            raise ValueError("operator=True links this namespace to the switch, which trainer_namespace=False does")
        check_available()
        self.tag = secrets.token_hex(2)
        self.namespaces: list[str] = []
        self.switch = f"stk{self.tag}-sw"
        self.trainers: list[Host] = []
        self.hosts: list[Host] = []
        self._root_link: Optional[str] = None
        self.operator: Optional[Host] = None
        try:
            self._add_namespace(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for j in range(trainers):
                ns = f"stk{self.tag}-t{j}" if trainer_namespace else None
                self.trainers.append(self._add_host(f"trainer{j}" if trainers > 1 else "trainer", ns,
                                                    TRAINER_BASE + j, f"t{j}", None))
            for i in range(producers):
                self.hosts.append(self._add_host(f"data{i}", f"stk{self.tag}-d{i}", DATA_BASE + i, f"d{i}", rate))
            # operator: this namespace on the switch too (a controller here reads the trainers' metrics)
            self.operator = self._add_host("operator", None, OPERATOR, "op", None) if operator else None
        except BaseException:
            self.close()
            raise

    @property
    def trainer(self) -> Host:
        """The first trainer host."""
        return self.trainers[0]

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self.namespaces.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _add_host(self, name: str, ns: Optional[str], offset: int, short: str, rate: Optional[str]) -> Host:
        address = SUBNET[offset]
        switch_if, host_if = f"stk{self.tag}s{short}", f"stk{self.tag}h{short}"
        if ns is not None:
            self._add_namespace(ns)
        _ip("link", "add", switch_if, "type", "veth", "peer", "name", host_if)
        _ip("link", "set", switch_if, "netns", self.switch)
        _ip("-n", self.switch, "link", "set", switch_if, "master", "br0")
        _ip("-n", self.switch, "link", "set", switch_if, "up")
        inside = ["-n", ns] if ns else []
        if ns is not None:
            _ip("link", "set", host_if, "netns", ns)
        else:
            self._root_link = host_if
        _ip(*inside, "addr", "add", f"{address}/{SUBNET.prefixlen}", "dev", host_if)
        _ip(*inside, "link", "set", host_if, "up")
        if rate:
            for where, iface in ((["-n", self.switch], switch_if), (inside, host_if)):
                cmd = ["tc", *where, "qdisc", "add", "dev", iface, "root", "tbf", "rate", rate, "burst", "1mb",
                       "latency", "50ms"]
                result = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
                if result.returncode != 0:
                    raise ClusterError(f"`{' '.join(cmd)}` failed: {result.stderr.strip()}")
        return Host(name, ns, str(address), switch_if, host_if)

    def set_link(self, i: int, up: bool) -> None:
        """Cut (``up=False``) or restore data host i's link, at the switch."""
        _ip("-n", self.switch, "link", "set", self.hosts[i].link_local, "up" if up else "down")

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
        if self._root_link:  # its peer went with the switch; this is belt and braces
            subprocess.run(["ip", "link", "del", self._root_link], capture_output=True, timeout=30)
        self.namespaces = []

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

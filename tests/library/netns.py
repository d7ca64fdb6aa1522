"""Two hosts on one machine: network namespaces joined by a veth pair whose both ends send at a limited rate (a
token-bucket qdisc), for runs whose all-reduce must wait for the network and not for a CPU. Needs root and
iproute2 (`ip`, `tc`), as the template's CI has; each host reaches the other at its address."""

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Host:
    netns: str  # `ip netns exec <netns> ...` runs a command there
    interface: str  # its end of the link (GLOO_SOCKET_IFNAME)
    address: str


def ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, f"ip {' '.join(args)}: {done.stderr.strip()} (needs root and iproute2)"


@contextmanager
def two_hosts(rate: str = "200mbit") -> Iterator[tuple[Host, Host]]:
    """Two hosts whose link sends `rate` each way (tc's units); removed afterwards, whatever happened."""
    tag = f"dk{os.getpid() % 100000}"  # interface names have at most 15 characters
    hosts = (Host(f"{tag}a", f"{tag}a0", "10.213.0.1"), Host(f"{tag}b", f"{tag}b0", "10.213.0.2"))
    try:
        for host in hosts:
            ip("netns", "add", host.netns)
        ip("link", "add", hosts[0].interface, "type", "veth", "peer", "name", hosts[1].interface)
        for host in hosts:
            ip("link", "set", host.interface, "netns", host.netns)
            ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", host.interface)
            ip("-n", host.netns, "link", "set", host.interface, "up")
            ip("-n", host.netns, "link", "set", "lo", "up")
            tbf = ["tc", "qdisc", "add", "dev", host.interface, "root", "tbf", "rate", rate]
            ip("netns", "exec", host.netns, *tbf, "burst", "64kb", "latency", "100ms")
        yield hosts
    finally:
        for host in hosts:  # deleting a namespace deletes its end of the link, and so the pair
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True, timeout=30, check=False)

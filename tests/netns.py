"""A small lab of network namespaces: "hosts" with their own 10.x address, each linked by a veth
pair to a bridge inside a switch namespace. Nothing is created in, or addressed from, the
namespace the tests run in: every link and address lives in namespaces the lab made.

``NetnsLab.open`` skips the test (with the kernel's reason) where namespaces cannot be made.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess

import pytest


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class NetnsLab:
    def __init__(self, tag: str, hosts: list[str]) -> None:
        self.tag = tag
        self.switch = f"dyn{tag}sw"
        subnet = f"10.{random.randint(64, 250)}.{random.randint(0, 250)}"
        self.namespaces = {host: f"dyn{tag}{host}" for host in hosts}
        self.addresses = {host: f"{subnet}.{i + 1}" for i, host in enumerate(hosts)}
        self._removed: set[str] = set()

    @classmethod
    def open(cls, hosts: list[str]) -> NetnsLab:
        lab = cls(f"{os.getpid() % 100000:05d}", hosts)
        try:
            _ip("netns", "add", lab.switch)
        except (OSError, subprocess.CalledProcessError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            pytest.skip(f"cannot create network namespaces here: {detail.strip()}")
        try:
            lab._build()
        except BaseException:
            lab.close()
            raise
        return lab

    def _build(self) -> None:
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, (host, ns) in enumerate(self.namespaces.items()):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            # Both ends are created directly inside their namespaces.
            _ip(
                "link",
                "add",
                "eth0",
                "netns",
                ns,
                "type",
                "veth",
                "peer",
                f"p{i}",
                "netns",
                self.switch,
            )
            _ip("-n", ns, "addr", "add", f"{self.addresses[host]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"p{i}", "up")

    def prefix(self, host: str) -> tuple[str, ...]:
        """Command prefix that runs a program on ``host``."""
        return ("ip", "netns", "exec", self.namespaces[host])

    def remove(self, host: str) -> None:
        """The host is gone: SIGKILL every process in it, then delete its namespace (and so
        its link to the bridge)."""
        if host in self._removed:
            return
        self._removed.add(host)
        ns = self.namespaces[host]
        pids = subprocess.run(
            ["ip", "netns", "pids", ns], capture_output=True, text=True, check=False
        ).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)

    def close(self) -> None:
        for host in self.namespaces:
            self.remove(host)
        subprocess.run(["ip", "netns", "del", self.switch], capture_output=True, check=False)

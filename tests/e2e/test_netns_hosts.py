"""Many hosts, for real: network namespaces joined by a bridge, each host with its own address.
etcd + NATS on one host, the frontend (KV router) on a second, one mocker worker on each of a
third and a fourth. Requests are KV-routed across hosts; then a worker's host is removed (its
processes SIGKILLed, its namespace deleted) while requests run, and routing moves to the other
worker with no failed request (migration on). Skipped, with the kernel's reason, where
namespaces cannot be created."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.frontend.frontend_stack import DEMO_MODEL, child_env
from tests.e2e.processes import REPO, Child
from tests.netns import NetnsLab
from tests.servers import EtcdServer, NatsServer

LEASE_TTL = 2
CLIENT = str(REPO / "tests" / "e2e" / "helpers" / "netns_client.py")
HOSTS = ["infra", "front", "w1", "w2"]


@pytest.fixture
def lab() -> Iterator[NetnsLab]:
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("network namespaces need Linux and root (CAP_SYS_ADMIN)")
    lab = NetnsLab.open(HOSTS)
    yield lab
    lab.close()


def _results(child: Child) -> list[dict[str, object]]:
    """An exited client's result lines (all of them: its reader may lag behind the exit)."""
    return [json.loads(line) for line in child.output() if line.startswith("{")]


def test_kv_routing_across_hosts_survives_removing_a_worker_host(
    lab: NetnsLab, tmp_path: Path
) -> None:
    infra = lab.addresses["infra"]
    etcd = EtcdServer(host=infra, prefix=lab.prefix("infra"))
    nats = NatsServer(host=infra, prefix=lab.prefix("infra"))
    children: list[Child] = []
    try:
        etcd.start()
        nats.start()
        planes = {
            "DYN_DISCOVERY_BACKEND": "etcd",
            "ETCD_ENDPOINTS": etcd.endpoint,
            "DYN_EVENT_PLANE": "nats",
            "NATS_SERVER": nats.url,
            "DYN_LEASE_TTL": str(LEASE_TTL),
        }

        def spawn(host: str, args: list[str]) -> Child:
            env = child_env(None, DYN_RUNTIME_HOST=lab.addresses[host], **planes)
            child = Child(args, env, prefix=lab.prefix(host))
            children.append(child)
            return child

        for host in ("w1", "w2"):
            spawn(host, ["-m", "dynamo.mocker", "--model-path", DEMO_MODEL, "--model-name", "demo"])
        for child in children:
            child.wait_for("serving model", timeout=60)
        front = lab.addresses["front"]
        spawn(
            "front",
            ["-m", "dynamo.frontend", "--http-host", front, "--http-port", "8000"]
            + ["--router-mode", "kv", "--migration-limit", "3"],
        )
        children[-1].wait_for("listening on http://", timeout=60)
        url = f"http://{front}:8000"

        def client(*args: str) -> Child:
            return spawn("front", [CLIENT, *args])

        health = client("health", url, "2")
        assert health.popen.wait(90) == 0, health.tail()

        # KV routing across hosts: a repeated prompt lands where its blocks are cached.
        first = client("run", url, "300", "4")
        assert first.popen.wait(120) == 0, first.tail()
        results = _results(first)
        assert [r["status"] for r in results] == [200] * 4, results
        assert results[0]["cached"] == 0 and all(int(r["cached"]) > 0 for r in results[1:])

        # Remove worker host w1 while two clients keep sending.
        stop_file = tmp_path / "stop"
        load = client("until", url, "200", "2", str(stop_file))
        time.sleep(2.0)
        lab.remove("w1")
        one_left = client("health", url, "1")
        assert one_left.popen.wait(LEASE_TTL + 60) == 0, one_left.tail()
        time.sleep(2.0)  # keep serving from the remaining host for a while
        stop_file.write_text("")
        assert load.popen.wait(120) == 0, load.tail()
        during = _results(load)
        failed = [r for r in during if r["status"] != 200]
        assert len(during) - len(failed) > 0
        # Migration is on: a request streaming from the removed host goes on elsewhere.
        assert failed == [], failed

        after = client("run", url, "300", "3")
        assert after.popen.wait(120) == 0, after.tail()
        assert [r["status"] for r in _results(after)] == [200] * 3
    finally:
        for child in reversed(children):
            child.stop()
        etcd.close()
        nats.close()

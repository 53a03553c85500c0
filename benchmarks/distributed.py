"""Many-machines benchmark (issue 15): etcd + NATS against file + ZMQ, in the same run.

1. KV routing workload (``benchmarks/kv_routing.py``'s: ``dynamo serve --router-mode kv``, 4
   mockers of 512 blocks, 16 prefix groups of 1024 + 128 tokens, OSL 32, concurrency 32) once per
   shape, alternating: TTFT p50/p99 and cache hit rate. Goal: etcd + NATS within 5 % of file + ZMQ.
2. 100 simulated workers: 4 publisher processes x 25 worker ids send KV events (the real wire
   format, one stored-blocks event of 4 blocks per batch) as fast as they can for a few seconds;
   one router-side process subscribes, decodes and applies them to the router's ``KVIndexer``:
   events/s ingested and the ingesting process's CPU per event.
3. 100 workers registered (4 mocker processes x ``--num-workers 25``, lease TTL 5 s); one
   process is SIGKILLed: time until its 25 instances are gone from a discovery watch.

    .venv/bin/python benchmarks/distributed.py [--requests 320] [--seconds 5]

Needs the servers of ``scripts/install_servers.sh``. Results: stdout and
``bench-results/distributed.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO))

from kv_routing import one_run  # noqa: E402
from launcher import Child, service_env  # noqa: E402

from dynamo.protocol.kv_events import (  # noqa: E402
    BlocksStored,
    KVCacheEvent,
    KVEventBatch,
    StoredBlock,
)
from dynamo.protocol.kv_wire import decode_batch, encode_batch  # noqa: E402
from dynamo.router.indexer import KVIndexer  # noqa: E402
from dynamo.runtime.config import RuntimeConfig  # noqa: E402
from dynamo.runtime.discovery.base import WatchEventKind  # noqa: E402
from dynamo.runtime.runtime import DistributedRuntime  # noqa: E402
from tests.servers import EtcdServer, NatsServer  # noqa: E402

SHAPES = ("file+zmq", "etcd+nats")
LEASE_TTL = 5.0  # file discovery needs headroom on a loaded 2-core machine


def shape_env(shape: str, etcd: EtcdServer, nats: NatsServer, tmp: str) -> dict[str, str]:
    """The DYN_* settings of a shape (what `dynamo serve` passes its children)."""
    if shape == "etcd+nats":
        return {
            "DYN_DISCOVERY_BACKEND": "etcd",
            "ETCD_ENDPOINTS": etcd.endpoint,
            "DYN_EVENT_PLANE": "nats",
            "NATS_SERVER": nats.url,
            "DYN_NAMESPACE": f"bench{int(time.time() * 1000) % 10**8}",
        }
    return {
        "DYN_DISCOVERY_BACKEND": "file",
        "DYN_FILE_KV": os.path.join(tmp, "kv"),
        "DYN_EVENT_PLANE": "zmq",
        "DYN_NAMESPACE": "bench",
    }


def runtime_config(env: dict[str, str]) -> RuntimeConfig:
    return RuntimeConfig(
        namespace=env["DYN_NAMESPACE"],
        discovery_backend=env["DYN_DISCOVERY_BACKEND"],
        discovery_dir=env.get("DYN_FILE_KV", tempfile.gettempdir()),
        event_plane=env["DYN_EVENT_PLANE"],
        etcd_endpoints=(env.get("ETCD_ENDPOINTS", "http://127.0.0.1:2379"),),
        nats_server=env.get("NATS_SERVER", "nats://127.0.0.1:4222"),
        lease_ttl=LEASE_TTL,
    )


# -- 1. the KV routing workload -------------------------------------------------------------
def kv_routing_run(
    shape: str, etcd: EtcdServer, nats: NatsServer, requests: int, seed: int
) -> dict[str, Any]:
    planes = shape_env(shape, etcd, nats, tempfile.gettempdir())  # (the flags' settings only)
    flags = ["--discovery-backend", planes["DYN_DISCOVERY_BACKEND"]]
    flags += ["--event-plane", planes["DYN_EVENT_PLANE"], "--namespace", planes["DYN_NAMESPACE"]]
    if shape == "etcd+nats":
        flags += ["--etcd-endpoints", etcd.endpoint, "--nats-server", nats.url]
    run = one_run("kv", seed, requests, flags, name=f"serve-{shape}")
    return {k: run[k] for k in ("ttft_p50_ms", "ttft_p99_ms", "cache_hit_rate", "errors")}


# -- 2. event ingest from 100 simulated workers -----------------------------------------------
async def publisher_main(
    env_json: str, first_worker: int, workers: int, seconds: float, rate: float
) -> None:
    """One publisher process: ``workers`` worker ids, batches round-robin, ``rate`` batches/s
    in total (paced every 10 ms)."""
    env = json.loads(env_json)
    runtime = DistributedRuntime(runtime_config(env))
    await runtime.start()
    await asyncio.sleep(1.0)  # subscribers connect (ZMQ connects asynchronously)
    event_ids = [0] * workers
    deadline = time.monotonic() + seconds
    sent = 0
    started = time.monotonic()
    w = 0
    while time.monotonic() < deadline:
        due = int((time.monotonic() - started) * rate) - sent
        for _ in range(due):
            w = (w + 1) % workers
            eid = event_ids[w]
            event_ids[w] = eid + 1
            base = (first_worker + w) << 32 | eid << 2
            blocks = [StoredBlock(block_hash=base + i, tokens_hash=base + i) for i in range(4)]
            event = KVCacheEvent(event_id=eid, data=BlocksStored(parent_hash=None, blocks=blocks))
            batch = KVEventBatch(worker_id=first_worker + w, events=[event])
            await runtime.events.publish("kv-events", encode_batch(batch))
            sent += 1
        await asyncio.sleep(0.01)
    print(json.dumps({"sent": sent}), flush=True)
    await asyncio.sleep(1.0)
    await runtime.shutdown()


async def ingest(shape: str, env: dict[str, str], seconds: float, rate: float) -> dict[str, Any]:
    runtime = DistributedRuntime(runtime_config(env))
    await runtime.start()
    sub = await runtime.events.subscribe("kv-events")
    indexer = KVIndexer()
    publishers = [
        Child(
            f"pub{i}",
            [__file__, "--publisher", json.dumps(env), str(1 + i * 25), "25", str(seconds)]
            + [str(rate / 4)],
            service_env(),
        )
        for i in range(4)
    ]
    received = 0
    first: float | None = None
    last = 0.0
    cpu0 = time.process_time()

    async def consume() -> None:
        nonlocal received, first, last
        async for message in sub:
            batch = decode_batch(message.payload)
            if batch is None:
                continue
            for event in batch.events:
                indexer.apply(batch.worker_id, event)
            received += 1
            last = time.monotonic()
            if first is None:
                first = last

    task = asyncio.create_task(consume())
    for p in publishers:
        await asyncio.to_thread(p.proc.wait)
    await asyncio.sleep(0.5)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    cpu = time.process_time() - cpu0
    sent = sum(
        json.loads(line)["sent"] for p in publishers for line in p.lines if line.startswith("{")
    )
    await sub.close()
    await runtime.shutdown()
    span = (last - first) if first is not None else 0.0
    return {
        "sent": sent,
        "received": received,
        "events_per_s": received / span if span > 0 else 0.0,
        "cpu_us_per_event": cpu / received * 1e6 if received else 0.0,
    }


# -- 3. death to removal ----------------------------------------------------------------------
async def death_to_removal(env: dict[str, str], demo: str) -> dict[str, Any]:
    child_env = service_env(DYN_LEASE_TTL=str(LEASE_TTL), **env)
    mockers = [
        Child(
            f"mocker{i}",
            ["-m", "dynamo.mocker", "--model-path", demo, "--model-name", "demo"]
            + ["--num-workers", "25", "--speedup-ratio", "0"],
            child_env,
        )
        for i in range(4)
    ]
    runtime = DistributedRuntime(runtime_config(env))
    await runtime.start()
    prefix = f"v1/instances/{env['DYN_NAMESPACE']}/backend/generate/"
    watch = await runtime.discovery.watch_prefix(prefix)
    live = {kv.key for kv in watch.snapshot}
    registered_at = time.monotonic()
    it = aiter(watch)
    while len(live) < 100:
        try:
            event = await asyncio.wait_for(anext(it), 120)
        except TimeoutError:
            for m in mockers:
                print(f"{m.name}: {m.lines[-10:]}", file=sys.stderr)
            raise
        if event.kind is WatchEventKind.PUT:
            live.add(event.key)
    register_s = time.monotonic() - registered_at
    before = set(live)
    await asyncio.sleep(1.0)
    victim = mockers[0]
    victim.proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    while len(live) > 75:
        event = await asyncio.wait_for(anext(it), 60)
        if event.kind is WatchEventKind.DELETE:
            live.discard(event.key)
    removal_s = time.monotonic() - killed
    assert len(before - live) == 25
    await watch.close()
    await runtime.shutdown()
    for m in mockers:
        m.stop()
    return {"register_100_s": register_s, "death_to_removal_s": removal_s, "lease_ttl_s": LEASE_TTL}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--publisher":
        asyncio.run(
            publisher_main(argv[1], int(argv[2]), int(argv[3]), float(argv[4]), float(argv[5]))
        )
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=320)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument(
        "--rates", default="2000,8000", help="offered KV event batches/s (all 100 workers)"
    )
    parser.add_argument("--skip-routing", action="store_true")
    parser.add_argument("--out", default=str(REPO / "bench-results" / "distributed.json"))
    args = parser.parse_args(argv)
    from dynamo.preprocess.model_dir import demo_model_path

    etcd, nats = EtcdServer(), NatsServer()
    etcd.start()
    nats.start()
    results: dict[str, Any] = {shape: {} for shape in SHAPES}
    try:
        if not args.skip_routing:
            for shape in SHAPES:
                r = kv_routing_run(shape, etcd, nats, args.requests, seed=100)
                results[shape]["kv_routing"] = r
                print(
                    f"{shape:>10} kv routing: TTFT p50 {r['ttft_p50_ms']:.1f} ms,"
                    f" p99 {r['ttft_p99_ms']:.1f} ms, hit rate {r['cache_hit_rate']:.2f},"
                    f" errors {r['errors']}",
                    flush=True,
                )
        for shape in SHAPES:
            with tempfile.TemporaryDirectory(prefix="dynamo-dist-bench-") as tmp:
                env = shape_env(shape, etcd, nats, tmp)
                for rate in [float(x) for x in args.rates.split(",")]:
                    r = asyncio.run(ingest(shape, env, args.seconds, rate))
                    results[shape][f"ingest@{rate:.0f}"] = r
                    print(
                        f"{shape:>10} ingest at {rate:.0f}/s offered: {r['events_per_s']:.0f}"
                        f" events/s ({r['received']}/{r['sent']} received),"
                        f" {r['cpu_us_per_event']:.1f} us CPU per event",
                        flush=True,
                    )
                d = asyncio.run(death_to_removal(env, str(demo_model_path())))
                results[shape]["registration"] = d
                print(
                    f"{shape:>10} 100 workers registered in {d['register_100_s']:.1f} s;"
                    f" death to removal {d['death_to_removal_s']:.2f} s (lease TTL {LEASE_TTL} s)",
                    flush=True,
                )
    finally:
        etcd.close()
        nats.close()
    report = {
        "benchmark": "distributed",
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

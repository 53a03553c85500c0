"""``dynamo serve``: the one-command stack on this machine.

Starts the frontend and N workers (``--engine mocker``, the default, or ``pytorch``) as child
processes sharing a temporary file-discovery directory, with the TCP request plane and the ZMQ
event plane on 127.0.0.1, serving the demo model that ships in the package (or ``--model-path``;
the pytorch engine needs one with weights). Every frontend and engine flag is accepted and
passed to its process (``serve_args.py``; ``--help`` shows the groups); an unknown or invalid flag
fails before anything starts. Ctrl-C or SIGTERM stops every child cleanly. ``--in-process`` runs
the same stack in one process (memory discovery, in-process planes).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dynamo.serve_args import ServePlan

DEMO_MODEL_PATH = str(Path(__file__).resolve().parent / "models" / "demo")
STOP_TIMEOUT_S = 15.0


def _shown_host(host: str) -> str:
    """A wildcard listen address is not one to connect to: show loopback instead."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def _curl_example(host: str, port: int, model: str) -> str:
    shown = _shown_host(host)
    return (
        f"curl -s http://{shown}:{port}/v1/chat/completions -H 'content-type: application/json' "
        f'-d \'{{"model": "{model}", "messages": [{{"role": "user", "content": '
        f'"Hello!"}}], "max_tokens": 16}}\''
    )


def main(argv: list[str] | None = None) -> int:
    from dynamo.serve_args import plan

    serve_plan = plan(argv)  # exits 2 with a message on any bad flag, before starting anything
    if serve_plan.args.in_process:
        from dynamo.serve_inprocess import serve_in_process

        return serve_in_process(serve_plan)
    return _serve_processes(serve_plan)


def _describe_workers(roles: tuple[str, ...], engine: str) -> str:
    prefill, decode = roles.count("prefill"), roles.count("decode")
    if decode:
        return f"{prefill} prefill + {decode} decode {engine} workers"
    return f"{len(roles)} {engine} workers"


def _free_port(host: str) -> int:
    """A port that is free now (``--http-port 0``), so the banner can show the real one."""
    import socket

    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def _serve_processes(serve_plan: ServePlan) -> int:
    args = serve_plan.args
    frontend_argv = serve_plan.frontend_argv
    if args.http_port == 0:
        args.http_port = _free_port(args.http_host)
        frontend_argv = [*frontend_argv, f"--http-port={args.http_port}"]
    discovery_dir = tempfile.mkdtemp(prefix="dynamo-serve-")
    env = dict(os.environ)
    env.update(
        {
            "DYN_DISCOVERY_BACKEND": "file",
            "DYN_FILE_KV": discovery_dir,
            "DYN_REQUEST_PLANE": "tcp",
            "DYN_EVENT_PLANE": "zmq",
            "DYN_NAMESPACE": args.namespace,
        }
    )
    py = sys.executable
    children: list[subprocess.Popen[bytes]] = []
    stopping = False

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        for role in serve_plan.roles:
            cmd = [py, "-m", serve_plan.worker_module, *serve_plan.worker_argv(role)]
            children.append(subprocess.Popen(cmd, env=env))
        frontend_cmd = [py, "-m", "dynamo.frontend", *frontend_argv]
        children.append(subprocess.Popen(frontend_cmd, env=env))
        print(
            f"dynamo serve: model {args.model_name!r} at"
            f" http://{_shown_host(args.http_host)}:{args.http_port}"
            f" ({_describe_workers(serve_plan.roles, args.engine)}, router {args.router_mode})",
            flush=True,
        )
        print(
            f"try:\n  {_curl_example(args.http_host, args.http_port, args.model_name)}", flush=True
        )
        while not stopping:
            for child in children:
                if child.poll() is not None:
                    print(
                        f"dynamo serve: child {child.args!r} exited with {child.returncode};"
                        " stopping",
                        file=sys.stderr,
                        flush=True,
                    )
                    stopping = True
                    break
            time.sleep(0.2)
    finally:
        _stop_children(children)
        import shutil

        shutil.rmtree(discovery_dir, ignore_errors=True)
    failed = [c for c in children if c.returncode not in (0, -signal.SIGTERM)]
    return 1 if failed else 0


def _stop_children(children: list[subprocess.Popen[bytes]]) -> None:
    # Frontend first (stop taking requests), then workers; each gets SIGTERM and a grace period.
    for child in reversed(children):
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for child in children:
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


if __name__ == "__main__":
    sys.exit(main())

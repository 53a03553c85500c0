"""Health-check canaries (FACTS §8): an endpoint instance idle for ``DYN_CANARY_WAIT_TIME``
seconds gets a minimal request through its normal path, the request plane to itself.

A canary that fails or outlasts ``DYN_HEALTH_CHECK_REQUEST_TIMEOUT`` marks the instance
``notready`` (the worker's ``/health`` answers 503) and takes its instance registration out of
discovery, so routers stop sending it traffic; it keeps being probed (it is idle now) and the
first canary that succeeds puts the registration back. Real traffic counts as activity, so a busy
instance is never probed.

Settings (:class:`HealthCheckConfig`; flags whose environment twins are the reference's):
``--health-check-enabled`` / ``DYN_HEALTH_CHECK_ENABLED`` (default false),
``--canary-wait-time`` / ``DYN_CANARY_WAIT_TIME`` (10 s),
``--health-check-request-timeout`` / ``DYN_HEALTH_CHECK_REQUEST_TIMEOUT`` (3 s),
``--health-check-payload`` / ``DYN_HEALTH_CHECK_PAYLOAD`` (a JSON object or ``@file``: the
request, in the ``PreprocessedRequest`` shape; the reference's ``stop_conditions`` /
``sampling_options`` names are accepted too). Without a payload setting, the engine's
``health_check_payload()`` is used; an engine with neither is not probed.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from dynamo.backend.engine import LLMEngine
from dynamo.protocol.output import FinishReason, LLMEngineOutput
from dynamo.protocol.request import PreprocessedRequest
from dynamo.runtime.config import add_flag
from dynamo.runtime.context import Context
from dynamo.runtime.runtime import DistributedRuntime, ServedEndpoint

log = logging.getLogger(__name__)

_ALIASES = {"stop_conditions": "stop", "sampling_options": "sampling"}
DEFAULT_CANARY_WAIT_S = 10.0
DEFAULT_REQUEST_TIMEOUT_S = 3.0
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(LLMEngineOutput)
_probe_ids = itertools.count(1)


@dataclass(frozen=True, slots=True)
class HealthCheckConfig:
    enabled: bool = False
    canary_wait_s: float = DEFAULT_CANARY_WAIT_S
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    payload: str | None = None  # DYN_HEALTH_CHECK_PAYLOAD, raw (JSON or @file)

    def __post_init__(self) -> None:
        if self.canary_wait_s <= 0 or self.request_timeout_s <= 0:
            raise ValueError("canary wait time and health-check timeout must be positive")

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        d = HealthCheckConfig()
        add_flag(
            parser,
            "--health-check-enabled",
            default=d.enabled,
            type=bool,
            help="probe idle endpoint instances with canary requests",
        )
        add_flag(
            parser,
            "--canary-wait-time",
            default=d.canary_wait_s,
            type=float,
            help="seconds an instance is idle before a canary probes it",
        )
        add_flag(
            parser,
            "--health-check-request-timeout",
            default=d.request_timeout_s,
            type=float,
            help="seconds a canary may take before the instance is marked notready",
        )
        add_flag(
            parser,
            "--health-check-payload",
            default=d.payload,
            help="the canary request: a JSON object or @file (default: the engine's own)",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> HealthCheckConfig:
        return cls(
            enabled=args.health_check_enabled,
            canary_wait_s=args.canary_wait_time,
            request_timeout_s=args.health_check_request_timeout,
            payload=args.health_check_payload or None,
        )


def parse_payload(raw: str, model: str) -> PreprocessedRequest:
    """A ``DYN_HEALTH_CHECK_PAYLOAD`` value (JSON object or ``@path``) as a request for
    ``model`` (used when the payload names none). Raises ``ValueError`` when it is not one."""
    text = Path(raw[1:]).read_text() if raw.startswith("@") else raw
    try:
        obj = msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        raise ValueError(f"DYN_HEALTH_CHECK_PAYLOAD is not JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise ValueError("DYN_HEALTH_CHECK_PAYLOAD must be a JSON object")
    fields: dict[str, Any] = {_ALIASES.get(str(k), str(k)): v for k, v in obj.items()}
    fields.setdefault("model", model)
    try:
        return msgspec.convert(fields, PreprocessedRequest)
    except msgspec.ValidationError as exc:
        raise ValueError(f"DYN_HEALTH_CHECK_PAYLOAD is not a request: {exc}") from exc


def canary_payload(
    engine: LLMEngine, config: HealthCheckConfig, model: str
) -> PreprocessedRequest | None:
    """The operator's ``DYN_HEALTH_CHECK_PAYLOAD`` if set and valid, else the engine's own
    (None: this engine is not probed). An invalid override is logged, as the reference does."""
    if config.payload is not None:
        try:
            return parse_payload(config.payload, model)
        except (ValueError, OSError) as exc:
            log.error("%s; using the engine's own health-check payload", exc)
    return engine.health_check_payload()


class HealthCanary:
    """Probes one served instance when it is idle; withdraws it from discovery while it fails.

    ``last_activity()`` returns the monotonic time of the instance's latest successful output
    (the adapter keeps it). ``on_change(healthy)`` is told of every transition.
    """

    def __init__(
        self,
        runtime: DistributedRuntime,
        served: ServedEndpoint,
        payload: PreprocessedRequest,
        config: HealthCheckConfig,
        last_activity: Callable[[], float],
        on_change: Callable[[bool], None] | None = None,
    ) -> None:
        self._runtime = runtime
        self._served = served
        self._payload = payload
        self._config = config
        self._last_activity = last_activity
        self._on_change = on_change
        self._registration: bytes | None = None  # the instance's discovery value while withdrawn
        self._last_probe = time.monotonic()
        self.healthy = True
        self.probes = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"canary:{self._served.key}")

    async def stop(self) -> None:
        """Stop probing. A withdrawn registration stays withdrawn (the worker is leaving)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        wait = self._config.canary_wait_s
        while True:
            idle_since = max(self._last_activity(), self._last_probe)
            due = idle_since + wait - time.monotonic()
            if due > 0:
                await asyncio.sleep(due)
                continue
            ok = await self.probe()
            self._last_probe = time.monotonic()
            try:
                await self._set_healthy(ok)
            except Exception:  # discovery trouble: try again at the next probe
                log.exception("health check of %s could not update discovery", self._served.key)

    async def probe(self) -> bool:
        """Send one canary through the request plane to this instance; True if it completed."""
        self.probes += 1
        request = msgspec.structs.replace(
            self._payload, request_id=f"health-check-{next(_probe_ids)}"
        )
        ctx = Context(request.request_id)
        server = await self._runtime.server()
        route = self._served.endpoint_id.instance_path(self._served.instance_id)
        stream = self._runtime.transport.stream(
            server.address, route, _encoder.encode(request), ctx
        )
        try:
            async with asyncio.timeout(self._config.request_timeout_s):
                async for body in stream:
                    out = _decoder.decode(body)
                    if out.finish_reason is FinishReason.ERROR:
                        raise RuntimeError(out.error or "error terminal")
            return True
        except TimeoutError:
            log.warning(
                "health check of %s: no answer within %.1fs",
                self._served.key,
                self._config.request_timeout_s,
            )
        except Exception as exc:
            log.warning("health check of %s failed: %s", self._served.key, exc)
        finally:
            ctx.stop_generating()
            await stream.aclose()
        return False

    async def _set_healthy(self, ok: bool) -> None:
        if ok == self.healthy:
            return
        discovery, key = self._runtime.discovery, self._served.key
        if ok:
            if self._registration is not None:
                await discovery.put(key, self._registration, self._runtime.lease)
                self._registration = None
            log.info("health check of %s passed again: back in routing", key)
        else:
            current = await discovery.get(key)
            if current is not None:
                self._registration = current.value
                await discovery.delete(key)
            log.warning("health check of %s failed: out of routing until a canary passes", key)
        self.healthy = ok
        if self._on_change is not None:
            self._on_change(ok)

"""HTTP client run inside a test's network namespace (the test process cannot reach it).

``health URL N``: wait until /health lists N instances (exit 1 after 60 s).
``run URL PROMPT_WORDS N``: N sequential completions of one prompt, one JSON line each, the
later ones once the frontend's router applied the KV events of the first (if it cached none).
``until URL PROMPT_WORDS CONCURRENCY STOP_FILE``: completions until STOP_FILE exists.
Each result line: {"status": int, "cached": int, "error": str}.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import httpx


def _prompt(words: int) -> str:
    return " ".join(f"word{i}" for i in range(words))


STORED = 'dynamo_component_kv_cache_events_applied_total{event_type="stored",status="ok"}'


async def _stored_applied(client: httpx.AsyncClient, url: str) -> float:
    """The KV events storing blocks the frontend's router has applied (all workers)."""
    text = (await client.get(f"{url}/metrics")).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(STORED))


async def _one(client: httpx.AsyncClient, url: str, prompt: str) -> dict[str, object]:
    body = {"model": "demo", "prompt": prompt, "max_tokens": 8}
    try:
        response = await client.post(f"{url}/v1/completions", json=body)
    except httpx.HTTPError as exc:
        return {"status": 0, "cached": 0, "error": repr(exc)}
    cached = 0
    error = ""
    if response.status_code == 200:
        usage = response.json().get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    else:
        error = response.text[:300]
    return {"status": response.status_code, "cached": cached, "error": error}


async def main(argv: list[str]) -> int:
    mode, url = argv[0], argv[1]
    async with httpx.AsyncClient(timeout=60) as client:
        if mode == "health":
            want, deadline = int(argv[2]), time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    health = (await client.get(f"{url}/health")).json()
                    if len(health.get("instances", [])) == want:
                        print(json.dumps({"instances": want}), flush=True)
                        return 0
                except (httpx.HTTPError, ValueError):
                    pass
                await asyncio.sleep(0.2)
            return 1
        prompt = _prompt(int(argv[2]))
        if mode == "run":
            applied = await _stored_applied(client, url)
            for i in range(int(argv[3])):
                result = await _one(client, url, prompt)
                print(json.dumps(result), flush=True)
                # The first request's KV events (it stored every block: nothing was cached)
                # reach the router over NATS from another host, and its answer can come first:
                # waited for, not a fixed 0.3 s guess. On time out the next answers show it.
                deadline = time.monotonic() + 30
                while i == 0 and result["cached"] == 0 and time.monotonic() < deadline:
                    if await _stored_applied(client, url) > applied:
                        break
                    await asyncio.sleep(0.05)
            return 0

        async def loop(worker: int) -> None:
            # Each loop its own prompt family: requests spread over both workers.
            own = f"client{worker} {prompt}"
            while not os.path.exists(argv[4]):
                print(json.dumps(await _one(client, url, own)), flush=True)

        await asyncio.gather(*(loop(i) for i in range(int(argv[3]))))
        return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))

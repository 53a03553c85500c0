"""HTTP client run inside a test's network namespace (the test process cannot reach it).

``health URL N``: wait until /health lists N instances (exit 1 after 60 s).
``run URL PROMPT_WORDS N``: N sequential completions of one prompt, one JSON line each.
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
            for _ in range(int(argv[3])):
                print(json.dumps(await _one(client, url, prompt)), flush=True)
                await asyncio.sleep(0.3)  # the request's KV event reaches the router
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

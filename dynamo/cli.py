"""``dynamo``: one console script for every service (serve, frontend, mocker, bench, ...)."""

from __future__ import annotations

import importlib
import sys

from dynamo.runtime.heap import settle_after_start

COMMANDS = {
    "serve": "dynamo.serve",
    "frontend": "dynamo.frontend.__main__",
    "mocker": "dynamo.mocker.__main__",
    "slot-tracker": "dynamo.slot_tracker.__main__",
    "bench": "dynamo.bench.__main__",
    "replay": "dynamo.replay.__main__",
    "plan": "dynamo.replay.plan",
}

SUMMARY = {
    "serve": "frontend + N mocker workers on this machine (one command)",
    "frontend": "the OpenAI-compatible HTTP frontend",
    "mocker": "a simulated vLLM-like worker",
    "slot-tracker": "the slot tracker HTTP service",
    "bench": "the load generator",
    "replay": "simulate a deployment offline on a virtual clock",
    "plan": "cheapest deployments meeting a latency SLO (sweeps replays)",
}

SETTLE_FIRST = frozenset({"replay", "plan"})
"""CPU-bound batch commands: their process gets a service's collector settings
(``runtime.heap.settle_after_start``) once the command's modules are imported; the services
settle themselves after their start-up."""

USAGE = (
    "usage: dynamo {"
    + "|".join(COMMANDS)
    + "} [options]   (dynamo COMMAND --help)\n\ncommands:\n"
    + "\n".join(f"  {name:<14}{SUMMARY[name]}" for name in COMMANDS)
)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = args[0], args[1:]
    module_name = COMMANDS.get(command)
    if module_name is None:
        print(f"dynamo: unknown command {command!r}\n{USAGE}", file=sys.stderr)
        return 2
    module = importlib.import_module(module_name)
    if command in SETTLE_FIRST:
        settle_after_start()
    result = module.main(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())

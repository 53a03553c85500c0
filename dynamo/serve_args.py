"""``dynamo serve``'s command line: its own flags plus every frontend and worker flag, grouped by
the process it goes to, all validated before anything starts.

``--engine`` picks the workers' engine (``mocker``, the default, or ``pytorch``); it is read
first, because the worker flags are that engine's. The frontend's and the engine's flags are taken
from their own parsers (so a flag added there appears here with its help and ``DYN_*`` twin),
minus the ones ``dynamo serve`` decides itself (the runtime group: namespace, discovery, planes;
and the flags it sets from its own: HTTP address, router mode, model, role). A flag both
processes know (``--log-level``) goes to both. An unknown flag is an error, as is a value either
process's config refuses (checked here by building the configs).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dynamo.backend.serve_engine import ServeOptions
from dynamo.frontend.config import ROUTER_MODES, FrontendConfig
from dynamo.mocker.config import MockerConfig
from dynamo.runtime.config import DEFAULT_ETCD_ENDPOINTS, DEFAULT_NATS_SERVER, add_flag

if TYPE_CHECKING:
    from dynamo.pytorch.config import TorchEngineConfig

DEMO_MODEL_NAME = "demo"

# Flags ``dynamo serve`` owns: a child's flag of the same name is set from serve's value.
_FRONTEND_FROM_SERVE = ("--http-host", "--http-port", "--router-mode")
_WORKER_FROM_SERVE = ("--model-path", "--model-name", "--disaggregation-mode")
ENGINES = ("mocker", "pytorch")
"""Worker engines, each served by ``python -m dynamo.<engine>``."""
_RUNTIME_GROUP = "runtime"  # namespace, discovery and planes: serve wires those itself

FRONTEND, WORKERS, BOTH = "frontend", "workers", "both"
_GROUP_TITLES = {
    BOTH: "frontend and workers (passed to every process)",
    FRONTEND: "frontend (passed to the frontend process)",
    WORKERS: "workers (passed to every worker process)",
}


@dataclass(frozen=True, slots=True)
class ServePlan:
    """What ``dynamo serve`` starts, validated: serve's own settings, the argv of the frontend
    and of each worker, and the configs those argvs produce."""

    args: argparse.Namespace
    frontend_argv: list[str]
    engine_argv: list[str]
    frontend: FrontendConfig
    engine_config: MockerConfig | TorchEngineConfig
    roles: tuple[str, ...] = ("agg",)
    worker_options: ServeOptions = field(default_factory=ServeOptions)
    """The worker flags (health checks, stream validation...) as parsed for the workers: what
    in-process serving applies, since it starts no worker process to parse them."""

    @property
    def worker_module(self) -> str:
        """What ``python -m`` runs for each worker."""
        return f"dynamo.{self.args.engine}"

    def worker_argv(self, role: str) -> list[str]:
        """The argv of one worker process of ``role`` (agg, prefill or decode)."""
        return [*self.engine_argv, f"--disaggregation-mode={role}"]

    def worker_config(self, role: str) -> MockerConfig | TorchEngineConfig:
        return dataclasses.replace(self.engine_config, disaggregation_mode=role)


def _frontend_parser() -> argparse.ArgumentParser:
    from dynamo.frontend.__main__ import build_parser

    return build_parser()


def _worker_parser(engine: str) -> argparse.ArgumentParser:
    if engine == "pytorch":
        try:
            from dynamo.pytorch.__main__ import build_parser as torch_parser
        except ImportError as exc:  # the extra is not installed
            raise SystemExit(
                f"dynamo serve: --engine pytorch needs the pytorch extra (dynamo-py[pytorch]): "
                f"{exc}"
            ) from exc
        return torch_parser()
    from dynamo.mocker.__main__ import build_parser

    return build_parser()


def _worker_config(engine: str, args: argparse.Namespace) -> MockerConfig | TorchEngineConfig:
    """The config a worker builds from ``args`` (``ValueError``/``OSError`` if refused)."""
    if engine == "pytorch":
        from dynamo.pytorch.config import TorchEngineConfig
        from dynamo.pytorch.model import weight_files
        from dynamo.pytorch.model_config import ModelConfig

        config = TorchEngineConfig.from_args(args)
        ModelConfig.from_model_dir(config.model_path)  # an architecture the engine runs
        weight_files(config.model_path)
        return config
    from dynamo.mocker.__main__ import mocker_config

    return mocker_config(args)


def _add_engine_flag(parser: Any) -> None:
    add_flag(
        parser,
        "--engine",
        default="mocker",
        choices=ENGINES,
        env="DYN_SERVE_ENGINE",
        help="the workers' engine: mocker (simulated) or pytorch (a real model; --model-path)",
    )


def _engine_of(argv: list[str] | None) -> str:
    """``--engine`` alone (the other flags depend on it); a bad value fails here."""
    pre = argparse.ArgumentParser("dynamo serve", add_help=False, allow_abbrev=False)
    _add_engine_flag(pre)
    known, _ = pre.parse_known_args(argv)
    return str(known.engine)


def _child_actions(
    parser: argparse.ArgumentParser, owned: Iterable[str]
) -> dict[str, argparse.Action]:
    """The parser's options by their first option string, without help, the runtime group and
    the flags serve owns."""
    skip = set(owned)
    for group in parser._action_groups:  # noqa: SLF001 - argparse keeps groups only here
        if group.title == _RUNTIME_GROUP:
            skip.update(s for a in group._group_actions for s in a.option_strings)  # noqa: SLF001
    return {
        a.option_strings[0]: a
        for a in parser._actions  # noqa: SLF001
        if a.option_strings
        and not isinstance(a, argparse._HelpAction)  # noqa: SLF001
        and not skip.intersection(a.option_strings)
    }


def build_parser(engine: str = "mocker") -> argparse.ArgumentParser:
    """The serve parser for workers of ``engine``, with one argument group per destination
    process."""
    parser = argparse.ArgumentParser(
        "dynamo serve",
        description="frontend + N workers on this machine. Each group below says which "
        "process its flags go to; an unknown flag is an error.",
        allow_abbrev=False,
    )
    own = parser.add_argument_group("dynamo serve")
    _add_engine_flag(own)
    add_flag(own, "--http-host", default="0.0.0.0", help="frontend listen address")
    add_flag(own, "--http-port", default=8000, type=int, help="frontend port (0: any free port)")
    add_flag(
        own,
        "--workers",
        default=2,
        type=int,
        env="DYN_SERVE_WORKERS",
        help="worker processes",
    )
    add_flag(
        own,
        "--prefill-workers",
        default=0,
        type=int,
        env="DYN_SERVE_PREFILL_WORKERS",
        help="disaggregated serving: prefill worker processes (with --decode-workers, which "
        "then replace --workers)",
    )
    add_flag(
        own,
        "--decode-workers",
        default=0,
        type=int,
        env="DYN_SERVE_DECODE_WORKERS",
        help="disaggregated serving: decode worker processes (prefill locally without "
        "--prefill-workers)",
    )
    add_flag(
        own,
        "--router-mode",
        default="round-robin",
        choices=ROUTER_MODES,
        help="how the frontend picks a worker",
    )
    add_flag(
        own,
        "--model-path",
        default=None,
        help="model directory (default, mocker only: the demo model that ships in the package)",
    )
    add_flag(
        own,
        "--model-name",
        default=DEMO_MODEL_NAME,
        help="served model name",
    )
    add_flag(own, "--namespace", default="dynamo", help="dynamo namespace")
    add_flag(
        own,
        "--discovery-backend",
        default="file",
        choices=("file", "etcd"),
        help="file: a temporary directory on this machine; etcd: --etcd-endpoints (many machines)",
    )
    add_flag(
        own,
        "--event-plane",
        default="zmq",
        choices=("zmq", "nats"),
        help="zmq: PUB/SUB on this machine; nats: --nats-server (many machines)",
    )
    add_flag(
        own,
        "--etcd-endpoints",
        default=DEFAULT_ETCD_ENDPOINTS,
        env="ETCD_ENDPOINTS",
        help="etcd client URLs, comma-separated",
    )
    add_flag(
        own, "--nats-server", default=DEFAULT_NATS_SERVER, env="NATS_SERVER", help="NATS URL(s)"
    )
    add_flag(
        own,
        "--runtime-host",
        default="127.0.0.1",
        env="DYN_RUNTIME_HOST",
        help="address the children's request and event planes bind",
    )
    add_flag(
        own,
        "--runtime-advertise-host",
        default="",
        env="DYN_RUNTIME_ADVERTISE_HOST",
        help="address published for them (empty: the bind address)",
    )
    add_flag(
        own,
        "--in-process",
        default=False,
        type=bool,
        env="DYN_SERVE_IN_PROCESS",
        help="run everything in one process",
    )
    frontend = _child_actions(_frontend_parser(), _FRONTEND_FROM_SERVE)
    worker = _child_actions(_worker_parser(engine), _WORKER_FROM_SERVE)
    groups = {name: parser.add_argument_group(title) for name, title in _GROUP_TITLES.items()}
    for flag, action in {**frontend, **worker}.items():
        where = (
            BOTH
            if flag in frontend and flag in worker
            else FRONTEND
            if flag in frontend
            else WORKERS
        )
        _adopt(groups[where], action, where)
    return parser


def _adopt(group: Any, action: argparse.Action, where: str) -> None:
    """Add a copy of a child's option to ``group``; its value lands in ``<where>:<dest>`` and
    only when given (``SUPPRESS``), so that only flags the user set are passed on."""
    clone = copy.copy(action)
    clone.dest = f"{where}:{action.dest}"
    clone.default = argparse.SUPPRESS
    if clone.metavar is None and clone.nargs != 0 and clone.choices is None:
        clone.metavar = action.dest.upper()
    group._add_action(clone)  # noqa: SLF001 - the only way to add an existing Action


def _render(action: argparse.Action, value: Any) -> list[str]:
    """The argv tokens that make ``action`` produce ``value``."""
    opts = action.option_strings
    if isinstance(action, argparse.BooleanOptionalAction):
        positive = [s for s in opts if not s.startswith("--no-")]
        negative = [s for s in opts if s.startswith("--no-")]
        return [positive[0] if value else negative[0]]
    if action.nargs == 0:  # store_true / store_false / store_const
        return [opts[0]] if value == action.const else []
    if isinstance(action, argparse._AppendAction):  # noqa: SLF001 - repeated flag
        return [tok for v in value for tok in _render(_single(action), v)]
    if action.nargs is None or action.nargs == "?":
        return [f"{opts[0]}={value}"]
    return [opts[0], *(str(v) for v in value)]


def _single(action: argparse.Action) -> argparse.Action:
    """A plain store action with ``action``'s flags (to render one element of a list)."""
    return argparse._StoreAction(action.option_strings, action.dest, nargs=action.nargs)  # noqa: SLF001


def _forwarded(parser: argparse.ArgumentParser, args: argparse.Namespace, where: str) -> list[str]:
    """The argv for one destination: every flag given in its group (or in ``both``)."""
    first: dict[str, argparse.Action] = {}
    for action in parser._actions:  # noqa: SLF001
        first.setdefault(action.dest, action)
    argv: list[str] = []
    for dest, value in vars(args).items():
        prefix, colon, _ = dest.partition(":")
        if colon and prefix in (where, BOTH):
            argv += _render(first[dest], value)
    return argv


def plan(argv: list[str] | None = None) -> ServePlan:
    """Parse and validate everything; exits with status 2 and a message on any bad flag."""
    engine = _engine_of(argv)
    parser = build_parser(engine)
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if args.prefill_workers < 0 or args.decode_workers < 0:
        parser.error("--prefill-workers and --decode-workers must be >= 0")
    if args.prefill_workers and not args.decode_workers:
        parser.error("--prefill-workers needs --decode-workers (decode workers serve the model)")
    roles = (
        ("prefill",) * args.prefill_workers + ("decode",) * args.decode_workers
        if args.decode_workers
        else ("agg",) * args.workers
    )
    if args.model_path is None:
        if engine != "mocker":
            parser.error(f"--engine {engine} needs --model-path (a Hugging Face model directory)")
        from dynamo.serve import DEMO_MODEL_PATH

        args.model_path = DEMO_MODEL_PATH
    frontend_argv = [
        f"--http-host={args.http_host}",
        f"--http-port={args.http_port}",
        f"--router-mode={args.router_mode}",
        *_forwarded(parser, args, FRONTEND),
    ]
    engine_argv = [
        f"--model-path={args.model_path}",
        f"--model-name={args.model_name}",
        *_forwarded(parser, args, WORKERS),
    ]
    try:
        fargs = _frontend_parser().parse_args(frontend_argv)
        frontend = FrontendConfig.from_args(fargs)
        wargs = _worker_parser(engine).parse_args(engine_argv)
        engine_config = _worker_config(engine, wargs)
        worker_options = ServeOptions.from_args(wargs)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    if wargs.system_port and len(roles) > 1:
        parser.error(
            f"--system-port {wargs.system_port} (or DYN_SYSTEM_PORT) would be the same port for"
            f" all {len(roles)} workers; use --system-port 0 (each picks a free port)"
        )
    frontend = dataclasses.replace(
        frontend, runtime=dataclasses.replace(frontend.runtime, namespace=args.namespace)
    )
    return ServePlan(
        args, frontend_argv, engine_argv, frontend, engine_config, roles, worker_options
    )

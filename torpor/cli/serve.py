"""``torpor serve``: the chat API, the admin, /metrics and the page over HTTP.

No configuration needed: the embedded SQLite file, the local deterministic
model, tokens generated and printed when not given. SIGTERM (or Ctrl-C)
drains: no new work, in-flight turns finish up to ``--shutdown-grace``
seconds, then the runtime stops and open streams end with what the log says.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import secrets
import sys
from typing import Any

from torpor.cli.common import (
    DEFAULT_DB,
    CliError,
    display_url,
    non_negative_float,
    non_negative_int,
    positive_float,
    store_url,
)
from torpor.cli.models import ModelSpec, build_model, model_spec
from torpor.errors import ConfigError

__all__ = ["add_parser", "run"]

MODELS = ("demo", "echo")


def model_choice(text: str) -> str | ModelSpec:
    """``demo``, ``echo``, or a provider's model (``openai:MODEL``, ``anthropic:MODEL``)."""
    if text in MODELS:
        return text
    if ":" not in text:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected demo, echo, openai:MODEL or anthropic:MODEL")
    return model_spec(text)


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve the chat API (SSE), the admin, /metrics and a browser page over HTTP",
        description="Run torpor as a chat backend: POST /v1/conversations/{id}/messages streams "
                    "the turn as Server-Sent Events; GET / is a page to try it; /admin and "
                    "/metrics need the admin token. Tokens not given are generated and printed.",
    )
    p.add_argument("--db", type=store_url, default=DEFAULT_DB, metavar="URL",
                   help=f"store URL (default {DEFAULT_DB}; env TORPOR_DB)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free one)")
    p.add_argument("--model", type=model_choice, default="demo", metavar="MODEL",
                   help="demo (the local echo plus !clock, !approve, !recall tool demos; "
                        "default), echo (the local echo, no tools), or a provider's model: "
                        "openai:MODEL, anthropic:MODEL (their extras and API keys)")
    p.add_argument("--base-url", metavar="URL",
                   help="with --model openai:MODEL, an OpenAI-compatible server")
    p.add_argument("--model-delay", type=non_negative_float, default=None, metavar="SEC",
                   help="model delay per streamed chunk (default 0.02 for demo, 0 for echo)")
    p.add_argument("--token", default=os.environ.get("TORPOR_TOKEN"),
                   help="bearer token of the chat API (env TORPOR_TOKEN; default: generated)")
    p.add_argument("--admin-token", default=os.environ.get("TORPOR_ADMIN_TOKEN"),
                   help="bearer token of /admin and /metrics (env TORPOR_ADMIN_TOKEN; "
                        "default: generated)")
    p.add_argument("--admin-remote", action="store_true",
                   help="let the admin answer clients that are not on a loopback address")
    p.add_argument("--admin-allow", action="append", metavar="NET",
                   help="let the admin answer clients in this address or network instead of "
                        "loopback ones (repeatable: 10.0.0.0/8, 192.0.2.7)")
    p.add_argument("--trusted-proxy", action="append", metavar="NET",
                   help="a reverse proxy whose X-Forwarded-For gives the admin's client "
                        "address (repeatable; a proxy on this host makes every client "
                        "loopback otherwise)")
    p.add_argument("--log-format", choices=("json", "console"), default="json",
                   help="log lines as JSON (default) or for a console")
    p.add_argument("--log-level", default="info",
                   choices=("debug", "info", "warning", "error", "critical"),
                   help="lowest level logged (default info)")
    p.add_argument("--shutdown-grace", type=non_negative_float, default=10.0, metavar="SEC",
                   help="on SIGTERM, how long in-flight turns may run on (default 10)")
    p.add_argument("--timeout-keep-alive", type=positive_float, default=5.0, metavar="SEC",
                   help="close a connection idle this long after a response (default 5)")
    p.add_argument("--timeout-headers", type=positive_float, default=10.0, metavar="SEC",
                   help="close a connection whose request headers are not complete this long "
                        "after its first byte, or after it opened (default 10)")
    p.add_argument("--timeout-body", type=positive_float, default=30.0, metavar="SEC",
                   help="answer 408 and close when a request body is not complete this long "
                        "after its headers (default 30)")
    p.add_argument("--limit-connections", type=non_negative_int, default=None, metavar="N",
                   help="open connections at most: past it a new one closes the one idle "
                        "longest, and with none idle requests get 503 (default: below the "
                        "open-file limit, ulimit -n; 0: no cap)")
    p.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto",
                   help="event loop: uvloop when installed (auto, the default; the fast "
                        "extra), or asyncio's")
    p.add_argument("--http", choices=("auto", "h11", "httptools"), default="auto",
                   help="HTTP parser: httptools when installed (auto, the default; the fast "
                        "extra), or h11")
    p.add_argument("--hibernate-after", type=positive_float, default=None, metavar="SEC",
                   help="idle seconds before an agent hibernates (default: the runtime's)")
    p.add_argument("--evict-after", type=positive_float, default=None, metavar="SEC",
                   help="idle seconds before an agent is evicted (default: the runtime's)")
    p.add_argument("--node-id", default=None, metavar="ID",
                   help="join a cluster of nodes on the --db PostgreSQL under this node id "
                        "(requests for conversations another node owns are proxied to it: see "
                        "--cluster-routing)")
    p.add_argument("--advertise", default=None, metavar="HOST:PORT",
                   help="with --node-id, the address other nodes send this node's requests to "
                        "(default: the address it listens on)")
    p.add_argument("--lease-ttl", type=positive_float, default=10.0, metavar="SEC",
                   help="with --node-id, seconds a silent node keeps its shards (default 10)")
    p.add_argument("--handoff-deadline", type=non_negative_float, default=30.0, metavar="SEC",
                   help="with --node-id, how long a turn of a shard moving to a node that "
                        "joined may run before it is cut off (default 30; a leave allows "
                        "--shutdown-grace)")
    p.add_argument("--shards", type=int, default=None, metavar="N",
                   help="with --node-id, the cluster's shard count, fixed when the first node "
                        "creates it (default: the cluster's count; 512 for a new cluster)")
    p.add_argument("--ticket-secret", default=os.environ.get("TORPOR_TICKET_SECRET"),
                   metavar="SECRET",
                   help="signs the stream tickets browsers follow a conversation with (at "
                        "least 16 bytes; env TORPOR_TICKET_SECRET; default: random per "
                        "process): every node of a cluster needs the same one")
    p.add_argument("--cluster-routing", choices=("proxy", "redirect"), default="proxy",
                   help="with --node-id, a request for a conversation another node owns is "
                        "proxied to it (default) or answered 421 with its address")
    p.set_defaults(run=run)


def configure_logging(level: str, fmt: str) -> None:
    """``torpor serve`` is an application: its records (torpor's, uvicorn's, the app's) go to
    stderr as JSON lines or console lines at ``level``, each with its request and
    conversation ids (the app taps the store's loggers for its metrics itself)."""
    from torpor.serve.logs import ConsoleFormatter, ContextFilter, JsonFormatter

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else ConsoleFormatter())
    handler.addFilter(ContextFilter())
    numeric = logging.getLevelName(level.upper())
    handler.setLevel(numeric)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)
    for name in ("torpor", "uvicorn", "uvicorn.error"):
        logging.getLogger(name).setLevel(numeric)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
    logging.getLogger("uvicorn.access").disabled = True  # the app logs each request itself
    # Neither format shows where a record was made, nor its thread or process: logging
    # need not look them up for each record (the logging HOWTO's "Optimization").
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    if sys.version_info >= (3, 12):
        logging.logAsyncioTasks = False


def _check_extra() -> None:
    try:
        import httpx  # noqa: F401
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise CliError(f"torpor serve needs the serve extra ({exc.name} is missing): "
                       "pip install 'torpor[serve]'") from None


async def _serve(args: argparse.Namespace, chat_token: str, admin_token: str,
                 generated: list[str]) -> None:
    from torpor.actors.config import AgentConfig
    from torpor.cli.demo_model import DemoModel, demo_tools
    from torpor.llm.echo import EchoModel
    from torpor.runtime import Runtime, RuntimeConfig
    from torpor.serve import AdminClients, Metrics, app, bearer_token, bind, serve
    from torpor.serve.runner import http_protocol

    metrics = Metrics()
    configure_logging(args.log_level, args.log_format)
    if args.model == "demo":
        delay = 0.02 if args.model_delay is None else args.model_delay
        model: Any = DemoModel(delay=delay)
        agent = AgentConfig(system_prompt="You are torpor's demo assistant.", tools=demo_tools())
    elif args.model == "echo":
        model = EchoModel(delay=args.model_delay or 0.0)
        agent = AgentConfig()
    else:
        agent = AgentConfig(system_prompt="You are a helpful assistant.", tools=demo_tools())
        model = build_model(args.model, args.base_url, max_output_tokens=agent.max_output_tokens)
    extra: dict[str, Any] = {}
    if args.hibernate_after is not None:
        extra["hibernate_after"] = args.hibernate_after
    if args.evict_after is not None:
        extra["evict_after"] = args.evict_after
    elif args.hibernate_after is not None:
        extra["evict_after"] = max(args.hibernate_after, RuntimeConfig().evict_after)
    try:
        config = RuntimeConfig(**extra)
    except ConfigError as exc:
        raise CliError(f"--{exc.field.replace('_', '-')}: "
                       f"{str(exc).removeprefix(exc.field + ': ')}") from None
    try:  # refused here with the flag's name, not as app()'s ValueError
        AdminClients(allow=args.admin_allow, trusted_proxies=args.trusted_proxy)
    except ValueError as exc:
        raise CliError(str(exc).replace("admin_allow", "--admin-allow")
                       .replace("trusted_proxies", "--trusted-proxy")) from None
    if args.ticket_secret is not None and len(args.ticket_secret.encode()) < 16:
        raise CliError("--ticket-secret must be at least 16 bytes")
    try:
        sock = bind(args.host, args.port)
    except OSError as exc:
        raise CliError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}",
                       code=1) from None
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}"
    node = _node(args, f"{shown}:{port}")
    try:
        # not wrapped for metrics: the app measures every model call of the runtime itself
        rt = Runtime(args.db, model=model, config=config, agent=agent, node=node)
    except ConfigError as exc:
        sock.close()
        raise CliError(f"--node-id: {str(exc).removeprefix(exc.field + ': ')}") from None
    application = app(rt, authorize=bearer_token(chat_token), admin_token=admin_token,
                      admin_remote=args.admin_remote, admin_allow=args.admin_allow,
                      trusted_proxies=args.trusted_proxy, metrics=metrics,
                      shutdown_grace=args.shutdown_grace, cluster_routing=args.cluster_routing,
                      ticket_secret=args.ticket_secret)
    name = args.model if isinstance(args.model, str) else f"{args.model.provider}:" \
        f"{args.model.model}"
    loop = type(asyncio.get_running_loop()).__module__.partition(".")[0]  # asyncio, uvloop
    parser = "httptools" if "httptools" in http_protocol(args.http).__module__ else "h11"
    lines = [f"torpor serve: listening on {url}/ (store {display_url(args.db)}, model {name}, "
             f"{loop} + {parser})"]
    if node is not None:
        lines.append(f"node {node.node_id} advertised at {node.address}")
    if "chat" in generated:
        lines.append(f"chat token (generated): {chat_token}")
    if "admin" in generated:
        lines.append(f"admin token (generated): {admin_token}")
    lines.append(f"open {url}/#token={chat_token}&admin={admin_token}")
    # Printed once SIGTERM drains (handlers installed): whoever reads it may signal at once.
    await serve(application, sock, grace=args.shutdown_grace,
                ready=lambda: _ready(lines),
                timeout_keep_alive=args.timeout_keep_alive, timeout_headers=args.timeout_headers,
                timeout_body=args.timeout_body, limit_connections=args.limit_connections,
                http=args.http)


def _ready(lines: list[str]) -> None:
    """Serving starts: what exists now (modules, the app, the runtime) lives as long as the
    process. Frozen, the cyclic GC stops walking it at every full collection: ~40 us of
    GC less per HTTP turn (113 -> 73 us, bench/serve.py on uvloop). Collected first: the
    garbage of starting up is freed, not kept for good."""
    gc.collect()
    gc.freeze()
    print("\n".join(lines), flush=True)


def _node(args: argparse.Namespace, listening: str) -> Any:
    """The NodeConfig of ``--node-id`` (None without it)."""
    if args.node_id is None:
        if args.advertise is not None:
            raise CliError("--advertise needs --node-id")
        return None
    from torpor.cluster import NodeConfig

    try:
        return NodeConfig(node_id=args.node_id, address=args.advertise or listening,
                          lease_ttl=args.lease_ttl, shards=args.shards,
                          handoff_deadline=args.handoff_deadline)
    except ConfigError as exc:
        name = {"node_id": "node-id", "address": "advertise"}.get(exc.field, exc.field)
        raise CliError(f"--{name.replace('_', '-')}: "
                       f"{str(exc).removeprefix(exc.field + ': ')}") from None


def run(args: argparse.Namespace) -> int:
    _check_extra()
    if args.base_url is not None and isinstance(args.model, str):
        raise CliError("--base-url needs --model openai:MODEL or anthropic:MODEL")
    if args.port < 0 or args.port > 65535:
        raise CliError(f"--port: must be 0..65535, got {args.port}")
    generated = []
    chat_token = args.token
    if not chat_token:
        chat_token = secrets.token_urlsafe(18)
        generated.append("chat")
    admin_token = args.admin_token
    if not admin_token:
        admin_token = secrets.token_urlsafe(18)
        generated.append("admin")
    if chat_token == admin_token:
        raise CliError("--token and --admin-token must differ")
    from torpor.serve.runner import http_protocol, loop_factory

    try:
        factory = loop_factory(args.loop)
        http_protocol(args.http)  # refused here, before anything starts
    except ConfigError as exc:
        raise CliError(f"--{exc}") from None
    # Not asyncio.run: it takes no loop, and uvicorn's loop= applies only when uvicorn
    # starts the loop itself (Server.run), never to a Server.serve() awaited in ours.
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(_serve(args, chat_token, admin_token, generated))
    print("torpor serve: stopped", file=sys.stderr, flush=True)
    return 0

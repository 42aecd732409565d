"""Start one HTTP server for bench/serve.py: ``torpor serve`` or the minimal app, same way.

``python bench/_serve_launch.py {torpor,minimal,lean} --db FILE --token T [--admin-token A]
[--loop asyncio|uvloop] [--http h11|httptools] [--nodelay shipped|on] [--cprofile FILE]``

Both sides listen on a socket made by ``torpor.serve.bind`` and run uvicorn with the
settings ``torpor.serve.runner.serve`` uses, in this (separate) process; the first line
printed is ``… listening on URL/``. The knobs are applied without editing torpor:

- ``--loop``, ``--http``: the event loop and uvicorn's HTTP parser. ``torpor serve`` is given
  them as its own ``--loop`` and ``--http`` (its default, ``auto``, would pick uvloop and
  httptools whenever they import); the minimal app gets the uvloop event-loop policy before
  ``asyncio.run`` and the parser forced in ``uvicorn.Config``.
- ``--nodelay on``: TCP_NODELAY set on the listening socket (Linux passes it on to every
  accepted socket); ``shipped`` leaves the socket as ``torpor.serve.bind`` makes it.
- ``--cprofile FILE``: cProfile on the event loop's thread, from SIGUSR1 to SIGUSR2 (which
  writes FILE), so start-up and warm-up stay out of the profile (bench/serve_profile.py
  uses it when py-spy is not there).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import signal
import socket
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

# What torpor.serve.runner.serve passes to uvicorn.Config (kept in step by hand; the
# minimal app must be served exactly as torpor is).
UVICORN_SETTINGS: dict[str, Any] = {
    "lifespan": "on", "log_config": None, "access_log": False,
    "timeout_graceful_shutdown": 5, "timeout_keep_alive": 5, "server_header": False,
}


def _force_http(http: str) -> None:
    import uvicorn

    original = uvicorn.Config

    class Config(original):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["http"] = http
            super().__init__(*args, **kwargs)

    uvicorn.Config = Config  # type: ignore[misc]


def _patch_bind(nodelay: str) -> None:
    import torpor.serve
    import torpor.serve.runner

    original = torpor.serve.runner.bind

    def bind(host: str, port: int) -> socket.socket:
        sock = original(host, port)
        if nodelay == "on":
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    torpor.serve.bind = bind
    torpor.serve.runner.bind = bind


def _profiler(target: str) -> None:
    profile = cProfile.Profile()

    def start(signum: int, frame: Any) -> None:
        profile.enable()

    def stop(signum: int, frame: Any) -> None:
        profile.disable()
        profile.dump_stats(target)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)


def _minimal(args: argparse.Namespace) -> None:
    import uvicorn
    from _serve_minimal import minimal_app

    import torpor.serve

    sock = torpor.serve.bind("127.0.0.1", 0)
    host, port = sock.getsockname()[:2]
    application = minimal_app(args.db, args.token, lean=args.app == "lean")
    server = uvicorn.Server(uvicorn.Config(application, **UVICORN_SETTINGS))
    print(f"{args.app} app: listening on http://{host}:{port}/", flush=True)
    asyncio.run(server.serve(sockets=[sock]))


def _torpor(args: argparse.Namespace) -> int:
    from torpor.cli import main

    return main(["serve", "--db", f"sqlite:///{args.db}", "--port", "0", "--model", "echo",
                 "--token", args.token, "--admin-token", args.admin_token,
                 "--log-level", args.log_level, "--loop", args.loop, "--http", args.http])


def cli() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("app", choices=("torpor", "minimal", "lean"))
    parser.add_argument("--db", required=True, help="SQLite file")
    parser.add_argument("--token", required=True)
    parser.add_argument("--admin-token", default="bench-admin")
    parser.add_argument("--log-level", default="info", help="torpor serve's --log-level")
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    parser.add_argument("--http", choices=("h11", "httptools"), default="h11")
    parser.add_argument("--nodelay", choices=("shipped", "on"), default="shipped")
    parser.add_argument("--cprofile", metavar="FILE")
    args = parser.parse_args()
    _patch_bind(args.nodelay)
    if args.cprofile:
        _profiler(args.cprofile)
    if args.app == "torpor":
        return _torpor(args)
    if args.loop == "uvloop":
        import uvloop  # type: ignore[import-not-found,unused-ignore]  # optional

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    _force_http(args.http)
    _minimal(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(cli())

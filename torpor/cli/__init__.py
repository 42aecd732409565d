"""The ``torpor`` command: ``loadtest``, ``chat``, ``inspect``, ``serve``, ``top``,
``purge`` and ``delete``.

Every failure a user can cause ends as one line on stderr and a non-zero exit
(2 for bad arguments, a bad store URL or an unknown conversation; 1 for
anything else), never a traceback. ``TORPOR_DEBUG=1`` shows the traceback of
an unexpected error for a bug report.
"""

from __future__ import annotations

import os
import sqlite3
import sys
from collections.abc import Sequence

from torpor.cli import chat, erase, loadtest, serve, top
from torpor.cli import inspect as inspect_command
from torpor.cli.common import CliError, OneLineParser, configure_logging
from torpor.errors import TorporError, UnknownConversation

__all__ = ["build_parser", "main"]


def build_parser() -> OneLineParser:
    parser = OneLineParser(
        prog="torpor",
        description="torpor: every conversation a long-lived, supervised actor over a log.",
    )
    from torpor import __version__

    parser.add_argument("--version", action="version", version=f"torpor {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="show the runtime's logs on stderr (-vv for debug)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND",
                                       parser_class=OneLineParser)
    subparsers.required = True
    loadtest.add_parser(subparsers)
    chat.add_parser(subparsers)
    inspect_command.add_parser(subparsers)
    serve.add_parser(subparsers)
    top.add_parser(subparsers)
    erase.add_parsers(subparsers)
    return parser


def _fail(message: str, code: int) -> int:
    first_line = message.strip().splitlines()[0] if message.strip() else "failed"
    print(f"torpor: error: {first_line}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script and of ``python -m torpor``; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.verbose)
    try:
        return int(args.run(args))
    except CliError as exc:
        return _fail(str(exc), exc.code)
    except UnknownConversation as exc:
        return _fail(f"unknown conversation: {exc}", 2)
    except KeyboardInterrupt:
        print("torpor: interrupted", file=sys.stderr)
        return 130
    except (TorporError, sqlite3.Error, OSError) as exc:
        if os.environ.get("TORPOR_DEBUG"):
            raise
        return _fail(f"{type(exc).__name__}: {exc}", 1)
    except Exception as exc:  # a bug: still one line, with a way to see more
        if os.environ.get("TORPOR_DEBUG"):
            raise
        return _fail(
            f"unexpected {type(exc).__name__}: {exc} (TORPOR_DEBUG=1 shows the traceback)", 1
        )

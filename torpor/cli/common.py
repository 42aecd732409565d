"""Helpers every subcommand shares: argument types, errors, JSON output, logging, consoles.

A command line is used by people and by scripts; both are served by the same
two rules: a mistake is one line on stderr and exit code 2 (never a
traceback), and ``--json -`` keeps stdout machine-readable by sending
everything meant for people to stderr.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import math
import os
import platform
import re
import sys
from pathlib import Path
from typing import Any, NoReturn

import msgspec
from rich.console import Console

from torpor._logging import ROOT_LOGGER
from torpor.errors import InvalidInput
from torpor.store.url import UnsupportedStoreURL, parse_store_url
from torpor.text import check_id, check_text

__all__ = [
    "DEFAULT_DB",
    "CliError",
    "OneLineParser",
    "configure_logging",
    "consoles",
    "conversation_id",
    "display_url",
    "existing_store_url",
    "machine",
    "non_negative_float",
    "non_negative_int",
    "positive_float",
    "positive_int",
    "ratio",
    "require_postgres_store",
    "sqlite_path",
    "store_url",
    "to_jsonable",
    "unstorable",
    "write_json",
]

DEFAULT_DB = os.environ.get("TORPOR_DB", "sqlite:///torpor.db")
"""Where ``chat`` and ``inspect`` look by default, so one finds what the other wrote."""


class CliError(Exception):
    """A problem the user can fix (a bad argument, a missing conversation): one line, exit 2."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


class OneLineParser(argparse.ArgumentParser):
    """argparse, but an error is a single line: the usage block stays behind ``--help``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# -- argument types ------------------------------------------------------------------


def positive_int(text: str) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value:g}")
    return value


def non_negative_float(text: str) -> float:
    value = _finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value:g}")
    return value


def ratio(text: str) -> float:
    value = _finite(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {value:g}")
    return value


def store_url(text: str) -> str:
    """A store URL the runtime can open; a bare file path is taken as a SQLite file.

    ``postgresql://`` (or ``postgres://``) URLs are passed through as they are;
    they need the ``postgres`` extra, and saying so now beats failing later.
    """
    if "://" not in text:
        text = "sqlite:///" + text  # "x.db" -> sqlite:///x.db, "/a/x.db" -> sqlite:////a/x.db
    try:
        location = parse_store_url(text)
    except UnsupportedStoreURL as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if location.backend == "postgres":
        try:
            importlib.import_module("asyncpg")
        except ImportError:
            raise argparse.ArgumentTypeError(
                f"{display_url(text)} needs asyncpg: pip install 'torpor[postgres]'"
            ) from None
        return text
    if location.path is not None:
        parent = Path(location.path).expanduser().resolve().parent
        if not parent.is_dir():
            raise argparse.ArgumentTypeError(f"{text}: directory {parent} does not exist")
    return text


def display_url(url: str) -> str:
    """The URL without its password: for output, reports and error messages."""
    scheme, sep, rest = url.partition("://")
    credentials, at, host = rest.rpartition("@")
    if not at or ":" not in credentials:
        return url
    return f"{scheme}{sep}{credentials.split(':', 1)[0]}:***@{host}"


def sqlite_path(url: str) -> Path | None:
    """The file a SQLite URL names (None for an in-memory store or another backend)."""
    location = parse_store_url(url)
    return None if location.backend != "sqlite" or location.path is None else Path(location.path)


def existing_store_url(url: str) -> str:
    """For read-only commands: the store must already exist (opening would create it).

    A SQLite file is checked here; a PostgreSQL database once connected
    (:func:`require_postgres_store`), since only the server knows.
    """
    if parse_store_url(url).backend == "postgres":
        return url
    path = sqlite_path(url)
    if path is None:
        raise CliError(f"{url}: an in-memory store is empty; pass --db with a database file")
    if not path.is_file():
        raise CliError(f"{url}: no database at {path}")
    return url


async def require_postgres_store(url: str) -> None:
    """Refuse a PostgreSQL database without torpor's schema (opening would create it)."""
    import asyncpg  # present: store_url checked

    try:
        conn = await asyncpg.connect(url)
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise CliError(f"cannot connect to {display_url(url)}: {exc}", code=1) from None
    try:
        found = await conn.fetchval("SELECT to_regclass('schema_version') IS NOT NULL")
    finally:
        await conn.close()
    if not found:
        raise CliError(f"{display_url(url)}: no torpor store in this database")


# -- text from the terminal ---------------------------------------------------------------


_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")


def unstorable(text: str) -> str | None:
    """Why the log cannot hold ``text`` (None when it can): "is not valid UTF-8 (…)", say.

    Bytes that did not decode reach Python as lone surrogates U+DC80..U+DCFF
    (``surrogateescape``, how argv and a non-UTF-8 stdin arrive): name the byte.
    """
    escaped = _ESCAPED_BYTE.search(text)
    if escaped is not None:
        byte = ord(escaped.group()) - 0xDC00
        return f"is not valid UTF-8 (byte 0x{byte:02x} at index {escaped.start()})"
    try:
        check_text(text, "text")
    except InvalidInput as exc:
        return str(exc).removeprefix("text: ")
    return None


def conversation_id(text: str) -> str:
    """An argument naming a conversation: 1..256 characters the log can hold."""
    reason = unstorable(text)
    if reason is not None:
        raise argparse.ArgumentTypeError(f"conversation id {text!r} {reason}")
    try:
        return check_id(text, "conversation id")
    except InvalidInput as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# -- output ------------------------------------------------------------------------


def consoles(json_target: str | None) -> tuple[Console, Console]:
    """(console for people, console for errors): people's output leaves stdout to JSON."""
    err = Console(stderr=True, highlight=False)
    out = err if json_target == "-" else Console(highlight=False)
    return out, err


def to_jsonable(value: Any) -> Any:
    """msgspec structs, dataclasses and the rest as plain JSON values."""
    return msgspec.to_builtins(value, str_keys=True)


def write_json(target: str, data: Any) -> None:
    """``target`` is a file path, or ``-`` for stdout."""
    text = json.dumps(to_jsonable(data), indent=2, sort_keys=False)
    if target == "-":
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
        return
    try:
        Path(target).write_text(text + "\n", encoding="utf-8")
    except OSError as exc:
        raise CliError(f"cannot write --json {target}: {exc.strerror or exc}") from None


def machine() -> dict[str, Any]:
    """Where figures were measured: they mean little without it."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = None
    return {
        "cores": os.cpu_count(),
        "ram_bytes": ram,
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
    }


def configure_logging(verbose: int) -> None:
    """The command is an application, so it configures logging: one line per record on stderr.

    torpor's own loggers show warnings and up, or more with ``-v``; other
    libraries' loggers (asyncio's, say) warnings and up.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("torpor: %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    logging.getLogger(ROOT_LOGGER).setLevel(logging.WARNING - 10 * min(verbose, 2))

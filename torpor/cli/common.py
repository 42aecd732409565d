"""Helpers every subcommand shares: argument types, errors, JSON output, logging, consoles.

A command line is used by people and by scripts; both are served by the same
two rules: a mistake is one line on stderr and exit code 2 (never a
traceback), and ``--json -`` keeps stdout machine-readable by sending
everything meant for people to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import sys
from pathlib import Path
from typing import Any, NoReturn

import msgspec
from rich.console import Console

from torpor._logging import ROOT_LOGGER
from torpor.store.url import UnsupportedStoreURL, parse_store_url

__all__ = [
    "DEFAULT_DB",
    "CliError",
    "OneLineParser",
    "configure_logging",
    "consoles",
    "existing_store_url",
    "machine",
    "non_negative_float",
    "non_negative_int",
    "positive_float",
    "positive_int",
    "ratio",
    "sqlite_path",
    "store_url",
    "to_jsonable",
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
    """A store URL the runtime can open; a bare file path is taken as a SQLite file."""
    if "://" not in text:
        text = "sqlite:///" + text  # "x.db" -> sqlite:///x.db, "/a/x.db" -> sqlite:////a/x.db
    try:
        location = parse_store_url(text)
    except UnsupportedStoreURL as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if location.path is not None:
        parent = Path(location.path).expanduser().resolve().parent
        if not parent.is_dir():
            raise argparse.ArgumentTypeError(f"{text}: directory {parent} does not exist")
    return text


def sqlite_path(url: str) -> Path | None:
    """The file a SQLite URL names (None for an in-memory store)."""
    path = parse_store_url(url).path
    return None if path is None else Path(path)


def existing_store_url(url: str) -> str:
    """For read-only commands: the database must already exist (opening would create it)."""
    path = sqlite_path(url)
    if path is None:
        raise CliError(f"{url}: an in-memory store is empty; pass --db with a database file")
    if not path.is_file():
        raise CliError(f"{url}: no database at {path}")
    return url


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

"""``torpor purge`` and ``torpor delete``: retention once, and deletes, on a store.

``torpor purge --db URL --older-than 30d`` deletes every conversation with no
activity for that long (``30d``, ``12h``, ``90m``, ``3600s``), in batches of
``RETENTION_BATCH``, audited with ``by="retention"`` as the runtime's sweep does.
``torpor delete --db URL CONVERSATION…`` deletes the ones named (with their
sub-agent conversations); ``--prefix P --yes`` every conversation whose id starts
with ``P`` (``--yes`` is required: a prefix can name many). Audited with
``by="delete"``.

Both work on the store directly, with no runtime: run them against a store no
runtime is serving, or use ``DELETE /v1/conversations/{id}`` / ``rt.delete`` on a
running server, which also stops the conversation's live agent and ends its
followers. Exit code 2 when a named conversation is unknown (the others are still
deleted).

On a cluster's PostgreSQL database both refuse (exit code 2), whether nodes run now
or not: a store without a node's fence writes nothing there (an unfenced delete
behind a node's back would leave the conversation's live agent holding its text, free
to write some of it back). Delete through a node (``DELETE /v1/conversations/{id}``
is proxied to the owner and fenced) and expire with the nodes'
``RuntimeConfig(retention=)``. SQLite cannot tell whether another process serves the
file: that is the operator's to know.
"""

from __future__ import annotations

import argparse
import asyncio
import re
from typing import Any

from torpor.cli.common import (
    DEFAULT_DB,
    CliError,
    conversation_id,
    display_url,
    existing_store_url,
    require_postgres_store,
    store_url,
)
from torpor.runtime.retention import RETENTION_BATCH
from torpor.store import open_store
from torpor.store.prepare import now_ms
from torpor.store.url import parse_store_url

__all__ = ["add_parsers", "duration"]

_DURATION = re.compile(r"([0-9]{1,9})([smhd]?)")
_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_PREFIX_PAGE = 200


def duration(text: str) -> float:
    """``30d``, ``12h``, ``90m``, ``3600s`` (or plain seconds) as seconds."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"must be a duration like 30d, 12h, 90m or 3600s, got {text!r}")
    return float(int(match.group(1)) * _UNIT[match.group(2)])


def add_parsers(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "purge",
        help="delete conversations with no activity for a while (retention, once)",
        description="Delete every conversation whose last activity is older than "
                    "--older-than, audited as retention in the store's deletions table.",
    )
    p.add_argument("--db", type=store_url, default=DEFAULT_DB, metavar="URL",
                   help=f"store URL (default {DEFAULT_DB}; env TORPOR_DB)")
    p.add_argument("--older-than", type=duration, required=True, metavar="DURATION",
                   help="no activity for this long: 30d, 12h, 90m, 3600s")
    p.set_defaults(run=run_purge)

    d = subparsers.add_parser(
        "delete",
        help="delete conversations (and their sub-agent conversations)",
        description="Delete the conversations named, or with --prefix P --yes every "
                    "conversation whose id starts with P; audited in the deletions table.",
    )
    d.add_argument("conversations", nargs="*", type=conversation_id, metavar="CONVERSATION")
    d.add_argument("--db", type=store_url, default=DEFAULT_DB, metavar="URL",
                   help=f"store URL (default {DEFAULT_DB}; env TORPOR_DB)")
    d.add_argument("--prefix", metavar="P", help="every conversation whose id starts with P")
    d.add_argument("--yes", action="store_true", help="confirm a --prefix delete")
    d.set_defaults(run=run_delete)


async def _opened(url: str) -> None:
    existing_store_url(url)
    if parse_store_url(url).backend == "postgres":
        await require_postgres_store(url)
        await _refuse_cluster(url)


async def _refuse_cluster(url: str) -> None:
    """CliError on a cluster's database: a store without a node's fence writes nothing
    there (its writes could not be fenced), so refuse in one clear line up front."""
    import asyncpg  # present: store_url checked

    conn = await asyncpg.connect(url)
    try:
        clustered = await conn.fetchval("SELECT to_regclass('cluster') IS NOT NULL") and (
            await conn.fetchval("SELECT count(*) FROM cluster"))
    finally:
        await conn.close()
    if clustered:
        raise CliError(
            f"{display_url(url)} is a cluster's database: deletes there go through a node, "
            "fenced (DELETE /v1/conversations/{id}, proxied to the owner), and expiry is "
            "the nodes' RuntimeConfig(retention=...)")


async def _purge(url: str, seconds: float) -> int:
    await _opened(url)
    before = max(0, now_ms() - int(seconds * 1000))
    deleted = 0
    async with open_store(url) as store:
        while True:
            found = await store.idle_conversations(before=before, limit=RETENTION_BATCH)
            for name in found:
                if await store.delete(name, by="retention") is not None:
                    deleted += 1
            if len(found) < RETENTION_BATCH:
                return deleted


def run_purge(args: argparse.Namespace) -> int:
    deleted = asyncio.run(_purge(args.db, args.older_than))
    print(f"deleted {deleted} conversation{'s' if deleted != 1 else ''}")
    return 0


async def _delete(url: str, names: list[str], prefix: str | None) -> tuple[int, list[str]]:
    await _opened(url)
    deleted = 0
    unknown: list[str] = []
    async with open_store(url) as store:
        for name in names:
            if await store.delete(name, by="delete") is None:
                unknown.append(name)
            else:
                deleted += 1
        while prefix:  # each page from the top: what was deleted is gone from the index
            page = await store.list_conversations(prefix=prefix, limit=_PREFIX_PAGE)
            for info in page.items:
                if await store.delete(info.id, by="delete") is not None:
                    deleted += 1
            if page.next is None:
                break
    return deleted, unknown


def run_delete(args: argparse.Namespace) -> int:
    if args.prefix is not None and not args.prefix:
        raise CliError("--prefix must not be empty")
    if args.prefix and not args.yes:
        raise CliError(f"--prefix {args.prefix!r} deletes every conversation whose id starts "
                       "with it; add --yes to confirm")
    if not args.conversations and not args.prefix:
        raise CliError("name the conversations to delete, or --prefix P --yes")
    deleted, unknown = asyncio.run(_delete(args.db, args.conversations, args.prefix))
    print(f"deleted {deleted} conversation{'s' if deleted != 1 else ''}")
    if unknown:
        raise CliError("unknown conversation" + ("s" if len(unknown) > 1 else "") + ": "
                       + ", ".join(unknown))
    return 0

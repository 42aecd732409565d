"""``torpor inspect``: what the log holds, read from the store alone (no runtime, no agent woken).

Without a conversation id: every conversation with its head, checkpoint
position, event count and stored size. With one: its derived state, its
checkpoints and their pointer markers, its last events, its model calls, the
share of its prompt tokens the provider read from its prompt cache, and the
anatomy of the most recent call: tokens per context section, events and markers
in context, its topic label (and whether it changed) and its time-sortable turn id;
its derived memory (episodic and semantic items, the ledger, skipped turns); and its
sub-agent tree (the call it answers, its children, recursively).
"""

from __future__ import annotations

import argparse
import asyncio
from datetime import UTC, datetime
from typing import Any

from rich.console import Console
from rich.table import Table

from torpor.actors.revive import restore
from torpor.cli.common import (
    DEFAULT_DB,
    CliError,
    consoles,
    conversation_id,
    display_url,
    existing_store_url,
    non_negative_int,
    positive_int,
    require_postgres_store,
    store_url,
    to_jsonable,
    write_json,
)
from torpor.cli.inspect_memory import memory_json, print_memory
from torpor.cli.render import clip, event_json, event_line
from torpor.compaction.sections import HEAD_ORDER
from torpor.errors import UnknownConversation
from torpor.runtime.spawn import branch_tree
from torpor.store import open_store
from torpor.store.protocol import ConversationInfo, EventStore, ModelCall
from torpor.store.url import parse_store_url

__all__ = ["add_parser", "run"]

_PAGE = 1000
_ALL_CALLS = 10_000_000  # every model call of one conversation, for its cache totals


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "inspect",
        help="read the log: conversations, or one conversation in detail",
        description="Read the store only (no agent is woken): without CONVERSATION, the "
                    "conversations with head, checkpoint, event count and size; with one, its "
                    "checkpoints, markers, last events, model calls and context anatomy.",
    )
    p.add_argument("conversation", nargs="?", type=conversation_id, metavar="CONVERSATION")
    p.add_argument("--db", type=store_url, default=DEFAULT_DB, metavar="URL",
                   help=f"store URL (default {DEFAULT_DB}; env TORPOR_DB)")
    p.add_argument("--json", metavar="FILE", help="write everything as JSON ('-' for stdout)")
    p.add_argument("--limit", type=non_negative_int, default=100, metavar="N",
                   help="conversations listed (default 100; 0 for all)")
    p.add_argument("--events", type=positive_int, default=10, metavar="N",
                   help="last events shown for a conversation (default 10)")
    p.add_argument("--calls", type=positive_int, default=10, metavar="N",
                   help="last model calls shown for a conversation (default 10)")
    p.add_argument("--cluster", action="store_true",
                   help="PostgreSQL: the cluster's nodes and its shard lease table (owner, "
                        "epoch, lease end) instead of conversations")
    p.set_defaults(run=run)


def _when(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S")


# -- the list of conversations ---------------------------------------------------------


async def _listing(store: EventStore, limit: int) -> dict[str, Any]:
    shown: list[ConversationInfo] = []
    total = events = size = 0
    after: str | None = None
    while True:
        page = await store.conversations(after=after, limit=_PAGE)
        for info in page:
            total += 1
            events += info.event_count
            size += info.bytes
            if limit == 0 or len(shown) < limit:
                shown.append(info)
        if len(page) < _PAGE:
            break
        after = page[-1].conversation_id
    return {
        "conversations": total,
        "events": events,
        "bytes": size,
        "shown": [to_jsonable(info) for info in shown],
    }


def _print_listing(console: Console, data: dict[str, Any]) -> None:
    table = Table(title=f"{data['conversations']:,} conversations, {data['events']:,} events, "
                        f"{data['bytes'] / 1e6:,.2f} MB of bodies")
    for name in ("conversation", "head", "checkpoint", "events", "bytes", "updated"):
        table.add_column(name, justify="left" if name == "conversation" else "right")
    for info in data["shown"]:
        table.add_row(
            info["conversation_id"],
            "-" if info["head"] is None else str(info["head"]),
            "-" if info["checkpoint_position"] is None else str(info["checkpoint_position"]),
            f"{info['event_count']:,}",
            f"{info['bytes']:,}",
            _when(info["updated_at"]),
        )
    console.print(table)
    hidden = data["conversations"] - len(data["shown"])
    if hidden > 0:
        console.print(f"… and {hidden:,} more (--limit 0 lists all)")


# -- one conversation ------------------------------------------------------------------


# The order a context is sent in (torpor.compaction.sections): the system prompt, the head
# blocks, the tool specs, the tail (its tool results and its last user message counted
# apart), the recalled section. A call records its sections in another order.
_SEND_ORDER = {name: i for i, name in
               enumerate(("system", *HEAD_ORDER, "tools", "tail", "tool_results", "user",
                          "recalled"))}


def _in_send_order(sections: dict[str, int]) -> dict[str, int]:
    """``sections`` in send order; names not known here last, in their recorded order."""
    return dict(sorted(sections.items(), key=lambda kv: _SEND_ORDER.get(kv[0], len(_SEND_ORDER))))


def _anatomy(call: ModelCall) -> dict[str, Any]:
    return {
        "turn": call.turn,
        "call_index": call.call_index,
        "compaction_cycle": call.compaction_cycle,
        "sections": _in_send_order(call.sections),
        "estimated_prompt_tokens": call.estimated_prompt_tokens,
        "reported_prompt_tokens": call.reported_prompt_tokens,
        "utilization": call.utilization,
        # Annex A.4 of design source 001 (None: a call recorded before torpor kept them)
        "turn_id": call.turn_id or None,
        "events_in_context": call.events_in_context,
        "markers": call.markers,
        "topic": call.topic,
        "topic_changed": call.topic_changed,
        # task-conditioned push: positions in the recalled section and their 0-1 scores
        "pushed": [
            {"position": p, "score": score}
            for p, score in zip(call.pushed, call.pushed_scores, strict=False)
        ],
    }


def _cache(calls: list[ModelCall]) -> dict[str, Any]:
    """The prompt-cache figures of a conversation: of the prompt tokens its providers
    reported, the share read from their caches (calls that report no cache figures
    count as misses; None when no call reported a prompt)."""
    prompt = read = written = reporting = 0
    for call in calls:
        if call.reported_prompt_tokens is None:
            continue
        prompt += call.reported_prompt_tokens
        if call.cache_read_tokens is not None or call.cache_write_tokens is not None:
            reporting += 1
        read += call.cache_read_tokens or 0
        written += call.cache_write_tokens or 0
    return {
        "calls": len(calls),
        "calls_reporting_cache": reporting,
        "prompt_tokens": prompt,
        "cache_read_tokens": read,
        "cache_write_tokens": written,
        "hit_share": read / prompt if prompt else None,
    }


def _call_json(call: ModelCall) -> dict[str, Any]:
    data = to_jsonable(call)
    data.pop("recipe", None)  # bytes that rebuild the context; not for reading
    return dict(data)


async def _detail(store: EventStore, conversation_id: str, events: int,
                  calls: int) -> dict[str, Any]:
    info = await store.conversation(conversation_id)
    if info is None:
        raise UnknownConversation(conversation_id)
    resume = await store.resume(conversation_id)
    restored = restore(resume.events)
    checkpoints = await store.checkpoints(conversation_id)
    last = await store.page_backward(conversation_id, None, events)
    model_calls = await store.model_calls(conversation_id, limit=calls)
    every_call = await store.model_calls(conversation_id, limit=_ALL_CALLS)
    return {
        "conversation": to_jsonable(info),
        "state": {
            "state": str(restored.state),
            "turn": restored.turn,
            "pending_calls": list(restored.pending),
            "parked_cause": restored.parked_cause,
            "unfinished_turn": restored.unfinished,
            "events_since_checkpoint": len(resume.events),
            "tokens_since_checkpoint": sum(e.tokens for e in resume.events),
        },
        "checkpoints": [to_jsonable(c) for c in checkpoints],
        "last_events": [event_json(e) for e in reversed(last)],
        "model_calls": [_call_json(c) for c in model_calls],
        "prompt_cache": _cache(every_call),
        "anatomy": _anatomy(model_calls[-1]) if model_calls else None,
        "memory": await memory_json(store, conversation_id),
        "sub_agents": to_jsonable(await branch_tree(store, conversation_id)),
        "schedules": [to_jsonable(s) for s in await store.conversation_schedules(conversation_id)],
        "_lines": [event_line(e, 90) for e in reversed(last)],
    }


def _print_detail(console: Console, data: dict[str, Any]) -> None:
    info, state = data["conversation"], data["state"]
    head = Table(title=f"conversation {info['conversation_id']}", show_header=False)
    head.add_column("field")
    head.add_column("value")
    for name, value in (
        ("state (from the log)", state["state"]),
        ("pending calls", ", ".join(state["pending_calls"]) or "-"),
        ("parked cause", state["parked_cause"] or "-"),
        ("turn", state["turn"]),
        ("head", info["head"]),
        ("events", f"{info['event_count']:,}"),
        ("stored bytes", f"{info['bytes']:,}"),
        ("checkpoint position", info["checkpoint_position"]),
        ("events / tokens since checkpoint",
         f"{state['events_since_checkpoint']:,} / {state['tokens_since_checkpoint']:,}"),
        ("created / updated", f"{_when(info['created_at'])} / {_when(info['updated_at'])}"),
        ("prompt cache hit share", _cache_line(data["prompt_cache"])),
    ):
        head.add_row(name, "-" if value is None else str(value))
    console.print(head)
    if data["checkpoints"]:
        table = Table(title="checkpoints")
        for name in ("cycle", "covers <", "tokens", "markers"):
            table.add_column(name)
        for c in data["checkpoints"]:
            markers = "; ".join(
                f"{m['start']}-{m['end']}: {', '.join(m['topics'][:4])}" for m in c["markers"]
            )
            table.add_row(str(c["cycle"]), str(c["position"]), str(c["tokens"]),
                          clip(markers or c["summary"] or "-", 80))
        console.print(table)
    if data["schedules"]:
        table = Table(title="schedules")
        for name in ("id", "due", "every", "fired", "text"):
            table.add_column(name)
        for sch in data["schedules"]:
            every = "-" if sch["every"] is None else f"{sch['every']:g} s"
            table.add_row(sch["id"], _when(sch["due"]), every, str(sch["fired"]),
                          clip(sch["text"], 60))
        console.print(table)
    tree = data["sub_agents"]
    if tree["parent"] is not None or tree["children"]:
        console.print("[bold]sub-agent tree[/]")
        for line in _tree_lines(tree):
            console.print(line, markup=False)
    console.print(f"[bold]last {len(data['_lines'])} events[/]")
    for line in data["_lines"]:
        console.print(line, markup=False)
    if data["model_calls"]:
        _print_calls(console, data["model_calls"])
    anatomy = data["anatomy"]
    if anatomy is not None:
        # The title on a line of its own: over a two-column table it would wrap to its width.
        console.print(f"[bold]anatomy of the last call[/] (turn {anatomy['turn']}, "
                      f"{anatomy['utilization']:.1%} of the input budget)")
        table = Table()
        table.add_column("section")
        table.add_column("tokens", justify="right")
        for section, tokens in anatomy["sections"].items():
            table.add_row(section, f"{tokens:,}")
        console.print(table)
        console.print(_anatomy_line(anatomy))
    print_memory(console, data["memory"])


def _print_calls(console: Console, calls: list[dict[str, Any]]) -> None:
    """One row per model call. Headers are one short word each and only the error column
    wraps, so an 80-column terminal shows every header whole (the caption spells them out)."""
    table = Table(title="model calls (most recent last)",
                  caption="prompt: estimated prompt tokens; cached: read from the provider's "
                          "prompt cache; budget: share of the input budget; ms: latency")
    for name in ("turn", "call", "cycle", "prompt", "cached", "budget", "ms"):
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("error", overflow="fold")
    for c in calls:
        latency = c.get("latency_ms")
        cached = c.get("cache_read_tokens")
        purpose = "" if c.get("purpose", "turn") == "turn" else f" {c['purpose']}"
        table.add_row(str(c["turn"]), f"{c['call_index']}{purpose}",
                      str(c["compaction_cycle"]), f"{c['estimated_prompt_tokens']:,}",
                      "-" if cached is None else f"{cached:,}", f"{c['utilization']:.1%}",
                      "-" if latency is None else f"{latency:.1f}", c.get("error") or "")
    console.print(table)


def _tree_lines(tree: dict[str, Any], indent: str = "  ") -> list[str]:
    """The parent link (if any), then the children, indented one level per generation."""
    lines = []
    if tree["parent"] is not None:
        lines.append(f"{indent}answers {tree['parent']} [{tree['call_id']}] ({tree['status']})")
    for child in tree["children"]:
        lines.append(f"{indent}-> {child['conversation_id']} [{child['call_id']}] "
                     f"({child['status']})")
        lines.extend(_tree_lines({**child, "parent": None}, indent + "   "))
    return lines


def _anatomy_line(anatomy: dict[str, Any]) -> str:
    """Events and markers in context, topic and turn id of the last call, on one line."""
    def known(value: object) -> str:
        return "-" if value is None else str(value)

    topic = anatomy["topic"]
    changed = anatomy["topic_changed"]
    if topic is None:
        topic_text = "-" if changed is None else "(none)"
    else:
        topic_text = topic + (" (changed)" if changed else "")
    return (
        f"in context: {known(anatomy['events_in_context'])} events, "
        f"{known(anatomy['markers'])} markers; topic: {topic_text}; "
        f"turn id: {known(anatomy['turn_id'])}"
        + (
            "; pushed: " + ", ".join(f"#{p['position']} ({p['score']:.2f})"
                                     for p in anatomy["pushed"])
            if anatomy.get("pushed") else ""
        )
    )


def _cache_line(cache: dict[str, Any]) -> str:
    share = cache["hit_share"]
    if share is None:
        return "- (no model call reported its prompt size)"
    if not cache["calls_reporting_cache"]:
        return "- (the model reported no cache figures)"
    return (f"{share:.1%} ({cache['cache_read_tokens']:,} of {cache['prompt_tokens']:,} "
            f"prompt tokens read from cache, {cache['cache_write_tokens']:,} written; "
            f"{cache['calls']:,} calls)")


async def _cluster(url: str) -> dict[str, Any]:
    import asyncpg  # present: a postgres URL was accepted

    from torpor.cluster.table import read_table

    conn = await asyncpg.connect(url)
    try:
        if not await conn.fetchval("SELECT to_regclass('shard_leases') IS NOT NULL"):
            return {"members": (), "leases": ()}  # a store from before clusters: none joined
        members, leases = await read_table(conn)
    finally:
        await conn.close()
    return {"members": members, "leases": leases}


def _print_cluster(console: Console, data: dict[str, Any]) -> None:
    members = Table(title="nodes", title_justify="left")
    for name in ("node", "incarnation", "address", "lease until (UTC)", "live", "shards"):
        members.add_column(name)
    held: dict[tuple[str | None, int | None], int] = {}
    for lease in data["leases"]:
        if lease.live:
            key = (lease.owner, lease.owner_incarnation)
            held[key] = held.get(key, 0) + 1
    for m in data["members"]:
        members.add_row(m.node_id, str(m.incarnation), m.address,
                        m.lease_until.strftime("%H:%M:%S.%f")[:-3], "yes" if m.live else "no",
                        str(held.get((m.node_id, m.incarnation), 0)))
    console.print(members)
    table = Table(title="shard leases", title_justify="left")
    for name in ("shard", "owner", "incarnation", "epoch", "lease until (UTC)", "live"):
        table.add_column(name)
    for lease in data["leases"]:
        until = lease.lease_until.strftime("%H:%M:%S.%f")[:-3] if lease.lease_until else "-"
        table.add_row(str(lease.shard), lease.owner or "-",
                      "-" if lease.owner_incarnation is None else str(lease.owner_incarnation),
                      str(lease.epoch), until, "yes" if lease.live else "no")
    console.print(table)
    if not data["leases"]:
        console.print("no node has joined a cluster on this database")


async def _inspect(args: argparse.Namespace) -> dict[str, Any]:
    if parse_store_url(args.db).backend == "postgres":
        await require_postgres_store(args.db)
        if args.cluster:
            return await _cluster(args.db)
    async with open_store(args.db) as store:
        if args.conversation is None:
            return await _listing(store, args.limit)
        return await _detail(store, args.conversation, args.events, args.calls)


def run(args: argparse.Namespace) -> int:
    if args.cluster and parse_store_url(args.db).backend != "postgres":
        raise CliError("--cluster: a cluster of nodes lives on a postgresql:// store")
    if args.cluster and args.conversation is not None:
        raise CliError("--cluster lists the lease table; leave out CONVERSATION")
    existing_store_url(args.db)
    out, _ = consoles(args.json)
    data = asyncio.run(_inspect(args))
    if args.cluster:
        _print_cluster(out, data)
    elif args.conversation is None:
        _print_listing(out, data)
    else:
        _print_detail(out, data)
    if args.json:
        data.pop("_lines", None)
        write_json(args.json, {"command": "inspect", "db": display_url(args.db), **data})
    return 0

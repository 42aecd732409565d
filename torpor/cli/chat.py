"""``torpor chat``: a terminal chat with one conversation's agent.

Lines come from stdin, so the same loop serves a person at a terminal and a
script feeding a pipe. Replies stream as they are generated; tool calls,
their results and suspensions are shown as they are logged; a suspension
asks the person for the answer and resolves the call with it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any, TextIO

from rich.console import Console
from rich.table import Table

from torpor.actors.config import AgentConfig
from torpor.actors.turn import Turn
from torpor.cli.common import (
    DEFAULT_DB,
    CliError,
    conversation_id,
    display_url,
    non_negative_float,
    store_url,
    unstorable,
)
from torpor.cli.demo_model import DEMO_HELP, DemoModel, demo_tools
from torpor.cli.models import build_model, model_spec
from torpor.cli.render import body_text, call_text, clip, event_line
from torpor.errors import TorporError, TurnAborted, UnknownConversation
from torpor.events import Aborted, AssistantMessage, Event, Suspended, ToolCall, ToolResult
from torpor.llm.protocol import Model, TextDelta
from torpor.runtime import Runtime

__all__ = ["add_parser", "run"]

HELP = (
    "commands: /history [N], /recall QUERY, /inspect, /help, /quit. "
    f"Tool demos: {DEMO_HELP}."
)


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "chat",
        help="chat with one conversation's agent (deterministic model, or --model)",
        description="An interactive chat over stdin/stdout, with the local deterministic "
                    "model unless --model names a provider's. " + HELP,
    )
    p.add_argument("--db", type=store_url, default=DEFAULT_DB, metavar="URL",
                   help=f"store URL (default {DEFAULT_DB}; env TORPOR_DB)")
    p.add_argument("--conversation", "-c", type=conversation_id, default="chat", metavar="ID",
                   help="conversation id (default 'chat'); an existing one is continued")
    p.add_argument("--delay", type=non_negative_float, default=None, metavar="SEC",
                   help="model delay per streamed chunk (default 0.02 on a terminal, else 0)")
    p.add_argument("--model", "-m", type=model_spec, default=None, metavar="PROVIDER:MODEL",
                   help="openai:MODEL or anthropic:MODEL (keys from OPENAI_API_KEY / "
                        "ANTHROPIC_API_KEY); default: the local deterministic model")
    p.add_argument("--base-url", default=None, metavar="URL",
                   help="the provider's base URL, e.g. a local OpenAI-compatible server "
                        "(http://127.0.0.1:11434/v1 for Ollama); no key needed then")
    p.set_defaults(run=run)


@dataclass(frozen=True, slots=True)
class Refused:
    """An input line the log cannot hold: reported, never sent, and reading goes on."""

    number: int
    reason: str  # "is not valid UTF-8 (byte 0xff at offset 3)", "contains NUL at …"


def decode_line(raw: bytes, number: int, encoding: str) -> str | Refused:
    """One line of input as text, or why it is refused (bytes that don't decode, NUL, …)."""
    try:
        line = raw.decode(encoding).rstrip("\r\n")
    except UnicodeDecodeError as exc:
        return Refused(number, f"is not valid {exc.encoding.upper()} (byte 0x{raw[exc.start]:02x} "
                               f"at offset {exc.start})")
    reason = unstorable(line)
    return line if reason is None else Refused(number, reason)


class LineReader:
    """stdin lines for the event loop, read on a daemon thread so exit never waits for it.

    Bytes are read and decoded here, line by line, so one line that does not
    decode is refused on its own instead of ending the input.
    """

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._queue: asyncio.Queue[str | Refused | None] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._ended = False
        threading.Thread(target=self._pump, name="torpor-chat-stdin", daemon=True).start()

    def _items(self) -> Iterator[str | Refused]:
        buffer: IO[bytes] | None = getattr(self._stream, "buffer", None)
        if buffer is None:  # a text stream with no bytes underneath (embedding, tests)
            for number, line in enumerate(self._stream, 1):
                text = line.rstrip("\r\n")
                reason = unstorable(text)
                yield text if reason is None else Refused(number, reason)
            return
        encoding = getattr(self._stream, "encoding", None) or "utf-8"
        for number, raw in enumerate(buffer, 1):
            yield decode_line(raw, number, encoding)

    def _pump(self) -> None:
        put = self._queue.put_nowait
        try:
            for item in self._items():
                self._loop.call_soon_threadsafe(put, item)
        except (OSError, ValueError):  # stdin closed under us: the input ends
            pass
        finally:
            with contextlib.suppress(RuntimeError):  # the loop may have closed already
                self._loop.call_soon_threadsafe(put, None)

    async def read(self) -> str | Refused | None:
        """The next line (or its refusal), or None at (and after) the end of input."""
        if self._ended:
            return None
        line = await self._queue.get()
        self._ended = line is None
        return line


class Chat:
    def __init__(self, rt: Runtime, conversation: str, reader: LineReader, console: Console,
                 interactive: bool) -> None:
        self.rt = rt
        self.conversation = conversation
        self.reader = reader
        self.console = console
        self.interactive = interactive

    def write(self, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    async def ask(self, prompt: str) -> str | None:
        """The next line the log can hold; a refused one is reported and the prompt repeated."""
        while True:
            if self.interactive:
                self.write(prompt)
            line = await self.reader.read()
            if not isinstance(line, Refused):
                return line
            self.write(f"[refused input line {line.number}: it {line.reason}; nothing was sent]\n")

    # -- turns ----------------------------------------------------------------------
    async def follow(self, turn: Turn) -> None:
        """Print a turn as it happens; answer suspensions from the input."""
        streaming = False
        logged_abort = False
        try:
            async for item in turn:
                if isinstance(item, TextDelta):
                    if not streaming:
                        self.write("torpor> ")
                        streaming = True
                    self.write(item.text)
                    continue
                if streaming:
                    self.write("\n")
                    streaming = False
                self.show(item)
                logged_abort = logged_abort or isinstance(item.body, Aborted)
                if isinstance(item.body, Suspended):
                    resumed = await self.answer(item.body.call_ids)
                    if resumed is None:
                        return
                    if resumed is not turn:  # revived meanwhile: a new handle carries the rest
                        await self.follow(resumed)
                        return
        except TurnAborted as exc:
            if streaming:
                self.write("\n")
            if not logged_abort:  # the logged Aborted was shown already: once is enough
                self.write(f"[turn aborted: {exc}]\n")

    def show(self, event: Event) -> None:
        """One logged event of a turn, as a bracketed line (the final answer was streamed)."""
        body = event.body
        if isinstance(body, AssistantMessage):
            for call in body.tool_calls:
                self.write(f"  [tool call] {call_text(call)} (id {call.id})\n")
        elif isinstance(body, ToolResult):
            self.write(f"  [tool result] {clip(body_text(body), 160)}\n")
        elif isinstance(body, Suspended):
            self.write(f"  [suspended] waiting for {', '.join(body.call_ids)}\n")
        elif isinstance(body, Aborted):
            self.write(f"  [aborted] {body_text(body)}\n")

    async def answer(self, call_ids: tuple[str, ...]) -> Turn | None:
        """Ask for each outside answer and resolve it; the resumed turn, None on end of input."""
        calls = await self._calls(call_ids)
        resumed: Turn | None = None
        for call_id in call_ids:
            call = calls.get(call_id)
            what = call_text(call) if call is not None else call_id
            answer = await self.ask(f"  answer for {what}: ")
            if answer is None:
                self.write("\n[end of input: the call stays suspended; run chat again to answer]\n")
                return None
            resumed = await self.rt.resolve(self.conversation, call_id, answer or "(no answer)")
        return resumed

    async def _calls(self, call_ids: tuple[str, ...]) -> dict[str, ToolCall]:
        found: dict[str, ToolCall] = {}
        for event in await self.rt.history(self.conversation, limit=50):
            body = event.body
            if isinstance(body, AssistantMessage):
                for call in body.tool_calls:
                    if call.id in call_ids:
                        found[call.id] = call
        return found

    async def resume_suspension(self) -> None:
        """A conversation left suspended (an earlier session) asks for its answers first."""
        try:
            info = await self.rt.admin.inspect(self.conversation)
        except UnknownConversation:
            return
        if info.pending_calls:
            self.write(f"[suspended] this conversation waits for {', '.join(info.pending_calls)}\n")
            resumed = await self.answer(info.pending_calls)
            if resumed is not None:
                await self.follow(resumed)

    # -- commands ---------------------------------------------------------------------
    async def command(self, line: str) -> bool:
        """Run a /command; False means quit."""
        name, _, rest = line.partition(" ")
        rest = rest.strip()
        if name in ("/quit", "/exit", "/q"):
            return False
        if name == "/help":
            self.write(HELP + "\n")
        elif name == "/history":
            limit = int(rest) if rest.isdigit() and int(rest) > 0 else 20
            events = await self.rt.history(self.conversation, limit=limit)
            if not events:
                self.write("(no events yet)\n")
            for event in reversed(events):
                self.write(event_line(event, 100) + "\n")
        elif name == "/recall":
            if not rest:
                self.write("usage: /recall QUERY\n")
                return True
            hits = await self.rt.recall(self.conversation, rest, 5)
            if not hits:
                self.write("(no match)\n")
            for hit in hits:
                self.write(f"#{hit.position:<5} {hit.kind:<11} score {hit.score:6.2f}  "
                           f"{clip(hit.snippet, 90)}\n")
        elif name == "/inspect":
            await self.inspect()
        else:
            self.write(f"unknown command {name}; {HELP}\n")
        return True

    async def inspect(self) -> None:
        try:
            info = await self.rt.admin.inspect(self.conversation)
        except UnknownConversation:
            self.write("(no events yet)\n")
            return
        table = Table(title=f"agent {self.conversation}", show_header=False)
        table.add_column("field")
        table.add_column("value")
        for field in info.__struct_fields__:
            table.add_row(field, str(getattr(info, field)))
        self.console.print(table)

    async def loop(self) -> None:
        await self.resume_suspension()
        while True:
            line = await self.ask("you> ")
            if line is None:
                if self.interactive:
                    self.write("\n")
                return
            line = line.strip()
            if not line:
                continue
            if line.startswith("/"):
                if not await self.command(line):
                    return
                continue
            try:
                turn = await self.rt.send(self.conversation, line)
            except TorporError as exc:
                self.write(f"[not sent: {exc}]\n")
                continue
            await self.follow(turn)


async def _chat(args: argparse.Namespace, console: Console) -> None:
    interactive = sys.stdin.isatty()
    delay = args.delay if args.delay is not None else (0.02 if interactive else 0.0)
    agent = AgentConfig(
        system_prompt="You are torpor's demo assistant.", tools=demo_tools()
    )
    if args.model is None:
        if args.base_url is not None:
            raise CliError("--base-url needs --model openai:MODEL or anthropic:MODEL")
        model: Model = DemoModel(delay=delay)
    else:
        model = build_model(args.model, args.base_url, max_output_tokens=agent.max_output_tokens)
    async with Runtime(args.db, model=model, agent=agent) as rt:
        reader = LineReader(sys.stdin)
        chat = Chat(rt, args.conversation, reader, console, interactive)
        if interactive:
            existing = await rt.store.conversation(args.conversation)
            count = existing.event_count if existing is not None else 0
            console.print(f"conversation [bold]{args.conversation}[/] on {display_url(args.db)} "
                          f"({count} events so far) with {model.name}. {HELP}")
        await chat.loop()


def run(args: argparse.Namespace) -> int:
    # Replies echo what the model wrote: a terminal that cannot show a character gets an
    # escape for it, not a UnicodeEncodeError that ends the chat.
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="backslashreplace")
    asyncio.run(_chat(args, Console(highlight=False)))
    return 0

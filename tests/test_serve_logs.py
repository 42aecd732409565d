"""Log records of the HTTP face (issue 20, item 8): whole event names, and a client that
leaves mid-body is no error.

JSON lines used to cut the event at its first space: ``owner not reachable``, ``owner did
not answer`` and ``owner stream cut`` all read ``owner``. Events are snake_case names now,
and the formatter takes the event the logger was called with, never a cut of the message.
"""

from __future__ import annotations

import ast
import asyncio
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from serve_support import TOKEN, served

from torpor import Runtime
from torpor._logging import get_logger
from torpor.serve.logs import ConsoleFormatter, JsonFormatter

ROOT = Path(__file__).resolve().parents[1]
_LEVELS = {"debug", "info", "warning", "error", "exception", "critical"}


class Capture(logging.Handler):
    """Every record from the root down (torpor's, uvicorn's), as ``torpor serve`` sees them."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.requests = asyncio.Event()  # the app logged the end of a request

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        if record.name == "torpor.serve" and record.getMessage().startswith("request "):
            self.requests.set()


@pytest.fixture
def capture() -> Iterator[Capture]:
    handler = Capture()
    root = logging.getLogger()
    saved = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(saved)


def test_the_json_line_holds_the_whole_event_with_its_values(capture: Capture) -> None:
    log = get_logger("torpor.serve")
    log.warning("owner_unreachable", owner="127.0.0.1:9", error="ConnectError('refused')")
    log.warning("an event a host wrote in prose", key="x=y z")  # whole, whatever it holds
    first, second = (json.loads(JsonFormatter().format(r)) for r in capture.records[-2:])
    assert first["event"] == "owner_unreachable" and first["owner"] == "127.0.0.1:9"
    assert first["level"] == "warning" and first["logger"] == "torpor.serve"
    assert second["event"] == "an event a host wrote in prose" and second["key"] == "x=y z"
    # The console line still reads event key=value…; the private attribute is no value.
    line = ConsoleFormatter().format(capture.records[-2])
    assert "owner_unreachable owner='127.0.0.1:9'" in line
    assert "_torpor_event" not in json.dumps(first) and "_torpor_event" not in line


def test_every_event_torpor_logs_is_a_snake_case_name() -> None:
    """A log call's event is a name a query can match (``event == "owner_no_answer"``)."""
    offenders = []
    for path in sorted((ROOT / "torpor").rglob("*.py")):
        if path.name == "_logging.py":
            continue  # its fallback record names the dropped one
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in _LEVELS:
                event = node.args[0] if node.args else None
            elif name == "_log" and len(node.args) >= 3:  # the supervisor's helper
                event = node.args[2]
            else:
                continue
            if (isinstance(event, ast.Constant) and isinstance(event.value, str)
                    and not re.fullmatch(r"[a-z][a-z0-9_]*", event.value)):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {event.value!r}")
    assert offenders == []


async def test_a_client_that_leaves_mid_body_is_not_an_error(capture: Capture) -> None:
    async with Runtime("sqlite://") as rt, served(rt) as (url, _client, _app):
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/conversations/c/messages HTTP/1.1\r\n"
            b"Host: " + host.encode() + b"\r\n"
            b"Authorization: Bearer " + TOKEN.encode() + b"\r\n"
            b"Content-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n"
            b'{"text": "'  # 10 of the 1000 bytes promised
        )
        await writer.drain()
        writer.close()  # gone before the body is complete
        await writer.wait_closed()
        with anyio.fail_after(10):
            await capture.requests.wait()  # the app is done with it
        assert await rt.store.head("c") is None  # nothing was sent
    errors = [f"{r.name}: {r.getMessage()}" for r in capture.records
              if r.levelno >= logging.ERROR]
    assert errors == []
    assert not [r for r in capture.records if r.exc_info], "no traceback for a client leaving"
    left = [r for r in capture.records if getattr(r, "_torpor_event", "") == "client_left"]
    assert left and left[0].levelno == logging.INFO
    assert left[0].path == "/v1/conversations/c/messages"  # type: ignore[attr-defined]
    del reader


async def test_monitoring_requests_log_at_debug_chat_requests_at_info(capture: Capture) -> None:
    """Health checks, scrapes and admin polling drowned the info log (722 of 811 lines)."""
    from serve_support import ADMIN

    from torpor.serve.client import Client

    async with Runtime("sqlite://") as rt, served(rt) as (url, client, _app):
        admin = Client(url, ADMIN)
        await admin.call("GET", "/healthz")
        for path in ("/metrics", "/admin/stats", "/admin/agents"):
            conn, response = await admin.open("GET", path, conn=admin.connection())
            await response.read()
            await conn.close()
        await client.call("POST", "/v1/conversations/c/messages", json_body={"text": "hi"},
                          headers={"Accept": "application/json"}, expect=(202,))
        await client.call("GET", "/v1/conversations/c/history")
    levels = {r.path: r.levelno for r in capture.records  # type: ignore[attr-defined]
              if getattr(r, "_torpor_event", "") == "request"}
    assert levels == {
        "/healthz": logging.DEBUG, "/metrics": logging.DEBUG, "/admin/stats": logging.DEBUG,
        "/admin/agents": logging.DEBUG, "/v1/conversations/c/messages": logging.INFO,
        "/v1/conversations/c/history": logging.INFO,
    }

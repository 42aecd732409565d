"""`torpor serve`, `torpor top` and `torpor loadtest --url` as real processes on loopback."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from torpor.serve.client import Client

TOKEN = "cli-chat-token"
ADMIN = "cli-admin-token"


@dataclass
class Served:
    process: subprocess.Popen[str]
    url: str
    stdout: list[str]


def start_server(tmp: Path, *extra: str) -> Served:
    env = {**os.environ, "TORPOR_TOKEN": "", "TORPOR_ADMIN_TOKEN": ""}
    process = subprocess.Popen(
        [sys.executable, "-m", "torpor", "serve", "--db", str(tmp / "serve.db"), "--port", "0",
         *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    assert process.stdout is not None
    lines = []
    while True:
        line = process.stdout.readline()
        if not line:
            raise AssertionError(f"torpor serve exited: {process.wait()} "
                                 f"{process.stderr.read() if process.stderr else ''}")
        lines.append(line)
        if line.startswith("open http://"):
            break
    url = lines[0].split("listening on ", 1)[1].split("/ ", 1)[0]
    return Served(process, url, lines)


def stop(served: Served) -> tuple[int, str]:
    if served.process.poll() is None:
        served.process.send_signal(signal.SIGTERM)
    _, err = served.process.communicate(timeout=30)
    return served.process.returncode, err


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    served = start_server(tmp_path_factory.mktemp("serve"), "--token", TOKEN,
                          "--admin-token", ADMIN, "--model", "echo")
    yield served
    stop(served)


async def test_serve_streams_and_logs_json_with_ids(tmp_path: Path) -> None:
    served = start_server(tmp_path, "--token", TOKEN, "--admin-token", ADMIN, "--model", "demo",
                          "--model-delay", "0", "--log-level", "info")
    client = Client(served.url, TOKEN)
    conn, response = await client.open(
        "POST", "/v1/conversations/logged/messages", json_body={"text": "hello"},
        headers={"X-Request-ID": "req-42"}, conn=client.connection())
    events = [e async for e in response.events()]
    await conn.close()
    assert events[-1].json()["body"]["text"] == "echo: hello"
    conn, html = await client.open("GET", "/")
    body = (await html.read()).decode()
    await conn.close()
    assert "<title>torpor</title>" in body
    code, err = stop(served)
    assert code == 0
    records = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    request = [r for r in records if r.get("event") == "request"
               and r.get("path") == "/v1/conversations/logged/messages"]
    assert request and request[0]["request_id"] == "req-42"
    assert request[0]["conversation_id"] == "logged" and request[0]["status"] == 200


def test_serving_begins_with_the_startup_heap_frozen(capsys: pytest.CaptureFixture[str]) -> None:
    """What exists when serving starts lives as long as the process: the cyclic GC need not
    walk it again at every full collection (gc.freeze)."""
    from torpor.cli.serve import _ready

    assert gc.get_freeze_count() == 0
    try:
        _ready(["torpor serve: listening on http://127.0.0.1:1/"])
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    assert capsys.readouterr().out == "torpor serve: listening on http://127.0.0.1:1/\n"


def test_serve_generates_and_prints_tokens(tmp_path: Path) -> None:
    served = start_server(tmp_path)
    text = "".join(served.stdout)
    assert "chat token (generated): " in text and "admin token (generated): " in text
    assert f"open {served.url}/#token=" in text
    code, _ = stop(served)
    assert code == 0


async def test_sigterm_ends_a_streaming_turn_with_the_logged_abort(tmp_path: Path) -> None:
    served = start_server(tmp_path, "--token", TOKEN, "--admin-token", ADMIN, "--model", "demo",
                          "--model-delay", "0.5", "--shutdown-grace", "0")
    client = Client(served.url, TOKEN)
    conn, response = await client.open(
        "POST", "/v1/conversations/t/messages", json_body={"text": "a long answer please"},
        conn=client.connection())
    events = []
    async for event in response.events():
        events.append(event)
        if event.event == "delta":
            served.process.send_signal(signal.SIGTERM)  # mid-stream
    await conn.close()
    assert events[-1].event == "aborted"
    assert events[-1].json()["body"]["reason"] == "shutdown"
    code, _ = await asyncio.to_thread(stop, served)
    assert code == 0
    restarted = start_server(tmp_path, "--token", TOKEN, "--admin-token", ADMIN)
    history = await Client(restarted.url, TOKEN).call("GET", "/v1/conversations/t/history")
    stop(restarted)
    assert history["events"][0]["kind"] == "aborted"  # the log holds it too


async def test_top_shows_the_agents_of_a_running_server(server: Served) -> None:
    top = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "torpor", "top", "--url", server.url, "--admin-token", ADMIN,
        "--interval", "0.3", "--frames", "400",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    assert top.stdout is not None
    client = Client(server.url, TOKEN)

    async def next_frame() -> str:
        lines = []
        while True:
            line = (await top.stdout.readline()).decode()  # type: ignore[union-attr]
            assert line, "top exited early"
            if line.startswith("-- frame"):
                return "".join(lines)
            lines.append(line)

    try:
        async with asyncio.timeout(60):
            await next_frame()  # top is up (and watching) before anything happens
            await client.call("POST", "/v1/conversations/top-1/messages",
                              json_body={"text": "hi"}, headers={"Accept": "application/json"},
                              expect=(202,))
            while "top-1" not in (seen := await next_frame()):
                pass
    finally:
        if top.returncode is None:
            top.send_signal(signal.SIGINT)
    assert await top.wait() == 0
    assert "agents per state" in seen and "turns/s" in seen and "RSS" in seen
    assert "busiest" in seen and "parked" in seen


def test_top_refuses_a_wrong_token(server: Served) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "torpor", "top", "--url", server.url, "--admin-token", "nope",
         "--frames", "1"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "401" in result.stderr


def test_loadtest_over_http_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    served = start_server(tmp_path, "--token", TOKEN, "--admin-token", ADMIN, "--model", "demo",
                          "--model-delay", "0.005", "--log-level", "warning")
    try:
        result = subprocess.run(
            [sys.executable, "-m", "torpor", "loadtest", "--url", served.url, "--token", TOKEN,
             "--admin-token", ADMIN, "--agents", "40", "--active-ratio", "0.5", "--duration",
             "1.5", "--wake-rate", "4", "--reconnect-ratio", "0.5", "--json", "-"],
            capture_output=True, text=True, timeout=120)
    finally:
        stop(served)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    reconnects = report["reconnects"]
    assert reconnects["reconnects"] > 0
    assert reconnects["reconnects_that_lost_or_duplicated_text"] == 0
    assert reconnects["lost"] == reconnects["duplicated"] == reconnects["position_gaps"] == 0
    assert report["run"]["turns"] > 0 and report["activation"]["errors"] == 0
    assert report["timeline"] and report["lifecycle"]["activations"] >= 40
    assert [p["name"] for p in report["phases"]] == ["activate", "run"]
    assert report["timed_out"] is False and all(p["completed"] for p in report["phases"])


def test_loadtest_over_http_within_its_timeout(server: Served) -> None:
    """Cut by --timeout, the HTTP clients are cancelled and close: the command ends, exit 1,
    its report marked timed out with the phases it ran (a 2-minute run, a 2 s bound)."""
    result = subprocess.run(
        [sys.executable, "-m", "torpor", "loadtest", "--url", server.url, "--token", TOKEN,
         "--agents", "20", "--active-ratio", "0.5", "--duration", "120", "--timeout", "2",
         "--json", "-"],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert report["timed_out"] is True and report["config"]["timeout"] == 2
    phases = report["phases"]
    assert [p["name"] for p in phases][-1] in ("activate", "run") and not phases[-1]["completed"]
    assert all(p["completed"] for p in phases[:-1])
    assert "timed out after 2 s" in " ".join(result.stderr.split())

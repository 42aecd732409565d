"""A real EventSource client, the npm ``eventsource`` package on Node, follows a conversation
through a dropped connection: it reconnects by itself with ``Last-Event-ID`` and the
answer arrives whole, no character twice. Installed into the test's own folder; the
test skips, saying why, without node and npm or when npm cannot install it."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import anyio
import pytest
from cut_proxy import CutProxy
from serve_support import ADMIN, TOKEN, serving

from torpor import Runtime, ScriptedModel
from torpor.llm.scripted import Signal, Text, Wait
from torpor.serve import app, bearer_token
from torpor.serve.client import Client

PACKAGE = "eventsource@4"  # 4.x runs on Node 20 (5.x wants Node 22)
FIRST, SECOND = "The first half, ", "and the second half."

FOLLOW = """
import { EventSource } from "eventsource";
const [url, token] = process.argv.slice(2);
const out = (o) => process.stdout.write(JSON.stringify(o) + "\\n");
const es = new EventSource(url, {
  fetch: (input, init) =>
    fetch(input, { ...init, headers: { ...init.headers, Authorization: `Bearer ${token}` } }),
});
es.onopen = () => out({ type: "open" });
es.onerror = () => out({ type: "error" });
for (const name of ["user", "delta", "assistant", "aborted", "error"]) {
  es.addEventListener(name, (e) => {
    if (e.data === undefined) return;  // the connection's error, not an event named error
    out({ type: name, id: e.lastEventId, data: JSON.parse(e.data) });
    if (name === "assistant") { es.close(); process.exit(0); }
  });
}
"""


@pytest.fixture(scope="module")
def follow_script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node and npm are needed for the npm eventsource client")
    folder = tmp_path_factory.mktemp("eventsource-npm")
    try:
        done = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--silent", PACKAGE],
                              cwd=folder, capture_output=True, text=True, timeout=180)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"npm could not install {PACKAGE}: {exc!r}")
    if done.returncode != 0 or not (folder / "node_modules" / "eventsource").is_dir():
        pytest.skip(f"npm could not install {PACKAGE}: {(done.stderr or done.stdout)[-300:]}")
    script = folder / "follow.mjs"
    script.write_text(FOLLOW)
    return script


def header(head: bytes, name: bytes) -> bytes | None:
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip()
    return None


async def test_the_npm_eventsource_client_resumes_with_last_event_id(follow_script: Path) -> None:
    halfway, go = anyio.Event(), anyio.Event()
    model = ScriptedModel([[Text(FIRST), Signal(halfway), Wait(go), Text(SECOND)]])
    async with Runtime("sqlite://", model=model) as rt:
        application = app(rt, authorize=bearer_token(TOKEN), admin_token=ADMIN)
        async with serving(application) as url, CutProxy(url) as proxy:
            node = await asyncio.create_subprocess_exec(
                "node", str(follow_script), f"{proxy.url}/v1/conversations/n/stream", TOKEN,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                cwd=follow_script.parent)
            seen: list[dict[str, Any]] = []

            async def until(kind: str, text: str | None = None) -> dict[str, Any]:
                assert node.stdout is not None
                while line := await node.stdout.readline():
                    seen.append(json.loads(line))
                    got = seen[-1]
                    if got["type"] == kind and (text is None or got["data"]["text"] == text):
                        return got
                stderr = await node.stderr.read() if node.stderr else b""
                raise AssertionError(f"node ended before {kind}: {seen} {stderr[-500:]!r}")

            try:
                with anyio.fail_after(60):
                    await until("open")
                    await Client(url, TOKEN).call(
                        "POST", "/v1/conversations/n/messages", json_body={"text": "go"},
                        headers={"Accept": "application/json"}, expect=(202,))
                    before_cut = await until("delta", FIRST)
                    await halfway.wait()
                    proxy.cut()  # the network drops mid-answer
                    await until("open")  # it reconnected by itself
                    go.set()
                    await until("assistant")
                    assert await node.wait() == 0
            finally:
                if node.returncode is None:
                    node.kill()
                    await node.wait()
    events = [e for e in seen if e["type"] not in ("open", "error")]
    assert [e["type"] for e in events] == ["user", "delta", "delta", "assistant"]
    deltas = "".join(e["data"]["text"] for e in events if e["type"] == "delta")
    assert deltas == FIRST + SECOND == events[-1]["data"]["body"]["text"]
    assert before_cut["id"] == f"0.{len(FIRST)}"
    gets = [h for h in bytes(proxy.sent).split(b"\r\n\r\n") if h.startswith(b"GET ")]
    assert len(gets) == 2
    assert header(gets[0], b"last-event-id") is None
    assert header(gets[1], b"last-event-id") == before_cut["id"].encode()

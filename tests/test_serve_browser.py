"""The page at GET /, driven in a real headless Chromium (Debian's, through Playwright).

Streamed answers, a network drop mid-stream (a proxy between browser and
server cuts every connection) with the full answer after the reconnect,
approving a suspended call, the admin counts changing, older pages of
scrollback. Screenshots are saved and their paths printed for a person.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from serve_support import ADMIN, TOKEN, serving

from torpor import AgentConfig, ExternalTool, Runtime
from torpor.events import ToolCall, ToolResult, UserMessage
from torpor.llm.protocol import ContextMessage, StreamEvent, TextDelta, ToolCallDelta, ToolSpec
from torpor.serve import app, bearer_token
from torpor.serve.client import Client

playwright_api = pytest.importorskip(
    "playwright.async_api", reason="the playwright package is not installed (test extra)"
)


def chromium() -> str | None:
    given = os.environ.get("TORPOR_CHROMIUM")
    if given:
        return given
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


BROWSER = chromium()
pytestmark = pytest.mark.skipif(
    BROWSER is None,
    reason="no Chromium on this machine (apt-get install chromium, or set TORPOR_CHROMIUM)",
)

FIRST_HALF = "The first half of the answer, "
SECOND_HALF = "and the second half, streamed after the reconnect."
APPROVE = ExternalTool("approve", "Ask the person to approve.",
                       {"type": "object", "properties": {"what": {"type": "string"}}})


class BrowserModel:
    """Echo in small chunks; "slow" pauses halfway until the test says go; "!approve" asks."""

    name = "browser"

    def __init__(self) -> None:
        self.halfway = asyncio.Event()
        self.go = asyncio.Event()

    async def stream(
        self, context: Sequence[ContextMessage], tools: Sequence[ToolSpec]
    ) -> AsyncIterator[StreamEvent]:
        last = context[-1]
        if isinstance(last, ToolResult):
            yield TextDelta(f"approved: {last.content}")
            return
        text = last.text if isinstance(last, UserMessage) else ""
        if text.startswith("!approve"):
            yield TextDelta("asking for approval")
            yield ToolCallDelta(ToolCall("call-approve", "approve", {"what": text[9:]}))
            return
        if text.startswith("slow"):
            for word in FIRST_HALF.split(" "):
                yield TextDelta(word + " " if word else "")
            self.halfway.set()
            await self.go.wait()
            yield TextDelta(SECOND_HALF)
            return
        reply = "echo: " + text
        for start in range(0, len(reply), 3):
            yield TextDelta(reply[start:start + 3])
            await asyncio.sleep(0)


class Proxy:
    """A TCP proxy on loopback whose connections the test can cut (a network drop)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.transports: list[asyncio.Transport] = []
        self.server: asyncio.Server | None = None
        self.cuts = 0
        self.refusing = False  # new connections are dropped at once (the network is down)

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refusing:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.close()
            return
        for w in (writer, up_writer):
            self.transports.append(w.transport)  # type: ignore[arg-type]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (OSError, ConnectionError):
                pass
            finally:
                dst.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def cut(self) -> None:
        """Drop every open connection, both ways, at once."""
        self.cuts += 1
        for transport in self.transports:
            transport.abort()
        self.transports.clear()

    async def close(self) -> None:
        self.cut()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


def screenshot_dir() -> Path:
    given = os.environ.get("TORPOR_SCREENSHOTS")
    path = Path(given) if given else Path(tempfile.gettempdir()) / "torpor-screenshots"
    path.mkdir(parents=True, exist_ok=True)
    return path


async def test_the_page_in_a_real_browser(capsys: pytest.CaptureFixture[str]) -> None:
    model = BrowserModel()
    rt = Runtime("sqlite://", model=model, agent=AgentConfig(tools=[APPROVE]))
    application = app(rt, authorize=bearer_token(TOKEN), admin_token=ADMIN)
    shots = screenshot_dir()
    saved: list[Path] = []
    async with serving(application) as url:
        client = Client(url, TOKEN)
        proxy = Proxy(int(url.rsplit(":", 1)[1]))
        proxy_port = await proxy.start()
        base = f"http://127.0.0.1:{proxy_port}"
        async with playwright_api.async_playwright() as p:
            browser = await p.chromium.launch(executable_path=BROWSER,
                                              args=["--no-sandbox", "--disable-gpu"])
            # bypass_csp: the page's CSP forbids eval, which wait_for_function needs
            context = await browser.new_context(viewport={"width": 1100, "height": 760},
                                                bypass_csp=True)
            page = await context.new_page()
            errors: list[str] = []
            page.on("pageerror",
                    lambda exc: errors.append(f"{exc} (after screenshot {len(saved)})"))

            async def shot(name: str) -> None:
                path = shots / f"{len(saved) + 1:02d}-{name}.png"
                await page.screenshot(path=str(path))
                saved.append(path)

            async def until(script: str, arg: Any = None) -> None:
                await page.wait_for_function(script, arg=arg, timeout=20_000)

            try:
                await page.goto(f"{base}/#token={TOKEN}&admin={ADMIN}&c=web")
                await until("document.getElementById('status').textContent === 'live'")

                # 1. a message and its streamed answer
                await page.fill("#text", "hello torpor")
                await page.press("#text", "Enter")
                await until("[...document.querySelectorAll('.msg.assistant:not(.draft)')]"
                            ".some(e => e.textContent === 'echo: hello torpor')")
                await shot("streamed-answer")

                # 2. the network drops mid-stream; the page reconnects; nothing is lost
                await page.fill("#text", "slow answer, please")
                await page.press("#text", "Enter")
                await model.halfway.wait()
                await until("(t) => { const d = document.querySelector('.msg.draft');"
                            " return d && d.textContent === t; }", FIRST_HALF)
                await shot("mid-stream")
                proxy.cut()
                await until("window.torpor.reconnects >= 1")
                await until("document.getElementById('status').textContent === 'live'")
                await shot("reconnected-mid-stream")
                model.go.set()
                full = FIRST_HALF + SECOND_HALF
                await until("(t) => [...document.querySelectorAll('.msg.assistant:not(.draft)')]"
                            ".some(e => e.textContent === t)", full)
                drafts = await page.evaluate("window.torpor.drafts")
                assert drafts[-1]["deltas"] == drafts[-1]["final"] == full  # not one char twice
                await shot("full-answer-after-reconnect")
                texts = await page.eval_on_selector_all(".msg",
                                                        "els => els.map(e => e.textContent)")
                assert texts.count(full) == 1

                # 3. a suspended call, approved from the page
                await page.fill("#text", "!approve the deploy")
                await page.press("#text", "Enter")
                await page.wait_for_selector(".approval button[data-answer=approved]",
                                             timeout=20_000)
                await shot("approval-waiting")
                await page.click(".approval button[data-answer=approved]")
                await until("[...document.querySelectorAll('.msg.assistant')]"
                            ".some(e => e.textContent === 'approved: approved')")
                await shot("approved")

                # 4. the admin view follows the agents live
                cell = "document.querySelector('td[data-state=awaiting_input]')"
                await until(f"{cell} && {cell}.textContent === '1'")
                for cid in ("other-1", "other-2"):
                    await client.call("POST", f"/v1/conversations/{cid}/messages",
                                      json_body={"text": "hi"},
                                      headers={"Accept": "application/json"}, expect=(202,))
                await until(f"{cell} && {cell}.textContent === '3'")
                await shot("admin-counts-changed")

                # 4b. the network is down when a message is sent: the page says so and
                # keeps the text (no page error); Enter once it is back sends it, once
                proxy.refusing = True
                proxy.cut()  # and the browser's pooled connections with it
                await page.evaluate("refreshStats()")  # a failed admin read is a note
                await page.fill("#text", "sent again, logged once")
                await page.press("#text", "Enter")
                await until("document.getElementById('text').value === "
                            "'sent again, logged once'")
                await until("[...document.querySelectorAll('.note')]"
                            ".some(e => e.textContent.startsWith('not sent ('))")
                proxy.refusing = False
                await page.press("#text", "Enter")
                await until("[...document.querySelectorAll('.msg.assistant:not(.draft)')]"
                            ".some(e => e.textContent === 'echo: sent again, logged once')")
                logged = [e.body for e in await rt.history("web")]
                assert sum(getattr(b, "text", None) == "sent again, logged once"
                           for b in logged) == 1
                await shot("sent-after-the-network-came-back")

                # 5. scrollback loads older pages
                for n in range(15):
                    turn = await rt.send("long", f"message {n:02d}")
                    await turn.result()
                await page.goto(f"{base}/#token={TOKEN}&admin={ADMIN}&c=long")
                await page.reload()
                await until("document.querySelectorAll('.msg').length === 20")
                await page.click("#older")
                await until("document.querySelectorAll('.msg').length === 30")
                first = await page.text_content(".msg")
                assert first == "message 00"
                await shot("scrollback-loaded")
                assert not errors, errors
            finally:
                await browser.close()
        assert proxy.cuts == 2
        await proxy.close()
    with capsys.disabled():
        print("\nscreenshots of the page (tests/test_serve_browser.py):")
        for path in saved:
            print(f"  {path}")

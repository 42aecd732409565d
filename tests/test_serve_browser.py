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

import anyio
import pytest
from serve_support import ADMIN, TOKEN, service_of, serving
from starlette.applications import Starlette
from starlette.routing import Mount

from torpor import AgentConfig, ExternalTool, Runtime, ScriptedModel
from torpor.events import Resolved, Suspended, ToolCall, ToolResult, UserMessage
from torpor.llm.protocol import ContextMessage, StreamEvent, TextDelta, ToolCallDelta, ToolSpec
from torpor.llm.scripted import Signal, Text, Wait
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
            # an id of its own per call, as providers give: a page tells old calls from new
            call_id = f"call-{len(context)}"
            yield ToolCallDelta(ToolCall(call_id, "approve", {"what": text[9:]}))
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


# -- issue 24: a native EventSource with a stream ticket; the page under a prefix, on a phone

PARTS = ("Emoji 👩‍👩‍👧 then ", "flags 🇫🇷🇯🇵, ", "combining e\u0301 and 𝄞 ", "the end 🎉")

FOLLOW_WITH_TICKET = """async ([token, cid]) => {
  const minted = await fetch("v1/conversations/" + cid + "/stream-tickets",
                             {method: "POST", headers: {Authorization: "Bearer " + token}});
  const {ticket} = await minted.json();
  const s = window.es = {opens: 0, errors: 0, text: "", final: null, ids: []};
  const es = new EventSource("v1/conversations/" + cid + "/stream?ticket="
                             + encodeURIComponent(ticket));
  es.onopen = () => { s.opens += 1; };
  es.onerror = () => { s.errors += 1; };
  es.addEventListener("delta", (e) => {
    s.text += JSON.parse(e.data).text; s.ids.push(e.lastEventId);
  });
  es.addEventListener("assistant", (e) => { s.final = JSON.parse(e.data).body.text; es.close(); });
  return minted.status;
}"""


async def test_a_native_eventsource_with_a_ticket_survives_three_cuts() -> None:
    """No bearer header (EventSource cannot send one): a ticket in the URL, and the
    browser's own reconnects (Last-Event-ID) through three dropped connections rebuild
    an answer of emoji, flags and combining marks exactly."""
    reached = [anyio.Event() for _ in PARTS[:-1]]
    go = [anyio.Event() for _ in PARTS[:-1]]
    script: list[Any] = []
    for n, part in enumerate(PARTS):
        script.append(Text(part))
        if n < len(reached):
            script += [Signal(reached[n]), Wait(go[n])]
    rt = Runtime("sqlite://", model=ScriptedModel([script]))
    application = app(rt, authorize=bearer_token(TOKEN), admin_token=ADMIN)
    async with serving(application) as url:
        proxy = Proxy(int(url.rsplit(":", 1)[1]))
        base = f"http://127.0.0.1:{await proxy.start()}"
        async with playwright_api.async_playwright() as p:
            browser = await p.chromium.launch(executable_path=BROWSER,
                                              args=["--no-sandbox", "--disable-gpu"])
            page = await (await browser.new_context(bypass_csp=True)).new_page()

            async def until(script: str, arg: Any = None) -> None:
                await page.wait_for_function(script, arg=arg, timeout=20_000)

            try:
                await page.goto(f"{base}/")
                assert await page.evaluate(FOLLOW_WITH_TICKET, [TOKEN, "es"]) == 201
                await until("window.es.opens === 1")
                await Client(url, TOKEN).call(
                    "POST", "/v1/conversations/es/messages", json_body={"text": "go"},
                    headers={"Accept": "application/json"}, expect=(202,))
                for n in range(3):
                    await reached[n].wait()
                    await until("(t) => window.es.text === t", "".join(PARTS[:n + 1]))
                    proxy.cut()  # mid-answer, right after an astral character
                    await until(f"window.es.opens === {n + 2}")  # reconnected by itself
                    go[n].set()
                await until("window.es.final !== null")
                got = await page.evaluate("window.es")
            finally:
                await browser.close()
        await proxy.close()
    answer = "".join(PARTS)
    assert got["text"] == got["final"] == answer  # not one UTF-16 unit twice or missing
    assert got["opens"] == 4 and got["errors"] >= 3
    assert proxy.cuts == 4  # three mid-answer, one at close


STALE_PAIRS = 7  # messages between the old approval and the new: the first page of 20
# events then ends between the old call's suspension and its answer

LAYOUT = """() => ({
    chat: document.getElementById('chat').getBoundingClientRect().width,
    scroll: document.documentElement.scrollWidth,
    inner: window.innerWidth,
    widest: Math.max(...[...document.querySelectorAll('.msg')]
                     .map(e => e.getBoundingClientRect().right)),
})"""


class PrefixedPage:
    """The page of an app mounted under /chat/, in one browser context of a given width."""

    def __init__(self, url: str, width: int, shots: Path, saved: list[Path]) -> None:
        self.url, self.width, self.shots, self.saved = url, width, shots, saved
        self.errors: list[str] = []
        self.outside: list[str] = []  # responses refused, or from outside /chat/

    async def open(self, browser: Any, height: int) -> Any:
        context = await browser.new_context(viewport={"width": self.width, "height": height},
                                            bypass_csp=True)
        self.page = await context.new_page()
        self.page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        self.page.on("response", self._response)
        return context

    def _response(self, response: Any) -> None:
        if response.status >= 400 or not response.url.startswith(f"{self.url}/chat/"):
            self.outside.append(f"{response.status} {response.url}")

    async def until(self, script: str, arg: Any = None) -> None:
        await self.page.wait_for_function(script, arg=arg, timeout=20_000)

    async def shot(self, name: str) -> None:
        path = self.shots / f"prefix-{self.width}px-{name}.png"
        await self.page.screenshot(path=str(path))
        self.saved.append(path)


async def test_the_page_under_a_prefix_at_desktop_and_phone_width(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Mounted under /chat/ (every call relative), at 1280 and 390 px: an open approval with
    its buttons, a scrolled-back history whose old approval, answered long ago, shows none
    (the first history page ended between its suspension and its answer)."""
    rt = Runtime("sqlite://", model=BrowserModel(), agent=AgentConfig(tools=[APPROVE]))
    torpor_app = app(rt, authorize=bearer_token(TOKEN), admin_token=ADMIN)
    host = Starlette(routes=[Mount("/chat", app=torpor_app)])
    shots = screenshot_dir()
    saved: list[Path] = []
    # the host runs the runtime (as a host's lifespan would): the mounted app starts itself
    async with rt, serving(host) as url:
        # an approval answered long ago, messages, then an approval still open
        await (await rt.send("stale", "!approve the old deploy")).result()
        (old_call,) = await rt.store.open_calls("stale")
        continuation = await rt.resolve("stale", old_call.call_id, "approved")
        assert continuation is not None
        await continuation.result()
        for n in range(STALE_PAIRS):
            await (await rt.send("stale", f"message {n}: " + "words " * (n * 3))).result()
        await (await rt.send("stale", "!approve the new deploy")).result()
        (new_call,) = await rt.store.open_calls("stale")
        first_page = await rt.history("stale", limit=20)
        resolved = [e.body for e in first_page if isinstance(e.body, Resolved)]
        suspended = [e.body for e in first_page if isinstance(e.body, Suspended)]
        assert [r.call_id for r in resolved] == [old_call.call_id]  # its answer is on it,
        assert [s.call_ids for s in suspended] == [(new_call.call_id,)]  # its suspension not
        open_box = f'.approval[data-calls~="{new_call.call_id}"]'
        stale_box = f'.approval[data-calls~="{old_call.call_id}"]'

        async with playwright_api.async_playwright() as p:
            browser = await p.chromium.launch(executable_path=BROWSER,
                                              args=["--no-sandbox", "--disable-gpu"])
            try:
                for width, height in ((1280, 800), (390, 844)):
                    view = PrefixedPage(url, width, shots, saved)
                    context = await view.open(browser, height)
                    page = view.page
                    await page.goto(f"{url}/chat/#token={TOKEN}&admin={ADMIN}&c=stale")
                    await view.until("document.getElementById('status').textContent === 'live'")
                    cell = "document.querySelector('td[data-state=suspended]')"
                    await view.until(f"{cell} && {cell}.textContent === '1'")  # admin, relative
                    await page.wait_for_selector(f"{open_box} button[data-answer=approved]")
                    await view.shot("approval-open")
                    await page.click("#older")
                    await page.wait_for_selector(stale_box)
                    assert await page.locator(f"{stale_box} button").count() == 0
                    assert await page.text_content(f"{stale_box} .done") == "answered"
                    assert await page.locator(f"{open_box} button").count() == 2
                    await page.evaluate("document.getElementById('log').scrollTop = 0")
                    await view.shot("scrolled-back")
                    layout = await page.evaluate(LAYOUT)
                    assert layout["scroll"] <= layout["inner"], layout  # no sideways scroll
                    assert layout["widest"] <= layout["inner"], layout
                    assert layout["chat"] > (300 if width == 390 else 800), layout
                    if width == 390:  # approved from the phone: the answer streams in
                        await page.click(f"{open_box} button[data-answer=approved]")
                        await view.until("[...document.querySelectorAll('.msg.assistant')]"
                                         ".some(e => e.textContent === 'approved: approved')")
                        await page.evaluate("document.getElementById('log').scrollTop = 1e9")
                        await view.shot("approved")
                    assert not view.errors, view.errors
                    assert not view.outside, view.outside  # every call under /chat/, none refused
                    await context.close()
            finally:
                await browser.close()
        assert await rt.store.open_calls("stale") == []
        await service_of(torpor_app).shutdown(0)  # its streams end before the server stops
    with capsys.disabled():
        print("\nscreenshots of the page under /chat/ (tests/test_serve_browser.py):")
        for path in saved:
            print(f"  {path}")

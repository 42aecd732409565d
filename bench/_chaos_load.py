"""A bounded client load for a chaos run: what clients of a torpor cluster do and see.

``clients`` loops, each picking one of ``conversations`` at random, send a message to a
random node of the load balancer's list (``targets``: a node that leaves is drained from
it first; a killed or stopped node stays in it, as a balancer without health checks
would keep it) with an ``Idempotency-Key``, and read the turn's Server-Sent Events
through to its end (an answer or an abort). A share of sends are fire-and-forget
(``Accept: application/json``, 202) and followed at once by a streamed send to the same
conversation, so postponed messages are in the log when a fault strikes.

An attempt that fails (503, 421, 429, 5xx, a network error or timeout, a stream cut or
ended by an ``error`` event before the turn ended) is retried under the same key on
another node (the owner a 421 names, if known) until ``deadline``; a send is
*acknowledged* once a 202 or the stream's ``user`` event for it arrived (it is durable).
Every attempt is counted, with its outcome, in the window open when it ended.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from _chaos_nodes import Node, Nodes

__all__ = ["Load", "Window"]

_NET_ERRORS = (OSError, ConnectionError, asyncio.IncompleteReadError, ValueError,
               UnicodeDecodeError)
_FATAL = {400, 401, 403, 404, 409, 413, 422}  # retrying the same request cannot help


@dataclass
class Window:
    """What clients saw while one fault window was open."""

    name: str
    started: float = field(default_factory=time.monotonic)
    requests: int = 0  # HTTP attempts
    errors: Counter[str] = field(default_factory=Counter)  # failed attempts, by kind
    errors_at_down_nodes: int = 0  # of those, sent to a node killed or stopped then
    sends: int = 0  # sends that ended (answered, aborted, accepted, failed or given up)
    sends_with_errors: int = 0  # sends that met their first failed attempt in this window
    acknowledged: int = 0
    answered: int = 0
    aborted: int = 0
    accepted: int = 0  # fire-and-forget sends acknowledged with 202
    failed: int = 0  # refused with a status retrying cannot change (4xx)
    gave_up: int = 0  # not done within the deadline
    proxied: int = 0  # streams relayed by a node that did not own the conversation
    durations: list[float] = field(default_factory=list)  # per send ended: first try to end

    def report(self) -> dict[str, Any]:
        errors = sum(self.errors.values())
        return {
            "seconds": round(time.monotonic() - self.started, 2),
            "requests": self.requests, "errors": errors,
            "error_rate": round(errors / self.requests, 5) if self.requests else None,
            "errors_at_down_nodes": self.errors_at_down_nodes,
            "errors_by_kind": dict(self.errors.most_common()),
            "status_500": sum(n for k, n in self.errors.items() if " 500" in k),
            "sends": self.sends, "sends_with_errors": self.sends_with_errors,
            "send_error_rate": round(self.sends_with_errors / self.sends, 5)
            if self.sends else None,
            "acknowledged": self.acknowledged, "answered": self.answered,
            "aborted": self.aborted, "accepted": self.accepted, "failed": self.failed,
            "gave_up": self.gave_up, "proxied": self.proxied,
            "send_p50_s": _quantile(self.durations, 0.5),
            "send_p99_s": _quantile(self.durations, 0.99),
            "send_max_s": _quantile(self.durations, 1.0),
        }


def _quantile(samples: list[float], q: float) -> float | None:
    if not samples:
        return None
    ordered = sorted(samples)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


@dataclass
class Attempt:
    result: str  # answered | aborted | accepted | retry | failed
    error: str | None = None
    acked: bool = False
    owner: str | None = None  # the owner a 421 named
    proxied: bool = False


class Load:
    def __init__(self, nodes: Nodes, *, clients: int, conversations: list[str],
                 text_chars: int, json_share: float, think: float, deadline: float,
                 head_timeout: float, read_timeout: float, seed: int) -> None:
        self.nodes = nodes
        self.clients = clients
        self.conversations = conversations
        self.text_chars = text_chars
        self.json_share = json_share
        self.think = think
        self.deadline = deadline
        self.head_timeout = head_timeout
        self.read_timeout = read_timeout
        self.seed = seed
        self.targets: list[str] = []  # node names the balancer sends to
        self.window = Window("start")
        self.acked: dict[str, str] = {}  # text -> conversation
        self.tried: dict[str, str] = {}  # every text sent at least once -> conversation
        self.reserved: set[str] = set()  # conversations the clients leave alone
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.ensure_future(self._client(c)) for c in range(self.clients)]

    async def stop(self) -> None:
        """Clients finish the send they are on (bounded by the deadline), then stop."""
        self._stop.set()
        await asyncio.gather(*self._tasks)

    def begin(self, name: str) -> Window:
        """Open a new window; the previous one's counts end here."""
        previous, self.window = self.window, Window(name)
        return previous

    async def send_once(self, rng: random.Random, cid: str, text: str, *,
                        streamed: bool = True) -> None:
        """One send, retried like the clients' (counted in the open window)."""
        await self._send(rng, cid, text, streamed=streamed)

    # -- one client ---------------------------------------------------------------------
    async def _client(self, number: int) -> None:
        rng = random.Random(self.seed * 1000 + number)
        seq = 0
        while not self._stop.is_set():
            cid = rng.choice([c for c in self.conversations if c not in self.reserved])
            if rng.random() < self.json_share:
                seq += 1
                await self._send(rng, cid, self._text(cid, number, seq), streamed=False)
            seq += 1
            await self._send(rng, cid, self._text(cid, number, seq), streamed=True)
            if self.think:
                await asyncio.sleep(self.think * rng.uniform(0.5, 1.5))

    def _text(self, cid: str, client: int, seq: int) -> str:
        text = f"{cid} c{client} s{seq}"
        return text + " ." * max(0, (self.text_chars - len(text)) // 2)

    def _pick(self, rng: random.Random, owner: str | None) -> Node | None:
        names = self.targets
        if owner is not None:
            named = [n for n in names if self.nodes.by_name[n].address == owner]
            if named:
                return self.nodes.by_name[named[0]]
        return self.nodes.by_name[rng.choice(names)] if names else None

    async def _send(self, rng: random.Random, cid: str, text: str, *, streamed: bool) -> None:
        key = "k-" + " ".join(text.split()[:3])  # the words that make each text unique
        self.tried[text] = cid
        began = time.monotonic()
        deadline = began + self.deadline
        owner: str | None = None
        acked = erred = False
        tries = 0
        while True:
            node = self._pick(rng, owner)
            if node is None:  # no node to send to: wait for one, within the deadline
                attempt = Attempt("retry")
                await asyncio.sleep(0.1)
            elif streamed:
                attempt = await self._streamed(node, cid, text, key)
            else:
                attempt = await self._accepted(node, cid, text, key)
            window = self.window
            window.requests += node is not None
            window.proxied += attempt.proxied
            if attempt.error is not None:
                if not erred:  # counted where the send first met an error
                    erred = True
                    window.sends_with_errors += 1
                window.errors[attempt.error] += 1
                if node is not None and node.state in ("killed", "stopped"):
                    window.errors_at_down_nodes += 1
            if attempt.acked and not acked:
                acked = True
                self.acked[text] = cid
                window.acknowledged += 1
            done = attempt.result != "retry" or time.monotonic() > deadline
            if done:
                outcome = attempt.result if attempt.result != "retry" else "gave_up"
                setattr(window, outcome, getattr(window, outcome) + 1)
                window.sends += 1
                window.durations.append(time.monotonic() - began)
                return
            owner = attempt.owner
            tries += 1
            await asyncio.sleep(min(1.0, 0.05 * 2 ** min(tries, 5)) * rng.uniform(0.5, 1.0))

    async def _accepted(self, node: Node, cid: str, text: str, key: str) -> Attempt:
        conn = node.client.connection()  # ours, so a timeout can cut it
        try:
            async with asyncio.timeout(self.head_timeout):
                _, response = await node.client.open(
                    "POST", f"/v1/conversations/{cid}/messages", json_body={"text": text},
                    headers={"Accept": "application/json", "Idempotency-Key": key,
                             "Connection": "close"}, conn=conn)
                raw = await response.read()
            if response.status == 202:
                return Attempt("accepted", acked=True)
            return _refused(response.status, raw)
        except TimeoutError:
            return Attempt("retry", "timeout before the status line")
        except _NET_ERRORS as exc:
            return Attempt("retry", f"network {type(exc).__name__}")
        finally:
            conn.abort()

    async def _streamed(self, node: Node, cid: str, text: str, key: str) -> Attempt:
        conn = node.client.connection()  # ours, so a timeout can cut it
        response = None
        acked = proxied = False
        turn: int | None = None
        try:
            async with asyncio.timeout(self.head_timeout):
                _, response = await node.client.open(
                    "POST", f"/v1/conversations/{cid}/messages", json_body={"text": text},
                    headers={"Accept": "text/event-stream", "Idempotency-Key": key,
                             "Connection": "close"}, conn=conn)
                if response.status != 200:
                    return _refused(response.status, await response.read())
            proxied = "x-torpor-owner" in response.headers
            events = response.events().__aiter__()
            while True:
                try:
                    async with asyncio.timeout(self.read_timeout):
                        event = await anext(events)
                except StopAsyncIteration:
                    where = "after" if acked else "before"
                    return Attempt("retry", f"stream ended {where} the user event", acked,
                                   proxied=proxied)
                if event.event == "error":
                    problem = _json(event.data)
                    return Attempt("retry", f"sse {problem.get('status')} "
                                   f"{problem.get('error')}", acked, proxied=proxied)
                if event.event in ("delta", "message") or not event.data:
                    continue
                data = _json(event.data)
                if turn is None and event.event == "user":
                    if data.get("body", {}).get("text") != text:
                        return Attempt("failed", "stream began with another message",
                                       proxied=proxied)
                    acked, turn = True, data.get("turn")
                    continue
                if turn is None or data.get("turn") != turn:
                    continue  # another turn's events (ours was postponed behind it)
                if event.event == "assistant" and not data.get("body", {}).get("tool_calls"):
                    return Attempt("answered", acked=True, proxied=proxied)
                if event.event in ("aborted", "suspended"):
                    return Attempt("aborted", acked=True, proxied=proxied)
        except TimeoutError:
            where = ("before the status line" if response is None else
                     "before the user event" if turn is None else "mid-turn")
            return Attempt("retry", f"timeout {where}", acked, proxied=proxied)
        except _NET_ERRORS as exc:
            return Attempt("retry", f"network {type(exc).__name__}", acked, proxied=proxied)
        finally:
            conn.abort()


def _json(raw: str | bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _refused(status: int, raw: bytes) -> Attempt:
    problem = _json(raw)
    kind = f"http {status} {problem.get('error') or problem.get('title') or ''}".strip()
    if status in _FATAL:
        return Attempt("failed", kind)
    owner = problem.get("owner") if status == 421 else None
    return Attempt("retry", kind, owner=owner if isinstance(owner, str) else None)
